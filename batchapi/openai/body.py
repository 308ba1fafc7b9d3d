"""Parse and check the ``body`` of one OpenAI batch request line.

Pure Python (no torch, no database), reached through ``lines.parse_line`` by validation,
the shard reader and ``run-batch`` alike, so all agree on what a body means. Errors are
``RequestError`` with the OpenAI ``param`` and an ``ErrorCode``. Chat and completions bodies are
read here, ``/v1/responses`` bodies by ``responses`` and ``/v1/messages`` (Anthropic) bodies by
``messages`` into the same ``ParsedBody``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchapi.openai.embeddings import EMBEDDINGS, parse_embeddings
from batchapi.openai.embeddings import FIELDS as EMBEDDING_FIELDS
from batchapi.openai.errors import ErrorCode, RequestError, refuse_unknown
from batchapi.openai.fields import (
    RESPONSE_FORMATS,
    boolean,
    integer,
    is_int,
    is_number,
    json_schema_format,
    number,
)
from batchapi.openai.messages import FIELDS as MESSAGE_FIELDS
from batchapi.openai.messages import parse_messages
from batchapi.openai.reasoning import VERBOSITIES, Reasoning, chat_reasoning
from batchapi.openai.responses import FIELDS as RESPONSE_FIELDS
from batchapi.openai.responses import parse_responses
from batchapi.openai.tools import NAME, call_arguments, parse_tools

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"  # Anthropic's Messages API, the endpoint of Message Batches
ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS, MESSAGES)
# served by chat models; EMBEDDINGS by embedding models
GENERATION_ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)
# the body fields that hold the prompt, the output limit and the output's schema, as errors name them
PROMPT_PARAM = {CHAT: "messages", COMPLETIONS: "prompt", RESPONSES: "input", EMBEDDINGS: "input",
                MESSAGES: "messages"}
MAX_TOKENS_PARAM = {CHAT: "max_tokens", COMPLETIONS: "max_tokens", RESPONSES: "max_output_tokens",
                    MESSAGES: "max_tokens"}
SCHEMA_PARAM = {CHAT: "response_format.json_schema.schema", RESPONSES: "text.format.schema",
                MESSAGES: "output_config.format.schema"}

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_N = 128
MAX_PROMPTS = 2048  # prompts in one completions body
MAX_COMPLETION_LOGPROBS = 20
MAX_STOP = 4
# fields OpenAI accepts that do not change generation here (``verbosity`` is checked first)
IGNORED = {"user", "store", "metadata", "service_tier", "stream_options", "prompt_cache_key", "safety_identifier",
           "verbosity"}


@dataclass
class ParsedBody:
    """A checked request body. Exactly one of ``messages`` and ``prompt`` is set.

    ``messages`` are as a chat template takes them: ``role`` (``developer`` read as ``system``)
    and ``content``, always a string, plus ``name`` when given, ``tool_calls`` (their
    ``arguments`` parsed into a dict) on assistant turns and ``tool_call_id`` on tool turns. The
    fields from ``response_format`` on are for chat and Responses bodies (``tools`` explains the
    tool fields). A ``/v1/responses`` body is read into the same fields (``responses`` explains
    how), so the engine side does not know which endpoint a request came from; only its
    rendering does, by ``endpoint``.
    """

    model: str
    endpoint: str = CHAT  # one of ENDPOINTS: the wire shape its result is rendered in
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
    echo: dict | None = None  # Responses only: the request's fields its Response object repeats
    # completions only: the prompts after the first (``prompt`` a list of prompts), each its own
    # choices; and ``echo``: the prompt comes back before each choice's text, with its logprobs
    more_prompts: list[str | list[int]] = field(default_factory=list)
    echo_prompt: bool = False
    reasoning: Reasoning | None = None  # what it asked of thinking (None: as the chat template does by default)
    # thinking blocks sent back in assistant turns: (text, signature, param), checked against the key
    signed_thinking: list[tuple[str, str, str]] = field(default_factory=list)
    # embeddings only (``openai.embeddings``): the inputs (strings, or token-id lists) and the options
    inputs: list[str] | list[list[int]] | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    prompt_name: str | None = None  # one of the model's named prompts, checked by the worker

    @property
    def continues_final_message(self) -> bool:
        """The reply continues the last message (Anthropic's prefill: an assistant turn last), so the
        prompt ends inside it. A chat body's last assistant message is a finished turn, as OpenAI reads it."""
        return self.endpoint == MESSAGES and bool(self.messages) and self.messages[-1]["role"] == "assistant"


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
                    "function": {"name": name, "arguments": call_arguments(arguments, f"{at}.function.arguments")}})
    return out


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
    parsed.json_schema, parsed.json_schema_name, parsed.json_schema_strict = json_schema_format(spec, param)


def _ignored_strings(body: dict) -> None:
    """Fields OpenAI accepts that change nothing here, checked as OpenAI checks them."""
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise RequestError(f"'{name}' must be a string", name, ErrorCode.INVALID_TYPE)
    verbosity = body.get("verbosity")
    if verbosity is not None and verbosity not in VERBOSITIES:
        raise RequestError(f"invalid value {verbosity!r}; expected one of {list(VERBOSITIES)}", "verbosity")


