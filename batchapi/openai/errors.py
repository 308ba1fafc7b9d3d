"""The error codes of the wire format, one enum, and the error a request line or body raises.

Every code a user can see in a batch's ``errors``, in an error-file line or in a 400 body of
one request is a member of ``ErrorCode``; layers pass the member, never message text to match.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    # a line of the input file
    INVALID_ENCODING = "invalid_encoding"  # not UTF-8, or a lone UTF-16 surrogate escape in a string
    LINE_TOO_LONG = "line_too_long"
    INVALID_JSON_LINE = "invalid_json_line"
    MISSING_CUSTOM_ID = "missing_custom_id"
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    INVALID_METHOD = "invalid_method"
    INVALID_URL = "invalid_url"
    # a request body (OpenAI's own codes)
    INVALID_VALUE = "invalid_value"
    INVALID_TYPE = "invalid_type"
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    UNKNOWN_PARAMETER = "unknown_parameter"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_JSON_SCHEMA = "invalid_json_schema"  # a response format's or a tool's schema the grammar cannot enforce
    # the file or the batch as a whole
    MISMATCHED_MODEL = "mismatched_model"
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_NOT_AVAILABLE = "model_not_available"
    TOO_MANY_LINES = "too_many_lines"
    TOO_MANY_INPUTS = "too_many_inputs"  # embedding inputs across a batch's lines
    EMPTY_FILE = "empty_file"
    FILE_NOT_FOUND = "file_not_found"
    FILE_TOO_LARGE = "file_too_large"
    VALIDATION_ERROR = "validation_error"
    # over the project's quota for the model when the batch would start (``batches.sharing.quotas``)
    TOKEN_LIMIT_EXCEEDED = "token_limit_exceeded"  # OpenAI's: enqueued tokens
    BATCH_LIMIT_EXCEEDED = "batch_limit_exceeded"  # unfinished batches
    # the batch's cost reached its ``max_cost``: stopped as a cancel stops it
    MAX_COST_REACHED = "max_cost_reached"
    # a request that was not run, or not to the end (the error file's ``error.code``)
    BATCH_CANCELLED = "batch_cancelled"
    BATCH_EXPIRED = "batch_expired"
    SHARD_FAILED = "shard_failed"
    # the engine failed, not the request
    SERVER_ERROR = "server_error"


class RequestError(ValueError):
    """What is wrong with one request line or its body.

    ``param`` names the field as the endpoint sees it: a body field for a body problem
    (``messages[0].role``), a field of the line otherwise (``custom_id``, ``url``);
    ``line_param`` names it within the line (``body.messages[0].role``), as validation reports
    it. ``custom_id`` is the line's, once it is known to be good.
    """

    def __init__(self, message: str, param: str | None = None, code: ErrorCode = ErrorCode.INVALID_VALUE,
                 *, in_body: bool = True, custom_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = ErrorCode(code)
        self.in_body = in_body
        self.custom_id = custom_id

    @property
    def line_param(self) -> str | None:
        if not self.in_body:
            return self.param
        return "body" if self.param in (None, "body") else f"body.{self.param}"


def refuse_unknown(value: dict, allowed: set[str], param: str | None = None) -> None:
    """Refuse the first field of ``value`` (an object at ``param``, None for the body) not in ``allowed``."""
    unknown = sorted(set(value) - allowed)
    if unknown:
        where = f"{param}.{unknown[0]}" if param else unknown[0]
        raise RequestError(f"unrecognized request argument: {unknown[0]!r}", where, ErrorCode.UNKNOWN_PARAMETER)
