"""Errors the service raises for callers to handle; ``batchapi.api`` maps them to HTTP."""

from __future__ import annotations

from sqlalchemy.exc import OperationalError


class ServiceError(Exception):
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class NotFound(ServiceError):
    """The object does not exist, or belongs to another project (both look the same)."""


class InvalidRequest(ServiceError):
    code = "invalid_request"


class ModelNotServed(InvalidRequest):
    """A request names a model this deployment does not serve (``models.registry`` says which)."""

    code = "model_not_found"


class Conflict(ServiceError):
    """The request is well formed but the object's state does not allow it."""

    code = "conflict"


class Unauthenticated(ServiceError):
    code = "invalid_api_key"


class RateLimited(ServiceError):
    """Over a limit that passes with time (a quota of unfinished work, concurrent requests): 429."""

    code = "rate_limit_exceeded"


class StorageError(ServiceError):
    code = "storage_error"


# what a retry may get past: the database or the object store briefly away. OSError is here for
# the service's own loops (a claim, a store, a sweep): each sets the row aside and meets it again
# on its next try, so an OSError that lasts costs a log line there, never a stuck worker
TRANSIENT = (OperationalError, StorageError, OSError)
# what a Celery task is retried for (``autoretry_for``): TRANSIENT less OSError. A task's body
# (``ShardRunner.run_shard``) reads storage only where it catches TRANSIENT itself, so what is
# briefly away when a task fails is the database (OperationalError) or the object store
# (StorageError); an OSError that escapes is one no retry gets past (a FileNotFoundError of a
# missing model directory, a PermissionError), which retried fails the same way five times over,
# minutes of backoff, before its cause shows
TASK_RETRY = tuple(kind for kind in TRANSIENT if kind is not OSError)
