"""Errors the service raises for callers to handle; ``batchapi.api`` maps them to HTTP."""

from __future__ import annotations


class JobsError(Exception):
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class NotFound(JobsError):
    """The object does not exist, or belongs to another project (both look the same)."""


class InvalidRequest(JobsError):
    code = "invalid_request"


class Conflict(JobsError):
    """The request is well formed but the object's state does not allow it."""

    code = "conflict"


class Unauthenticated(JobsError):
    code = "invalid_api_key"


class StorageError(JobsError):
    code = "storage_error"
