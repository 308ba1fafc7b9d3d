"""Results of Anthropic Message Batches: a finished request as a Message, and a stored result line
as a line of the batch's results.

Two steps, each in one place. The worker renders a ``/v1/messages`` request's body with
``message_body`` (through ``workers.codec``, as it renders chat and Responses bodies), inside the
usual output line, so the batch's output and error files keep the one line format of every batch.
The results route turns those stored lines into Anthropic's with ``result_line``: an output line is
``succeeded`` with its message; a 400 line (a refused body, or the engine's refusal) is ``errored``
with an ``invalid_request_error`` (a 500 line, a server error, with an ``api_error``), its message
led by the field it is about as Anthropic's are (``messages.0.content: ...``); a request never run is
``canceled`` or ``expired``, or ``errored`` (``api_error``) when the workers failed it.

Usage: ``input_tokens`` are the prompt tokens the prefix cache did not hold and
``cache_read_input_tokens`` those it did, so their sum is the prompt, as Anthropic counts;
``cache_creation_input_tokens`` is 0 (no cache writes are billed here).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable

from batchapi.openai.errors import ErrorCode
from batchapi.openai.reasoning import sign
from batchapi.openai.tools import parse_tool_calls

NOT_RUN = {ErrorCode.BATCH_CANCELLED: "canceled", ErrorCode.BATCH_EXPIRED: "expired"}


def usage(result) -> dict:
    return {"input_tokens": result.prompt_tokens - result.cached_tokens, "output_tokens": result.completion_tokens,
            "cache_read_input_tokens": result.cached_tokens, "cache_creation_input_tokens": 0}


def message_body(parsed, result, model: str, tokenizer, key: bytes = b"") -> dict:
    """The Message of a ``/v1/messages`` request the engine finished (``parsed`` a ``body.ParsedBody``);
    a thinking block first, signed with ``key`` (``openai.reasoning``), when the model thought."""
    assert result.error is None, f"request {result.request_id} failed ({result.error}); render it rejected"
    assert len(result.outputs) == 1, f"a Messages request has one output, got {len(result.outputs)}"
    out = result.outputs[0]
    calls = parse_tool_calls(out.text, parsed) if out.finish_reason == "stop" else None  # a cut call may be half
    stop_sequence = _stop_sequence(parsed, out, tokenizer) if out.finish_reason == "stop" and not calls else None
    if calls:
        content = [{"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"])} for call in calls]
        reason = "tool_use"
    else:
        content = [{"type": "text", "text": out.text}]
        reason = "max_tokens" if out.finish_reason == "length" else "stop_sequence" if stop_sequence else "end_turn"
    if getattr(out, "reasoning", None) is not None:
        content = [{"type": "thinking", "thinking": out.reasoning, "signature": sign(out.reasoning, key)}, *content]
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": stop_sequence, "usage": usage(result)}


def _stop_sequence(parsed, out, tokenizer) -> str | None:
    """The stop sequence that ended the output, if one did: the engine cuts the text just before
    it, so it follows the text in the decoded tokens (an end-of-turn token decodes to nothing)."""
    if not parsed.stop:
        return None
    answer = out.token_ids[getattr(out, "thinking_tokens", 0):]  # the answer's tokens, after any thinking
    decoded = tokenizer.decode(answer, skip_special_tokens=True)
    if getattr(out, "thinking_tokens", 0):
        decoded = decoded.lstrip("\n")  # as the answer's text was (openai.reasoning.split_output)
    tail = decoded[len(out.text):]
    return next((s for s in parsed.stop if tail.startswith(s)), None)


def error_result(message: str, kind: str = "invalid_request_error") -> dict:
    return {"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": message}}}


def result_line(record: dict) -> bytes:
    """A stored output or error line (``openai.render``'s shapes) as an Anthropic results line."""
    response, error = record.get("response"), record.get("error")
    if response is not None and response.get("status_code") == 200:
        result = {"type": "succeeded", "message": response["body"]}
    elif response is not None:
        detail = response["body"]["error"]
        server = detail.get("code") == ErrorCode.SERVER_ERROR
        result = error_result(anthropic_message(detail), "api_error" if server else "invalid_request_error")
    else:
        code = error.get("code")  # a str; an unknown code (another version's) is an api_error, never a crash
        result = {"type": NOT_RUN[code]} if code in NOT_RUN else error_result(error.get("message", ""), "api_error")
    return dump({"custom_id": record["custom_id"], "result": result})


def anthropic_message(detail: dict) -> str:
    """A stored error's message as Anthropic words one: led by the field it is about, in dotted form
    (``messages.0.content.1.text: ...``), and an unknown field as "Extra inputs are not permitted"."""
    message, param = detail.get("message", ""), detail.get("param")
    if detail.get("code") == ErrorCode.UNKNOWN_PARAMETER:
        message = "Extra inputs are not permitted"
    if not param or param == "body":
        return message
    where = re.sub(r"\[(\d+)\]", r".\1", param)
    for lead in (f"{param}: ", f"{where}: "):  # a message that already names its field (a schema's path)
        if message.startswith(lead):
            message = message[len(lead):]
            break
    return f"{where}: {message}"


def result_lines(lines: Iterable[bytes]) -> Iterable[bytes]:
    for raw in lines:
        if raw.strip():
            yield result_line(json.loads(raw))


def dump(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"
