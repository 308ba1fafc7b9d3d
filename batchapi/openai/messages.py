"""Anthropic Messages API bodies (``/v1/messages``, the ``params`` of a Message Batches request),
read into the ``ParsedBody`` a chat body gives, so the prompt, the grammar and the tool fallback
are chat's and the engine side is unchanged.

- ``system`` (a string or text blocks) becomes a first system message. ``messages`` are ``user``
  and ``assistant`` turns whose content is a string or blocks: ``text``; on assistant turns
  ``tool_use`` (the turn's ``tool_calls``, ``input`` as the parsed arguments); on user turns
  ``tool_result`` (a ``tool`` message answering a ``tool_use`` of the turn just before, its content
  a string or text blocks), which come first in their turn, as Anthropic requires. A last turn of
  the assistant's is a prefill: the reply continues its text (``workers.codec`` renders the prompt
  up to it, left open), and as Anthropic that text may not end in whitespace. Refused in Anthropic's
  words: empty content (but for a last assistant turn, which then prefills nothing), empty or blank
  text blocks, a ``tool_use`` whose ``tool_result`` is not in the very next turn, a ``tool_result``
  answering no ``tool_use`` of the turn before (``message_results`` leads each message with its
  field, ``messages.1.content.0: ...``).
- ``max_tokens`` is required, at least 1 (Anthropic's 0, a prompt-cache warm-up that generates
  nothing, is refused: the engine runs every request it is given). ``temperature`` (0 to 1),
  ``top_p``, ``top_k``, ``stop_sequences``.
- ``tools`` (``{"name", "description", "input_schema"}``) are function tools in chat's shape, the
  schema as ``parameters``; ``tool_choice`` ``auto``, ``any`` (chat's ``required``), ``tool`` with
  ``name`` (a named function) or ``none``; ``disable_parallel_tool_use`` is
  ``parallel_tool_calls`` false. A tool's ``strict`` is accepted and changes nothing here: the
  grammar holds every forced call to its schema whether strict or not, and a call under ``auto``
  is free text either way (``tools`` explains both).
- ``output_config.format`` ``{"type": "json_schema", "schema"}`` is chat's ``response_format``
  json_schema: the grammar holds the reply to the schema, which comes back as one text block.
  ``output_config.effort`` is accepted and has no effect.
- Accepted and ignored: ``metadata``, ``service_tier``, ``cache_control`` on blocks and tools, a
  tool's ``eager_input_streaming`` (batches do not stream). ``thinking`` (``openai.reasoning``), and
  ``thinking`` blocks sent back first in an assistant turn, with their signatures. Refused:
  ``stream: true`` and every other field (unknown), non-text blocks (images, documents), tools with a
  ``type`` (server tools) and the tool fields of server features (``defer_loading``,
  ``allowed_callers``, ``input_examples``).

``parsed`` is a ``body.ParsedBody``; ``body`` imports ``parse_messages`` from here, so this
module cannot import it. ``body`` checks that tool turns pair up, as for chat, after this module
has checked it in Anthropic's terms.
"""

from __future__ import annotations

from typing import Any

from batchapi.openai.errors import ErrorCode, RequestError, refuse_unknown
from batchapi.openai.fields import integer, number
from batchapi.openai.reasoning import messages_thinking
from batchapi.openai.schema import check_schema
from batchapi.openai.tools import parse_tools

IGNORED = {"metadata", "service_tier"}
FIELDS = {"model", "max_tokens", "messages", "system", "temperature", "top_p", "top_k", "stop_sequences",
          "tools", "tool_choice", "stream", "thinking", "output_config"} | IGNORED
MAX_STOP_SEQUENCES = 16
EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort: accepted, no effect here
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# ``strict`` is not passed on as chat's: chat's only asks more of the schema (every property required),
# and Anthropic's strict schemas may leave properties optional
TOOL_FIELDS = {"type", "name", "description", "input_schema", "cache_control", "strict", "eager_input_streaming"}


