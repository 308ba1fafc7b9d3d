"""Tools in a chat request: their definitions, how the prompt shows them, what the output must be,
and the calls found in it.

``parse_tools`` checks the body's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, in
chat's shapes or (``flat``) the Responses API's, and keeps them in chat's. A named
``tool_choice`` is kept as ``tool_choice="required"`` with ``tool_name`` set.

The prompt. A chat template that knows tools (``knows_tools``) takes ``chat_messages`` with
``tools=parsed.tools``. One that does not (the default model's, SmolLM2, prints each message's
``content`` and nothing else) takes ``fallback_messages``, in the Hermes format that many
open models are trained on, using only the roles system, user and assistant:

- the definitions go into the system message (after any text of the first one, or as a new
  first one) as ``<tools>`` JSON lines ``</tools>``, with how to call: ``<tool_call>{"name", "arguments"}
  </tool_call>`` blocks, or, when a call is forced, the bare JSON the grammar holds the output to;
- an assistant message's ``tool_calls`` become such ``<tool_call>`` blocks after its text;
- tool messages become a user message of ``<tool_response>`` blocks, consecutive ones joined
  into one message, so that user and assistant turns still alternate.

The output. A forced call (``tool_choice`` ``required`` or a named function) is the whole output,
held to ``call_schema`` by the grammar: one call object ``{"name", "arguments"}``, or for
``required`` with ``parallel_tool_calls`` a JSON array of one or more of them. Under ``auto``
the model may answer in text or with ``<tool_call>`` blocks (or bare call JSON), and
``parse_tool_calls`` keeps the calls that name a tool and carry an object of arguments. Under
``none`` the tools are shown, with a note not to call them, and the output is never read as calls.

The functions from the prompt on take ``parsed``, a chat ``body.ParsedBody``; this module cannot
import it, since ``body`` imports ``parse_tools`` from here.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from batchapi.grammar.spec import GrammarSpec
from batchapi.openai.errors import ErrorCode, RequestError, refuse_unknown
from batchapi.openai.schema import check_schema

MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


# -- the request

def parse_tools(body: dict, *, flat: bool = False) -> tuple[list[dict] | None, str, str | None, bool]:
    """``(tools, tool_choice, tool_name, parallel_tool_calls)`` of a chat body, or with ``flat`` of a
    Responses body: there a function tool is ``{"type": "function", "name", "description",
    "parameters", "strict"}`` and a named choice ``{"type": "function", "name"}``, ``tools`` may be
    empty, and ``tool_choice`` ``auto`` or ``none`` and ``parallel_tool_calls`` need no tools."""
    tools = _tools(body.get("tools"), flat)
    for name in ("tool_choice", "parallel_tool_calls"):
        value = body.get(name)
        needless = flat and (name == "parallel_tool_calls" or value in ("auto", "none"))
        if tools is None and value is not None and not needless:
            raise RequestError(f"'{name}' is only allowed when 'tools' are specified", name)
    choice, tool_name = _tool_choice(body.get("tool_choice"), tools, flat)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", ErrorCode.INVALID_TYPE)
    return tools, choice, tool_name, parallel is not False


def _tools(value: Any, flat: bool) -> list[dict] | None:
    if value is None or (flat and value == []):
        return None
    if not isinstance(value, list):
        raise RequestError("'tools' must be an array of tools", "tools", ErrorCode.INVALID_TYPE)
    if not 1 <= len(value) <= MAX_TOOLS:
        raise RequestError(f"'tools' must hold between 1 and {MAX_TOOLS} tools, got {len(value)}", "tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        parsed = _flat_tool(tool, f"tools[{i}]") if flat else _tool(tool, f"tools[{i}]")
        name = parsed["function"]["name"]
        if name in names:
            at = f"tools[{i}].name" if flat else f"tools[{i}].function.name"
            raise RequestError(f"the function name {name!r} is used by more than one tool", at)
        names.add(name)
        tools.append(parsed)
    return tools


def _tool(tool: Any, param: str) -> dict:
    """A tool as a chat template takes it: ``{"type": "function", "function": {name, description?,
    parameters}}``, its parameters an object schema. ``strict`` only tightens the check of the
    schema: the grammar holds a forced call to it either way."""
    if not isinstance(tool, dict):
        raise RequestError("each tool must be an object", param, ErrorCode.INVALID_TYPE)
    refuse_unknown(tool, {"type", "function"}, param)
    if tool.get("type") != "function":
        raise RequestError(f"invalid tool type {tool.get('type')!r}; expected 'function'", f"{param}.type")
    function = tool.get("function")
    param = f"{param}.function"
    if function is None:
        raise RequestError("'function' is required", param, ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(function, dict):
        raise RequestError("'function' must be an object", param, ErrorCode.INVALID_TYPE)
    refuse_unknown(function, FUNCTION_FIELDS, param)
    return _function(function, param)


def _flat_tool(tool: Any, param: str) -> dict:
    """A Responses API tool, its function's fields beside ``type``, as ``_tool`` gives it. The type
    is checked first: a built-in tool is named as such, not by its first unknown field."""
    if not isinstance(tool, dict):
        raise RequestError("each tool must be an object", param, ErrorCode.INVALID_TYPE)
    kind = tool.get("type")
    if kind != "function":
        raise RequestError(f"the tool type {kind!r} is not supported: only 'function' tools run in a batch here "
                           "(no built-in tools such as web_search, file_search or code_interpreter)", f"{param}.type")
    refuse_unknown(tool, FUNCTION_FIELDS | {"type"}, param)
    return _function(tool, param)


def _function(function: dict, param: str) -> dict:
    name = function.get("name")
    if name is None:
        raise RequestError("'name' is required", f"{param}.name", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RequestError(f"invalid function name {name!r}: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'", f"{param}.name")
    out: dict[str, Any] = {"name": name}
    if function.get("description") is not None:
        if not isinstance(function["description"], str):
            raise RequestError("'description' must be a string", f"{param}.description", ErrorCode.INVALID_TYPE)
        out["description"] = function["description"]
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError("'strict' must be a boolean", f"{param}.strict", ErrorCode.INVALID_TYPE)
    out["parameters"] = _parameters(function.get("parameters"), f"{param}.parameters", strict is True)
    return {"type": "function", "function": out}


def _parameters(schema: Any, param: str, strict: bool) -> dict:
    if schema is None:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise RequestError("'parameters' must be a JSON schema object", param, ErrorCode.INVALID_TYPE)
    check_schema(schema, param, strict=strict)
    if schema.get("type", "object") != "object":
        raise RequestError(f"{param}: the parameters of a function must be a schema of type 'object'", param,
                           ErrorCode.INVALID_JSON_SCHEMA)
    return {"type": "object", **schema}  # arguments are always an object


def _tool_choice(value: Any, tools: list[dict] | None, flat: bool) -> tuple[str, str | None]:
    if value is None or tools is None:  # without tools, only a needless choice got this far
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise RequestError(f"invalid tool_choice {value!r}; expected one of {list(TOOL_CHOICES)} or a function",
                               "tool_choice")
        return value, None
    if not isinstance(value, dict):
        raise RequestError("'tool_choice' must be a string or an object", "tool_choice", ErrorCode.INVALID_TYPE)
    if flat:  # {"type": "function", "name"}; the type first, as for tools
        if value.get("type") != "function":
            raise RequestError(f"invalid tool_choice type {value.get('type')!r}; expected 'function' (only function "
                               "tools run in a batch here)", "tool_choice.type")
        refuse_unknown(value, {"type", "name"}, "tool_choice")
        function, param = value, "tool_choice.name"
    else:
        refuse_unknown(value, {"type", "function"}, "tool_choice")
        if value.get("type") != "function":
            raise RequestError(f"invalid tool_choice type {value.get('type')!r}; expected 'function'",
                               "tool_choice.type")
        function, param = value.get("function"), "tool_choice.function.name"
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError(f"'{param}' is required", param, ErrorCode.MISSING_REQUIRED_PARAMETER)
    if not flat:
        refuse_unknown(function, {"name"}, "tool_choice.function")
    if name not in {t["function"]["name"] for t in tools}:
        raise RequestError(f"tool_choice names the function {name!r}, which is not among the tools", param)
    return "required", name


def call_arguments(arguments: Any, param: str) -> dict:
    """The arguments of a call in the input (a string holding a JSON object), parsed."""
    if not isinstance(arguments, str):
        raise RequestError("'arguments' must be a string holding a JSON object", param, ErrorCode.INVALID_TYPE)
    value = _loads(arguments)
    if not isinstance(value, dict):
        raise RequestError(f"'arguments' must be a string holding a JSON object, got {arguments[:100]!r}", param)
    return value


# -- the prompt

def knows_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads ``tools`` (else give it ``fallback_messages``)."""
    return chat_template is not None and re.search(r"\btools\b", chat_template) is not None


