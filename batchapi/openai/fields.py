"""Checks of single body fields that the chat, completions and Responses parsers share.

Each reads one field of a body (or checks one value) and raises ``RequestError`` with the
field's OpenAI ``param`` and an ``ErrorCode``; ``body`` and ``responses`` both build on them.
"""

from __future__ import annotations

from typing import Any

from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.schema import check_schema
from batchapi.openai.tools import NAME

RESPONSE_FORMATS = ("text", "json_object", "json_schema")  # chat's response_format, the Responses API's text.format


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value):
        raise RequestError(f"'{name}' must be a number, got {type(value).__name__}", name, ErrorCode.INVALID_TYPE)
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def integer(body: dict, name: str, low: int, high: int | None, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise RequestError(f"'{name}' must be an integer, got {type(value).__name__}", name, ErrorCode.INVALID_TYPE)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise RequestError(f"'{name}' must be {bound}, got {value}", name)
    return value


def boolean(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean", name, ErrorCode.INVALID_TYPE)
    return value


def json_schema_format(spec: dict, param: str) -> tuple[dict, str, bool]:
    """``(schema, name, strict)`` of a JSON-schema output format: chat's
    ``response_format.json_schema`` or the Responses API's ``text.format``, both an object of
    ``name``, ``schema``, ``strict`` and ``description`` at ``param`` (the caller refuses other fields)."""
    name = spec.get("name")
    if name is None:
        raise RequestError("'name' is required", f"{param}.name", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RequestError(f"invalid name {name!r}: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'", f"{param}.name")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise RequestError("'description' must be a string", f"{param}.description", ErrorCode.INVALID_TYPE)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError("'strict' must be a boolean", f"{param}.strict", ErrorCode.INVALID_TYPE)
    schema = spec.get("schema")
    if schema is None:
        raise RequestError("'schema' is required", f"{param}.schema", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(schema, dict):
        raise RequestError("'schema' must be a JSON schema object", f"{param}.schema", ErrorCode.INVALID_TYPE)
    check_schema(schema, f"{param}.schema", strict=strict is True)
    return schema, name, strict is True