def parse_messages(body: dict, parsed) -> None:
    """Fill ``parsed`` from a Messages body whose fields ``body.parse_body`` has checked are known."""
    parsed.messages = _system(body.get("system")) + _conversation(body.get("messages"))
    if body.get("max_tokens") is None:
        raise RequestError("'max_tokens' is required", "max_tokens", ErrorCode.MISSING_REQUIRED_PARAMETER)
    parsed.max_tokens = integer(body, "max_tokens", 1, None, None)
    parsed.reasoning = messages_thinking(body.get("thinking"), parsed.max_tokens)
    parsed.signed_thinking = [signed for message in parsed.messages for signed in message.pop("signed_thinking", ())]
    if parsed.reasoning is not None and parsed.reasoning.enabled and parsed.continues_final_message:
        raise RequestError("thinking may not be enabled when the final message is an assistant prefill",
                           f"messages[{len(body['messages']) - 1}].role")
    parsed.temperature = number(body, "temperature", 0.0, 1.0, 1.0)
    parsed.top_p = number(body, "top_p", 0.0, 1.0, 1.0)
    parsed.top_k = integer(body, "top_k", 1, None, None) or -1
    parsed.stop = _stop_sequences(body.get("stop_sequences"))
    parsed.tools, parsed.tool_choice, parsed.tool_name, parsed.parallel_tool_calls = _tools(body)
    if parsed.reasoning is not None and parsed.reasoning.enabled and parsed.tool_choice == "required":
        raise RequestError("Thinking may not be enabled when tool_choice forces tool use.", "tool_choice")
    _output_config(body.get("output_config"), parsed)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise RequestError("'metadata' must be an object", "metadata", ErrorCode.INVALID_TYPE)


def _system(value: Any) -> list[dict]:
    if value is None:
        return []
    text = value if isinstance(value, str) else _text_blocks(value, "system")
    return [{"role": "system", "content": text}]


def _text_blocks(value: Any, param: str) -> str:
    if not isinstance(value, list):
        raise RequestError("must be a string or an array of text blocks", param, ErrorCode.INVALID_TYPE)
    return "".join(_text_block(block, f"{param}[{i}]") for i, block in enumerate(value))


