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


class StorageError(ServiceError):
    code = "storage_error"


# what a retry may get past: the database or the object store briefly away
TRANSIENT = (OperationalError, StorageError, OSError)
