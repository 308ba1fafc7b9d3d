"""Batches on OpenAI's Responses API (``/v1/responses``): a body read into the ``ParsedBody`` a
chat body gives, and a finished request rendered as a Response object.

The request. ``parse_responses`` fills the ``ParsedBody`` that ``body.parse_body`` made (which
then reads ``temperature`` and ``top_p`` as for chat), so the prompt, the grammar and the tool
fallback are chat's and the engine side is unchanged:

- ``instructions`` becomes a first system message. ``input`` is a string (one user message) or
  a list of items: messages (role ``user``, ``assistant``, ``system`` or ``developer``, read as
  system; content a string or ``input_text`` / ``output_text`` parts), ``function_call`` items
  (the ``tool_calls`` of an assistant turn, joined to the assistant message just before them)
  and ``function_call_output`` items (``tool`` turns). As in chat, the outputs answer the calls
  just before them, each call once.
- ``max_output_tokens`` is ``max_tokens``. ``text.format`` is ``response_format``, with
  ``name``, ``schema`` and ``strict`` in the format itself. Function ``tools`` are written flat,
  a named ``tool_choice`` is ``{"type": "function", "name"}`` (``tools.parse_tools(flat=True)``).
- Accepted and ignored (``IGNORED``): ``metadata``, ``store``, ``user``, ``service_tier``,
  ``prompt_cache_key``, ``safety_identifier``, ``stream_options``, and ``max_tool_calls``, which
  counts calls of built-in tools, of which there are none here.
- Refused by name (``REFUSED``): what needs state a batch does not keep (``previous_response_id``,
  ``conversation``, ``prompt``), ``background``, ``reasoning``, ``include`` and ``top_logprobs``
  (no logprobs on this endpoint yet), ``truncation`` other than ``disabled``, ``text.verbosity``
  other than ``medium``, built-in tools, and input items other than the three above. Fields the
  Responses API does not have (``seed``, ``n``, ``stop``, ...) are unknown, as there.

The result. ``response_body`` is a Response object: one ``message`` item holding one
``output_text``, or the ``function_call`` items of the calls ``tools.parse_tool_calls`` finds.
An output cut by its length limit makes the response ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) and stays text, as in chat. ``usage`` counts the tokens a chat result
counts, under the Responses names; the fields that repeat the request come from ``ParsedBody.echo``.

``parsed`` is a ``body.ParsedBody``; this module cannot import it, since ``body`` imports
``parse_responses`` from here.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from batchapi.openai.errors import ErrorCode, RequestError, refuse_unknown
from batchapi.openai.fields import RESPONSE_FORMATS, boolean, integer, json_schema_format
from batchapi.openai.reasoning import VERBOSITIES, reasoning_tokens, responses_reasoning
from batchapi.openai.tools import NAME, call_arguments, parse_tool_calls, parse_tools

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output")
IGNORED = {"metadata", "store", "user", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
           "max_tool_calls"}
# fields a batch here cannot honour, with why; each is refused unless unset or at its harmless value
REFUSED = {
    "previous_response_id": "a batch request cannot continue a stored response; send the conversation in 'input'",
    "conversation": "a batch request cannot continue a stored conversation; send it in 'input'",
    "prompt": "stored prompt templates are not available; send the text in 'instructions' and 'input'",
    "background": "a batch request already runs in the background",
    "include": "nothing can be added to the output here (no logprobs, reasoning or tool results)",
    "top_logprobs": "logprobs are not returned on /v1/responses; use /v1/chat/completions with 'logprobs'",
    "truncation": "only 'disabled' (the default): a prompt over the model's context fails its request",
}
HARMLESS = {"background": False, "include": [], "top_logprobs": 0, "truncation": "disabled"}
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
          "tool_choice", "parallel_tool_calls", "stream", "reasoning"} | IGNORED | set(REFUSED)


# -- the request

def parse_responses(body: dict, parsed) -> None:
    """Fill ``parsed`` from a Responses body whose fields ``body.parse_body`` has checked are known."""
    for name in REFUSED:
        if not _harmless(name, body.get(name)):
            raise RequestError(f"'{name}' is not supported in a batch: {REFUSED[name]}", name)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string", "instructions", ErrorCode.INVALID_TYPE)
    system = [] if instructions is None else [{"role": "system", "content": instructions}]
    parsed.messages = system + _input(body.get("input"))
    parsed.max_tokens = integer(body, "max_output_tokens", 1, None, None)
    text = _text(body.get("text"), parsed)
    parsed.tools, parsed.tool_choice, parsed.tool_name, parsed.parallel_tool_calls = parse_tools(body, flat=True)
    parsed.reasoning = responses_reasoning(body.get("reasoning"))
    effort = parsed.reasoning.effort if parsed.reasoning is not None else None
    summary = parsed.reasoning.summary if parsed.reasoning is not None else None
    parsed.echo = {"reasoning": {"effort": effort, "summary": summary}, "instructions": instructions, "max_output_tokens": parsed.max_tokens, "text": text,
                   "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
                   "top_logprobs": 0, **_ignored(body)}


def _harmless(name: str, value: Any) -> bool:
    """Unset, or the value that asks for nothing (``False``, ``[]``, ``0``, ``"disabled"``; not ``0`` for ``False``)."""
    harmless = HARMLESS.get(name)
    return value is None or (type(value) is type(harmless) and value == harmless)


def _ignored(body: dict) -> dict:
    """The ignored fields a Response repeats, checked to be of the types the SDK's Response reads."""
    out: dict[str, Any] = {"store": False}  # whatever was asked: nothing is kept to retrieve later
    boolean(body, "store")
    for name in ("user", "prompt_cache_key", "safety_identifier", "service_tier"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise RequestError(f"'{name}' must be a string", name, ErrorCode.INVALID_TYPE)
        if name != "service_tier":  # the Response names the tier that ran it
            out[name] = value
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise RequestError("'metadata' must be an object of string values", "metadata", ErrorCode.INVALID_TYPE)
    out["metadata"] = metadata or {}
    out["max_tool_calls"] = integer(body, "max_tool_calls", 1, None, None)
    return out


def _input(value: Any) -> list[dict]:
    """The conversation of ``input`` as chat messages."""
    if value is None:
        raise RequestError("'input' is required", "input", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise RequestError("'input' must be a string or an array of input items", "input", ErrorCode.INVALID_TYPE)
    if not value:
        raise RequestError("'input' must be a non-empty array (or a string)", "input")
    messages: list[dict] = []
    waiting: set[str] = set()  # the call ids of the calls just before, not answered yet
    previous = None
    for i, item in enumerate(value):
        at = f"input[{i}]"
        kind = _item_type(item, at)
        if kind == "function_call_output":
            messages.append(_answer(item, at, waiting))
        elif kind == "function_call":
            _add_call(messages, _function_call(item, at), at, waiting, joins=previous == "function_call")
        else:
            _check_answered(waiting, at)
            messages.append(_message(item, at))
        previous = kind
    _check_answered(waiting, "input")
    return messages


def _check_answered(waiting: set[str], param: str) -> None:
    if waiting:
        raise RequestError(f"the function call {sorted(waiting)[0]!r} has no function_call_output answering it", param)


def _add_call(messages: list[dict], call: dict, at: str, waiting: set[str], joins: bool) -> None:
    """Put ``call`` on its assistant turn: that of the calls just before it (``joins``), else the
    assistant message just before it, else a new one."""
    if joins:
        if call["id"] in waiting:
            raise RequestError(f"the call_id {call['id']!r} is used twice", f"{at}.call_id")
        messages[-1]["tool_calls"].append(call)
    else:
        _check_answered(waiting, at)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
            last["tool_calls"] = [call]
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    waiting.add(call["id"])


def _answer(item: dict, at: str, waiting: set[str]) -> dict:
    """A ``function_call_output`` item as a ``tool`` message; it answers one of the calls just before it."""
    refuse_unknown(item, {"type", "call_id", "output", "id", "status"}, at)
    call_id = _call_id(item, at)
    if call_id not in waiting:
        raise RequestError("a function_call_output must answer a function_call of the items just before it; "
                           f"{call_id!r} is not one awaiting an answer", f"{at}.call_id")
    waiting.discard(call_id)
    if item.get("output") is None:
        raise RequestError("'output' is required", f"{at}.output", ErrorCode.MISSING_REQUIRED_PARAMETER)
    return {"role": "tool", "content": _content(item["output"], f"{at}.output"), "tool_call_id": call_id}


def _item_type(item: Any, at: str) -> str:
    if not isinstance(item, dict):
        raise RequestError("each input item must be an object", at, ErrorCode.INVALID_TYPE)
    kind = item.get("type", "message")  # a message may leave its type out
    if kind not in ITEM_TYPES:
        raise RequestError(f"input items of type {kind!r} are not supported; expected one of {list(ITEM_TYPES)} "
                           "(a batch keeps no stored items, reasoning or built-in tool calls)", f"{at}.type")
    return kind


def _message(item: dict, at: str) -> dict:
    refuse_unknown(item, {"type", "role", "content", "id", "status"}, at)
    role = item.get("role")
    if role not in ROLES:
        raise RequestError(f"invalid role {role!r}; expected one of {list(ROLES)}", f"{at}.role")
    content = item.get("content")
    if content is None:
        raise RequestError("'content' is required", f"{at}.content", ErrorCode.MISSING_REQUIRED_PARAMETER)
    return {"role": "system" if role == "developer" else role, "content": _content(content, f"{at}.content")}


def _content(content: Any, param: str) -> str:
    """A message's content or a call's output: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError("content must be a string or an array of text parts", param, ErrorCode.INVALID_TYPE)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"only text content parts ({{'type': 'input_text' or 'output_text', 'text': ...}}) "
                               f"are supported, got {kind!r}", f"{param}[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def _call_id(item: dict, at: str) -> str:
    call_id = item.get("call_id")
    if call_id is None:
        raise RequestError("'call_id' is required", f"{at}.call_id", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(call_id, str) or not call_id:
        raise RequestError("'call_id' must be a non-empty string", f"{at}.call_id", ErrorCode.INVALID_TYPE)
    return call_id


def _function_call(item: dict, at: str) -> dict:
    """A ``function_call`` item as a chat ``tool_calls`` entry, its arguments parsed."""
    refuse_unknown(item, {"type", "call_id", "name", "arguments", "id", "status"}, at)
    call_id = _call_id(item, at)
    name = item.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RequestError(f"invalid function name {name!r}", f"{at}.name")
    arguments = call_arguments(item.get("arguments"), f"{at}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _text(value: Any, parsed) -> dict:
    """Read ``text.format`` into ``parsed``; the ``text`` a Response repeats."""
    if value is None:
        return {"format": {"type": "text"}, "verbosity": "medium"}
    if not isinstance(value, dict):
        raise RequestError("'text' must be an object", "text", ErrorCode.INVALID_TYPE)
    refuse_unknown(value, {"format", "verbosity"}, "text")
    verbosity = value.get("verbosity") or "medium"
    if verbosity not in VERBOSITIES:  # accepted, and changes nothing here
        raise RequestError(f"invalid value {verbosity!r}; expected one of {list(VERBOSITIES)}", "text.verbosity")
    fmt = value.get("format")
    if fmt is None:
        return {"format": {"type": "text"}, "verbosity": verbosity}
    if not isinstance(fmt, dict):
        raise RequestError("'text.format' must be an object", "text.format", ErrorCode.INVALID_TYPE)
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise RequestError(f"invalid value {kind!r}; expected one of {list(RESPONSE_FORMATS)}", "text.format.type")
    fields = {"type", "name", "schema", "strict", "description"} if kind == "json_schema" else {"type"}
    refuse_unknown(fmt, fields, "text.format")
    parsed.response_format = kind
    if kind == "json_schema":
        parsed.json_schema, parsed.json_schema_name, parsed.json_schema_strict = json_schema_format(fmt, "text.format")
    return {"format": fmt, "verbosity": verbosity}


# -- the result

def usage(result) -> dict:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens(result)},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def response_body(parsed, result, model: str) -> dict:
    """The Response object of a request the engine finished."""
    assert result.error is None, f"request {result.request_id} failed ({result.error}); render it rejected"
    assert len(result.outputs) == 1, f"a Responses request has one output, got {len(result.outputs)}"
    out = result.outputs[0]
    cut = out.finish_reason == "length"
    calls = None if cut else parse_tool_calls(out.text, parsed)  # a cut call may be half-written
    now = int(time.time())
    return {
        "id": f"resp_{secrets.token_hex(24)}",
        "object": "response",
        "created_at": now,
        "completed_at": None if cut else now,
        "status": "incomplete" if cut else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": model,
        "output": _reasoning_items(out, cut) + (
            [_function_call_item(call) for call in calls] if calls else [_message_item(out.text, cut)]),
        "parallel_tool_calls": parsed.parallel_tool_calls,
        "temperature": parsed.temperature,
        "top_p": parsed.top_p,
        "background": False,
        "previous_response_id": None,
        "service_tier": "default",
        "truncation": "disabled",
        **parsed.echo,
        "usage": usage(result),
    }


def _reasoning_items(out, cut: bool) -> list[dict]:
    """The ``reasoning`` item of an output that thought: its text as ``reasoning_text`` content (no
    summary is written; ``summary`` stays empty)."""
    if getattr(out, "reasoning", None) is None:
        return []
    return [{"type": "reasoning", "id": f"rs_{secrets.token_hex(24)}", "summary": [],
             "content": [{"type": "reasoning_text", "text": out.reasoning}],
             "status": "incomplete" if cut and not out.text else "completed"}]


def _message_item(text: str, cut: bool) -> dict:
    return {"type": "message", "id": f"msg_{secrets.token_hex(24)}", "status": "incomplete" if cut else "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _function_call_item(call: dict) -> dict:
    function = call["function"]
    return {"type": "function_call", "id": f"fc_{secrets.token_hex(24)}", "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"], "status": "completed"}
