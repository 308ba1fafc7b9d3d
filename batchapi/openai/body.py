"""Parse and check the ``body`` of one OpenAI batch request line.

Pure Python (no torch, no database), reached through ``lines.parse_line`` by validation,
the shard reader and ``run-batch`` alike, so all agree on what a body means. Errors are
``RequestError`` with the OpenAI ``param`` and an ``ErrorCode``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchapi.openai.errors import ErrorCode, RequestError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_N = 128
MAX_STOP = 4
# fields OpenAI accepts that do not change generation here
IGNORED = {"user", "store", "metadata", "service_tier", "stream_options"}


@dataclass
class ParsedBody:
    """A checked request body. Exactly one of ``messages`` and ``prompt`` is set."""

    model: str
    messages: list[dict[str, str]] | None = None
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


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("'messages' is required", "messages", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", "messages")
    out = []
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError("each message must be an object", param, ErrorCode.INVALID_TYPE)
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(
                f"invalid role {role!r}; expected one of {sorted(CHAT_ROLES)}", f"{param}.role"
            )
        content = msg.get("content")
        if content is None:
            raise RequestError("'content' is required", f"{param}.content", ErrorCode.MISSING_REQUIRED_PARAMETER)
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content_text(content, f"{param}.content")})
    return out


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
    "stop_token_ids", "n", "logprobs", "top_logprobs", "ignore_eos", "stream",
} | IGNORED
COMPLETION_FIELDS = (CHAT_FIELDS - {"messages", "max_completion_tokens", "top_logprobs"}) | {
    "prompt", "echo", "suffix", "best_of",
}


def parse_body(endpoint: str, body: Any) -> ParsedBody:
    """Check ``body`` for ``endpoint``; raise ``RequestError`` on the first problem."""
    if endpoint not in ENDPOINTS:
        raise RequestError(f"unsupported endpoint {endpoint!r}; expected one of {list(ENDPOINTS)}", "url")
    if not isinstance(body, dict):
        raise RequestError("'body' must be an object", "body", ErrorCode.INVALID_TYPE)
    allowed = CHAT_FIELDS if endpoint == CHAT else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unrecognized request argument: {unknown[0]!r}", unknown[0], ErrorCode.UNKNOWN_PARAMETER)
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
