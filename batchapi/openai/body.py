"""Parse and check the ``body`` of one OpenAI batch request line.

Pure Python (no torch, no database), reached through ``lines.parse_line`` by validation,
the shard reader and ``run-batch`` alike, so all agree on what a body means. Errors are
``RequestError`` with the OpenAI ``param`` and an ``ErrorCode``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batchapi.openai.errors import ErrorCode, RequestError, refuse_unknown
from batchapi.openai.schema import check_schema
from batchapi.openai.tools import NAME, parse_tools

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_N = 128
MAX_STOP = 4
# fields OpenAI accepts that do not change generation here
IGNORED = {"user", "store", "metadata", "service_tier", "stream_options"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


@dataclass
class ParsedBody:
    """A checked request body. Exactly one of ``messages`` and ``prompt`` is set.

    ``messages`` are as a chat template takes them: ``role`` (``developer`` read as ``system``)
    and ``content``, always a string, plus ``name`` when given, ``tool_calls`` (their
    ``arguments`` parsed into a dict) on assistant turns and ``tool_call_id`` on tool turns. The
    fields from ``response_format`` on are chat-only (``tools`` explains the tool fields).
    """

    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    response_format: str = "text"  # one of RESPONSE_FORMATS
    json_schema: dict | None = None  # the schema of a "json_schema" format, and its name and strict flag
    json_schema_name: str | None = None
    json_schema_strict: bool = False
    tools: list[dict] | None = None  # [{"type": "function", "function": {name, description?, parameters}}]
    tool_choice: str = "none"  # "none" | "auto" | "required"; a named function is "required" with tool_name
    tool_name: str | None = None
    parallel_tool_calls: bool = True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise RequestError(f"'{name}' must be a number, got {type(value).__name__}", name, ErrorCode.INVALID_TYPE)
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise RequestError(f"'{name}' must be an integer, got {type(value).__name__}", name, ErrorCode.INVALID_TYPE)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise RequestError(f"'{name}' must be {bound}, got {value}", name)
    return value


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    "only text content parts ({'type': 'text', 'text': ...}) are supported",
                    f"{param}[{i}]",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError("'content' must be a string or a list of text parts", param, ErrorCode.INVALID_TYPE)


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("'messages' is required", "messages", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", "messages")
    out = [_message(msg, f"messages[{i}]") for i, msg in enumerate(messages)]
    _check_tool_turns(out)
    return out


def _message(msg: Any, param: str) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise RequestError("each message must be an object", param, ErrorCode.INVALID_TYPE)
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise RequestError(f"invalid role {role!r}; expected one of {sorted(CHAT_ROLES)}", f"{param}.role")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    calls = msg.get("tool_calls") if role == "assistant" else None
    calls = None if calls == [] else calls
    content = msg.get("content")
    if content is None and calls is None:
        raise RequestError("'content' is required", f"{param}.content", ErrorCode.MISSING_REQUIRED_PARAMETER)
    out["content"] = "" if content is None else _content_text(content, f"{param}.content")
    name = msg.get("name")
    if name is not None:
        if not isinstance(name, str) or not name:
            raise RequestError("'name' must be a non-empty string", f"{param}.name", ErrorCode.INVALID_TYPE)
        out["name"] = name
    if calls is not None:
        out["tool_calls"] = _tool_calls(calls, f"{param}.tool_calls")
    if role == "tool":
        out["tool_call_id"] = _tool_call_id(msg.get("tool_call_id"), f"{param}.tool_call_id")
    return out


def _tool_call_id(call_id: Any, param: str) -> str:
    if call_id is None:
        raise RequestError("'tool_call_id' is required", param, ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(call_id, str):
        raise RequestError("'tool_call_id' must be a string", param, ErrorCode.INVALID_TYPE)
    return call_id


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not calls:
        raise RequestError("'tool_calls' must be a non-empty array", param, ErrorCode.INVALID_TYPE)
    out = []
    for i, call in enumerate(calls):
        at = f"{param}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(call.get("id"), str) or call.get("type") != "function":
            raise RequestError("each tool call must be {'id': str, 'type': 'function', 'function': {'name', "
                               "'arguments'}}", at)
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise RequestError(f"invalid function name {name!r}", f"{at}.function.name")
        if any(call["id"] == seen["id"] for seen in out):
            raise RequestError(f"the tool call id {call['id']!r} is used twice", f"{at}.id")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": name, "arguments": _arguments(arguments, f"{at}.function.arguments")}})
    return out


def _arguments(arguments: Any, param: str) -> dict:
    if not isinstance(arguments, str):
        raise RequestError("'arguments' must be a string holding a JSON object", param, ErrorCode.INVALID_TYPE)
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise RequestError(f"'arguments' must be a string holding a JSON object, got {arguments[:100]!r}", param)
    return value


def _check_tool_turns(messages: list[dict[str, Any]]) -> None:
    """As OpenAI: tool messages answer the calls of the assistant message just before them, each call once."""
    waiting: set[str] = set()
    for i, msg in enumerate(messages):
        if msg["role"] == "tool":
            if msg["tool_call_id"] not in waiting:
                raise RequestError("a 'tool' message must answer a call of the assistant's 'tool_calls' just "
                                   f"before it; {msg['tool_call_id']!r} is not one awaiting an answer",
                                   f"messages[{i}].tool_call_id")
            waiting.discard(msg["tool_call_id"])
            continue
        if waiting:
            raise RequestError(f"the tool call {sorted(waiting)[0]!r} has no 'tool' message answering it",
                               f"messages[{i}]")
        waiting = {call["id"] for call in msg.get("tool_calls", ())}
    if waiting:
        raise RequestError(f"the tool call {sorted(waiting)[0]!r} has no 'tool' message answering it", "messages")


def _response_format(body: dict, parsed: ParsedBody) -> None:
    value = body.get("response_format")
    if value is None:
        return
    if not isinstance(value, dict):
        raise RequestError("'response_format' must be an object", "response_format", ErrorCode.INVALID_TYPE)
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise RequestError(f"invalid value {kind!r}; expected one of {list(RESPONSE_FORMATS)}", "response_format.type")
    refuse_unknown(value, {"type", "json_schema"} if kind == "json_schema" else {"type"}, "response_format")
    parsed.response_format = kind
    if kind != "json_schema":
        return
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if spec is None:
        raise RequestError("'json_schema' is required", param, ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(spec, dict):
        raise RequestError("'json_schema' must be an object", param, ErrorCode.INVALID_TYPE)
    refuse_unknown(spec, {"name", "schema", "strict", "description"}, param)
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
    parsed.json_schema, parsed.json_schema_name, parsed.json_schema_strict = schema, name, strict is True


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("'prompt' is required", "prompt", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise RequestError(
        "'prompt' must be a string or an array of token ids (one prompt per request)", "prompt"
    )


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a non-empty string or an array of them", "stop", ErrorCode.INVALID_TYPE)
    if len(stop) > MAX_STOP:
        raise RequestError(f"'stop' may hold at most {MAX_STOP} sequences", "stop")
    return stop


def _logit_bias(body: dict) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise RequestError("'logit_bias' must be an object of token id to bias", "logit_bias", ErrorCode.INVALID_TYPE)
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if token < 0 or not _is_number(value) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias[{key}] must be a number between -100 and 100", "logit_bias")
        out[token] = float(value)
    return out


def _stop_token_ids(body: dict) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
        raise RequestError("'stop_token_ids' must be an array of token ids", "stop_token_ids", ErrorCode.INVALID_TYPE)
    return ids


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean", name, ErrorCode.INVALID_TYPE)
    return value


CHAT_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "stop",
    "stop_token_ids", "n", "logprobs", "top_logprobs", "ignore_eos", "stream", "response_format", "tools",
    "tool_choice", "parallel_tool_calls",
} | IGNORED
CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
             "parallel_tool_calls"}
COMPLETION_FIELDS = (CHAT_FIELDS - CHAT_ONLY) | {
    "prompt", "echo", "suffix", "best_of",
}


def parse_body(endpoint: str, body: Any) -> ParsedBody:
    """Check ``body`` for ``endpoint``; raise ``RequestError`` on the first problem."""
    if endpoint not in ENDPOINTS:
        raise RequestError(f"unsupported endpoint {endpoint!r}; expected one of {list(ENDPOINTS)}", "url")
    if not isinstance(body, dict):
        raise RequestError("'body' must be an object", "body", ErrorCode.INVALID_TYPE)
    allowed = CHAT_FIELDS if endpoint == CHAT else COMPLETION_FIELDS
    refuse_unknown(body, allowed)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required and must be a string", "model", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if body.get("stream"):
        raise RequestError("'stream' is not supported in a batch", "stream")
    if endpoint == COMPLETIONS:
        for name in ("echo", "suffix"):
            if body.get(name):
                raise RequestError(f"'{name}' is not supported", name)
        best_of = _integer(body, "best_of", 1, MAX_N, None)
        if best_of not in (None, 1) and best_of != body.get("n", 1):
            raise RequestError("'best_of' other than n is not supported", "best_of")

    parsed = ParsedBody(model=model)
    if endpoint == CHAT:
        parsed.messages = _messages(body)
        token_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        parsed.max_tokens = _integer(body, token_field, 1, None, None)
        parsed.logprobs = _bool(body, "logprobs")
        parsed.top_logprobs = _integer(body, "top_logprobs", 0, 20, 0)
        if parsed.top_logprobs and not parsed.logprobs:
            raise RequestError("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        _response_format(body, parsed)
        parsed.tools, parsed.tool_choice, parsed.tool_name, parsed.parallel_tool_calls = parse_tools(body)
    else:
        parsed.prompt = _prompt(body)
        parsed.max_tokens = _integer(body, "max_tokens", 1, None, 16)
        # completions: logprobs is the number of alternatives to return (0-5)
        count = _integer(body, "logprobs", 0, 5, None)
        parsed.logprobs = count is not None
        parsed.top_logprobs = count or 0

    parsed.temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    parsed.top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if parsed.top_p == 0.0:
        raise RequestError("'top_p' must be greater than 0", "top_p")
    parsed.top_k = _integer(body, "top_k", -1, None, -1)
    parsed.min_p = _number(body, "min_p", 0.0, 1.0, 0.0)
    parsed.seed = _integer(body, "seed", -(2**63), 2**63 - 1, None)
    parsed.presence_penalty = _number(body, "presence_penalty", -2.0, 2.0, 0.0)
    parsed.frequency_penalty = _number(body, "frequency_penalty", -2.0, 2.0, 0.0)
    parsed.logit_bias = _logit_bias(body)
    parsed.stop = _stop(body)
    parsed.stop_token_ids = _stop_token_ids(body)
    parsed.n = _integer(body, "n", 1, MAX_N, 1)
    parsed.ignore_eos = _bool(body, "ignore_eos")
    return parsed