def template_input(parsed, chat_template: str | None) -> tuple[list[dict], list[dict] | None]:
    """``(messages, tools)`` for ``apply_chat_template``: the template's own tool support where it
    reads ``tools``, else ``fallback_messages`` and no tools. The worker (``workers.codec``) and
    validation's token counts both take the prompt from here, so their counts agree."""
    uses_tools = parsed.tools is not None or any("tool_calls" in m or m["role"] == "tool" for m in parsed.messages)
    if not uses_tools:
        return parsed.messages, None
    if knows_tools(chat_template):
        return chat_messages(parsed), parsed.tools
    return fallback_messages(parsed), None


def chat_messages(parsed) -> list[dict]:
    """The messages for a template that knows tools (pass ``tools=parsed.tools`` beside them)."""
    return [dict(message) for message in parsed.messages]


def fallback_messages(parsed) -> list[dict]:
    """The messages for a template that knows only system, user and assistant turns and reads
    only ``content``, always a string (see the module's docstring)."""
    out: list[dict] = []
    after_tool = False
    for message in parsed.messages:
        if message["role"] == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_tool = True
            continue
        after_tool = False
        text = message["content"]
        if message.get("tool_calls"):
            blocks = [f"<tool_call>\n{_dumps(call['function'])}\n</tool_call>" for call in message["tool_calls"]]
            text = "\n".join([text, *blocks] if text else blocks)
        out.append({"role": message["role"], "content": text})
    if parsed.tools:
        _add_tools(out, parsed)
    return out