def _text_block(block: Any, param: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else None
        raise RequestError(f"only text blocks ({{'type': 'text', 'text': ...}}) are supported here, got {kind!r}",
                           param)
    refuse_unknown(block, {"type", "text", "cache_control", "citations"}, param)
    if not block["text"]:
        raise RequestError("text content blocks must be non-empty", f"{param}.text")
    if not block["text"].strip():
        raise RequestError("text content blocks must contain non-whitespace text", f"{param}.text")
    return block["text"]


def _conversation(value: Any) -> list[dict]:
    if value is None:
        raise RequestError("'messages' is required", "messages", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(value, list) or not value:
        raise RequestError("'messages' must be a non-empty array", "messages")
    out: list[dict] = []
    awaiting: dict[str, int] = {}  # the tool_use ids of the turn just before, and its index
    for i, message in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError("each message must be an object", at, ErrorCode.INVALID_TYPE)
        refuse_unknown(message, {"role", "content"}, at)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise RequestError(f"invalid role {role!r}; expected 'user' or 'assistant'", f"{at}.role")
        content = message.get("content")
        if content is None:
            raise RequestError("Field required", f"{at}.content", ErrorCode.MISSING_REQUIRED_PARAMETER)
        if content in ("", []):
            if role == "assistant" and i == len(value) - 1:
                break  # an empty final assistant turn prefills nothing: the reply starts afresh
            raise RequestError("all messages must have non-empty content except for the optional final assistant "
                               "message", at)
        turn = _user(content, at, awaiting) if role == "user" else [_assistant(content, at)]
        _unanswered(awaiting)
        awaiting = {call["id"]: i for call in turn[-1].get("tool_calls", ())} if role == "assistant" else {}
        out.extend(turn)
    _unanswered(awaiting)
    if out and out[-1]["role"] == "assistant" and out[-1]["content"] != out[-1]["content"].rstrip():
        # as Anthropic: the reply starts right after the prefill, so a trailing space would be the model's to write
        raise RequestError("final assistant content cannot end with trailing whitespace",
                           f"messages[{len(value) - 1}].content")
    return out


def _blocks(content: Any, param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError("'content' must be a string or an array of content blocks", param, ErrorCode.INVALID_TYPE)
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise RequestError("each content block must be an object", f"{param}[{i}]", ErrorCode.INVALID_TYPE)
    return content


def _unanswered(awaiting: dict[str, int]) -> None:
    """As Anthropic: every ``tool_use`` of an assistant turn has its ``tool_result`` in the user turn just after."""
    if awaiting:
        ids = ", ".join(awaiting)
        raise RequestError(f"`tool_use` ids were found without `tool_result` blocks immediately after: {ids}. Each "
                           "`tool_use` block must have a corresponding `tool_result` block in the next message.",
                           f"messages[{next(iter(awaiting.values()))}]")


def _user(content: Any, at: str, awaiting: dict[str, int]) -> list[dict]:
    """A user turn: its ``tool_result`` blocks as ``tool`` messages, then its text as a user message.
    Each ``tool_result`` answers (and takes out of ``awaiting``) a ``tool_use`` of the turn just before."""
    out, texts = [], []
    for i, block in enumerate(_blocks(content, f"{at}.content")):
        param = f"{at}.content[{i}]"
        if block.get("type") == "tool_result":
            if texts:
                raise RequestError("`tool_result` blocks must come before any text in a user message", param)
            out.append(_tool_result(block, param))
            if awaiting.pop(out[-1]["tool_call_id"], None) is None:
                raise RequestError(f"unexpected `tool_use_id` found in `tool_result` blocks: "
                                   f"{out[-1]['tool_call_id']}. Each `tool_result` block must have a corresponding "
                                   "`tool_use` block in the previous message.", param)
        else:
            texts.append(_text_block(block, param))
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool_result(block: dict, param: str) -> dict:
    refuse_unknown(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, param)
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError("'tool_use_id' is required and must be a string", f"{param}.tool_use_id",
                           ErrorCode.MISSING_REQUIRED_PARAMETER)
    content = block.get("content", "")
    text = content if isinstance(content, str) else _text_blocks(content, f"{param}.content")
    return {"role": "tool", "content": text, "tool_call_id": call_id}


def _assistant(content: Any, at: str) -> dict:
    texts, calls, thoughts = [], [], []
    for i, block in enumerate(_blocks(content, f"{at}.content")):
        param = f"{at}.content[{i}]"
        if block.get("type") == "tool_use":
            calls.append(_tool_use(block, param, calls))
        elif block.get("type") == "thinking":
            thoughts.append(_thinking_block(block, param, texts or calls))
        else:
            texts.append(_text_block(block, param))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:  # the template decides whether an earlier turn's thinking is shown again
        message["reasoning_content"] = "\n\n".join(text for text, _, _ in thoughts)
        message["signed_thinking"] = thoughts  # verified against the deployment's key (openai.reasoning)
    return message


def _thinking_block(block: dict, param: str, after_answer: bool) -> tuple[str, str, str]:
    """A thinking block sent back: ``(text, signature, param)``, verified later where the key is."""
    refuse_unknown(block, {"type", "thinking", "signature", "cache_control"}, param)
    if after_answer:
        raise RequestError("'thinking' blocks must come before 'text' and 'tool_use' blocks in an assistant turn",
                           param)
    text, signature = block.get("thinking"), block.get("signature")
    if not isinstance(text, str):
        raise RequestError(f"{param}.thinking: Field required", f"{param}.thinking", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(signature, str) or not signature:
        raise RequestError(f"{param}.signature: Field required", f"{param}.signature",
                           ErrorCode.MISSING_REQUIRED_PARAMETER)
    return text, signature, param


def _tool_use(block: dict, param: str, calls: list[dict]) -> dict:
    refuse_unknown(block, {"type", "id", "name", "input", "cache_control"}, param)
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError("'id' is required and must be a string", f"{param}.id", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if any(call["id"] == call_id for call in calls):
        raise RequestError(f"`tool_use` ids must be unique: {call_id} is used twice", f"{param}.id")
    if not isinstance(name, str) or not name:
        raise RequestError("'name' is required and must be a string", f"{param}.name", ErrorCode.INVALID_TYPE)
    if not isinstance(arguments, dict):
        raise RequestError("'input' must be an object", f"{param}.input", ErrorCode.INVALID_TYPE)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _stop_sequences(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise RequestError("'stop_sequences' must be an array of non-empty strings", "stop_sequences",
                           ErrorCode.INVALID_TYPE)
    if len(value) > MAX_STOP_SEQUENCES:
        raise RequestError(f"'stop_sequences' may hold at most {MAX_STOP_SEQUENCES} strings", "stop_sequences")
    return list(value)


def _tools(body: dict) -> tuple[list[dict] | None, str, str | None, bool]:
    """Anthropic's tools and tool_choice, checked by chat's rules in the flat (Responses) shape."""
    tools = body.get("tools")
    flat: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError("'tools' must be an array of tools", "tools", ErrorCode.INVALID_TYPE)
        flat["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    choice = body.get("tool_choice")
    parallel = True
    if choice is not None:
        if not isinstance(choice, dict):
            raise RequestError("'tool_choice' must be an object", "tool_choice", ErrorCode.INVALID_TYPE)
        refuse_unknown(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
        kind = choice.get("type")
        if kind == "tool":
            flat["tool_choice"] = {"type": "function", "name": choice.get("name")}
        elif kind in TOOL_CHOICES:
            flat["tool_choice"] = TOOL_CHOICES[kind]
        else:
            raise RequestError(f"invalid tool_choice type {kind!r}; expected one of 'auto', 'any', 'tool', 'none'",
                               "tool_choice.type")
        disable = choice.get("disable_parallel_tool_use", False)
        if not isinstance(disable, bool):
            raise RequestError("'disable_parallel_tool_use' must be a boolean", "tool_choice.disable_parallel_tool_use",
                               ErrorCode.INVALID_TYPE)
        parallel = not disable
    try:
        tools, kind, name, _ = parse_tools(flat, flat=True)
    except RequestError as exc:  # chat's names of the fields, as Anthropic's
        exc.param = (exc.param or "").replace(".parameters", ".input_schema") or None
        exc.message = exc.message.replace(".parameters", ".input_schema")
        raise
    return tools, kind, name, parallel


def _tool(tool: Any, param: str) -> dict:
    if not isinstance(tool, dict):
        raise RequestError("each tool must be an object", param, ErrorCode.INVALID_TYPE)
    if tool.get("type") not in (None, "custom"):
        raise RequestError(f"the tool type {tool['type']!r} is not supported: only client tools "
                           "({'name', 'description', 'input_schema'}) run in a batch here", f"{param}.type")
    refuse_unknown(tool, TOOL_FIELDS, param)
    if tool.get("input_schema") is None:
        raise RequestError("'input_schema' is required", f"{param}.input_schema", ErrorCode.MISSING_REQUIRED_PARAMETER)
    for name in ("strict", "eager_input_streaming"):
        if tool.get(name) is not None and not isinstance(tool[name], bool):
            raise RequestError(f"'{name}' must be a boolean", f"{param}.{name}", ErrorCode.INVALID_TYPE)
    flat = {"type": "function", "name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        flat["description"] = tool["description"]
    return flat


def _output_config(value: Any, parsed) -> None:
    """``output_config``: ``format`` ``{"type": "json_schema", "schema": ...}`` holds the reply to the
    schema, as chat's ``response_format`` json_schema does (the reply is one text block of JSON)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise RequestError("'output_config' must be an object", "output_config", ErrorCode.INVALID_TYPE)
    refuse_unknown(value, {"format", "effort"}, "output_config")
    if value.get("effort") is not None and value["effort"] not in EFFORTS:
        raise RequestError(f"invalid effort {value['effort']!r}; expected one of {', '.join(EFFORTS)}",
                           "output_config.effort")
    fmt = value.get("format")
    if fmt is None:
        return
    param = "output_config.format"
    if not isinstance(fmt, dict):
        raise RequestError("'format' must be an object", param, ErrorCode.INVALID_TYPE)
    refuse_unknown(fmt, {"type", "schema"}, param)
    if fmt.get("type") != "json_schema":
        raise RequestError(f"invalid format type {fmt.get('type')!r}; expected 'json_schema'", f"{param}.type")
    schema = fmt.get("schema")
    if schema is None:
        raise RequestError("Field required", f"{param}.schema", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(schema, dict):
        raise RequestError("'schema' must be a JSON schema object", f"{param}.schema", ErrorCode.INVALID_TYPE)
    check_schema(schema, f"{param}.schema")
    parsed.response_format, parsed.json_schema = "json_schema", schema