def _prompts(body: dict) -> list[str | list[int]]:
    """The prompts of a completions body: a string, an array of token ids, or an array of either."""
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("'prompt' is required", "prompt", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if isinstance(prompt, str):
        return [prompt]
    if _is_token_ids(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_is_token_ids(p) for p in prompt)):
        if len(prompt) > MAX_PROMPTS:
            raise RequestError(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed", "prompt")
        return [p if isinstance(p, str) else list(p) for p in prompt]
    raise RequestError("'prompt' must be a string, an array of token ids, or a non-empty array of strings or of "
                       "token-id arrays", "prompt", ErrorCode.INVALID_TYPE)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) and t >= 0 for t in value)


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
        if token < 0 or not is_number(value) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias[{key}] must be a number between -100 and 100", "logit_bias")
        out[token] = float(value)
    return out


def _stop_token_ids(body: dict) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(is_int(t) and t >= 0 for t in ids):
        raise RequestError("'stop_token_ids' must be an array of token ids", "stop_token_ids", ErrorCode.INVALID_TYPE)
    return ids


CHAT_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "stop",
    "stop_token_ids", "n", "logprobs", "top_logprobs", "ignore_eos", "stream", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "reasoning_effort", "modalities",
} | IGNORED
CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
             "parallel_tool_calls", "reasoning_effort", "verbosity", "modalities"}
COMPLETION_FIELDS = (CHAT_FIELDS - CHAT_ONLY) | {
    "prompt", "echo", "suffix", "best_of",
}


def parse_body(endpoint: str, body: Any) -> ParsedBody:
    """Check ``body`` for ``endpoint``; raise ``RequestError`` on the first problem."""
    if endpoint not in ENDPOINTS:
        raise RequestError(f"unsupported endpoint {endpoint!r}; expected one of {list(ENDPOINTS)}", "url")
    if not isinstance(body, dict):
        raise RequestError("'body' must be an object", "body", ErrorCode.INVALID_TYPE)
    refuse_unknown(body, {CHAT: CHAT_FIELDS, COMPLETIONS: COMPLETION_FIELDS, RESPONSES: RESPONSE_FIELDS,
                          EMBEDDINGS: EMBEDDING_FIELDS, MESSAGES: MESSAGE_FIELDS}[endpoint])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required and must be a string", "model", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if body.get("stream"):
        raise RequestError("'stream' is not supported in a batch", "stream")
    if endpoint == COMPLETIONS:
        if body.get("suffix"):
            raise RequestError("'suffix' is not supported", "suffix")
        best_of = integer(body, "best_of", 1, MAX_N, None)
        if best_of not in (None, 1) and best_of != body.get("n", 1):
            raise RequestError("'best_of' other than n is not supported", "best_of")

    parsed = ParsedBody(model=model, endpoint=endpoint)
    if endpoint == EMBEDDINGS:
        parse_embeddings(body, parsed)
        return parsed
    if endpoint == MESSAGES:  # reads its own sampling fields, under Anthropic's names and ranges
        parse_messages(body, parsed)
        _check_tool_turns(parsed.messages)
        return parsed
    if endpoint == RESPONSES:
        parse_responses(body, parsed)
    elif endpoint == CHAT:
        parsed.messages = _messages(body)
        if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
            raise RequestError("Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported",
                               "max_tokens")
        token_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        parsed.max_tokens = integer(body, token_field, 1, None, None)
        parsed.logprobs = boolean(body, "logprobs")
        parsed.top_logprobs = integer(body, "top_logprobs", 0, 20, 0)
        if parsed.top_logprobs and not parsed.logprobs:
            raise RequestError("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        _response_format(body, parsed)
        parsed.tools, parsed.tool_choice, parsed.tool_name, parsed.parallel_tool_calls = parse_tools(body)
        parsed.reasoning = chat_reasoning(body)
        if body.get("modalities") not in (None, ["text"]):  # OpenAI's default; audio out is not served
            raise RequestError("'modalities' must be [\"text\"]: the served models answer in text", "modalities")
        _ignored_strings(body)
    else:
        prompts = _prompts(body)
        parsed.prompt, parsed.more_prompts = prompts[0], prompts[1:]
        parsed.echo_prompt = boolean(body, "echo")
        # max_tokens 0 with echo: the prompt scored (its logprobs), nothing generated
        parsed.max_tokens = integer(body, "max_tokens", 0 if parsed.echo_prompt else 1, None, 16)
        # completions: logprobs is the number of alternatives to return (0-20: OpenAI's 5, vLLM's 20)
        count = integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, None)
        parsed.logprobs = count is not None
        parsed.top_logprobs = count or 0

    # a Responses body has only temperature and top_p of these: the rest were refused as unknown
    parsed.temperature = number(body, "temperature", 0.0, 2.0, 1.0)
    parsed.top_p = number(body, "top_p", 0.0, 1.0, 1.0)  # 0, as OpenAI allows: the most likely token
    parsed.top_k = integer(body, "top_k", -1, None, -1)
    parsed.min_p = number(body, "min_p", 0.0, 1.0, 0.0)
    parsed.seed = integer(body, "seed", -(2**63), 2**63 - 1, None)
    parsed.presence_penalty = number(body, "presence_penalty", -2.0, 2.0, 0.0)
    parsed.frequency_penalty = number(body, "frequency_penalty", -2.0, 2.0, 0.0)
    parsed.logit_bias = _logit_bias(body)
    parsed.stop = _stop(body)
    parsed.stop_token_ids = _stop_token_ids(body)
    parsed.n = integer(body, "n", 1, MAX_N, 1)
    if parsed.max_tokens == 0 and parsed.n != 1:  # one scoring of the prompt: n of them would be the same
        raise RequestError("'n' must be 1 where 'max_tokens' is 0 (the prompt scored, nothing generated)", "n")
    parsed.ignore_eos = boolean(body, "ignore_eos")
    return parsed