def _add_tools(messages: list[dict], parsed) -> None:
    listing = "\n".join(_dumps(tool) for tool in parsed.tools)
    prompt = ("You are provided with function signatures within <tools></tools> XML tags:\n"
              f"<tools>\n{listing}\n</tools>\n\n{_how_to_call(parsed)}")
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        messages[0]["content"] = f"{first}\n\n{prompt}" if first else prompt
    else:
        messages.insert(0, {"role": "system", "content": prompt})


def _how_to_call(parsed) -> str:
    call = '{"name": <function-name>, "arguments": <args-json-object>}'
    if parsed.tool_choice == "none":
        return "Do not call any of these functions now; answer directly."
    if parsed.tool_name is not None:
        return f'You must call the function "{parsed.tool_name}". Reply with only the JSON object {call}.'
    if parsed.tool_choice == "required" and parsed.parallel_tool_calls:
        return f"You must call one or more of these functions. Reply with only a JSON array of calls, each {call}."
    if parsed.tool_choice == "required":
        return f"You must call one of these functions. Reply with only the JSON object {call}."
    how = ("You may call one or more functions to assist with the user query. For each function call, return a "
           f"json object within <tool_call></tool_call> XML tags:\n<tool_call>\n{call}\n</tool_call>")
    return how if parsed.parallel_tool_calls else how + "\nCall at most one function per reply."


# -- the output

def call_schema(parsed) -> dict | None:
    """The JSON schema the whole output follows when a call is forced, else None."""
    if not parsed.tools or parsed.tool_choice != "required":
        return None
    if parsed.tool_name is not None:
        tool = next(t for t in parsed.tools if t["function"]["name"] == parsed.tool_name)
        return _call_object(tool, "#")
    parallel = parsed.parallel_tool_calls
    base = "#/items" if parallel else "#"
    if len(parsed.tools) == 1:
        one = _call_object(parsed.tools[0], base)
    else:
        one = {"anyOf": [_call_object(tool, f"{base}/anyOf/{i}") for i, tool in enumerate(parsed.tools)]}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def _call_object(tool: dict, pointer: str) -> dict:
    """``{"name": <const>, "arguments": <parameters>}``, found at ``pointer`` in the whole schema."""
    function = tool["function"]
    arguments = _rebase(function["parameters"], f"{pointer}/properties/arguments")
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _rebase(schema: dict, pointer: str) -> dict:
    """``schema`` moved to ``pointer`` in another document: its local ``$ref``s point there."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref":
            value = pointer + value[1:]
        elif key in ("properties", "$defs", "definitions"):
            value = {name: _rebase(sub, pointer) for name, sub in value.items()}
        elif key == "anyOf":
            value = [_rebase(sub, pointer) for sub in value]
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = _rebase(value, pointer)
        out[key] = value
    return out


def output_constraint(parsed) -> tuple[str, dict | None] | None:
    """What the grammar holds the output to: ``("json_schema", schema)``, ``("json_object", None)``,
    or None for free text. A forced call wins over ``response_format``."""
    schema = call_schema(parsed)
    if schema is not None:
        return "json_schema", schema
    if parsed.response_format == "json_object":
        return "json_object", None
    if parsed.response_format == "json_schema":
        return "json_schema", parsed.json_schema
    return None


def grammar_spec(parsed) -> GrammarSpec | None:
    """The grammar a request's output follows (``output_constraint``'s, as the grammar engine takes
    it): the one place a body's constraint becomes a ``GrammarSpec``, for validation's check and
    the worker's request alike."""
    constraint = output_constraint(parsed)
    if constraint is None:
        return None
    kind, schema = constraint
    return GrammarSpec.json_object() if kind == "json_object" else GrammarSpec.json_schema(schema)


def parse_tool_calls(text: str, parsed) -> list[dict] | None:
    """The OpenAI ``tool_calls`` of an output, or None when it holds none (it is then content)."""
    if not parsed.tools or parsed.tool_choice == "none":
        return None
    if parsed.tool_choice == "required":
        found = _bare_calls(text)
    else:
        found = [_loads(block) for block in _TAGGED.findall(text)] or _bare_calls(text)
    names = {parsed.tool_name} if parsed.tool_name else {t["function"]["name"] for t in parsed.tools}
    calls = [call for call in map(_call, found) if call is not None and call[0] in names]
    if not calls:
        return None
    if not parsed.parallel_tool_calls:
        calls = calls[:1]
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))}}
            for name, arguments in calls]


def _bare_calls(text: str) -> list:
    value = _loads(text)
    return value if isinstance(value, list) else [value]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call(value: Any) -> tuple[str, dict] | None:
    """``(name, arguments)`` of ``{"name", "arguments"}`` (or ``"parameters"``), the arguments an
    object or a string of one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
