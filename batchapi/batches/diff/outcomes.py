"""One result line as a diff compares it: the model's output, its token counts, its
``system_fingerprint``; or, for a request that failed, its error.

The output is the part of the body the model produced, in every wire format the service renders
(``openai.render``, ``openai.responses``, ``openai.embeddings``, ``openai.message_results``):
never the ids, timestamps and request ids that differ on every run (a tool call's ``call_...``
id, a Message's ``toolu_...``), nor a thinking block's signature (a function of its text and the
deployment's key), nor what a body repeats of its request (a Response's ``temperature``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

PREVIEW_CHARS = 600
# the fields of a body of an unknown shape that are never the model's output
VOLATILE = {"id", "created", "created_at", "completed_at", "usage", "system_fingerprint", "model"}


@dataclass(frozen=True)
class Outcome:
    custom_id: str | None
    succeeded: bool
    output: Any  # the model's output (JSON values), or a failure's ``{"status_code", "code"}``
    prompt_tokens: int = 0
    completion_tokens: int = 0
    system_fingerprint: str | None = None
    message: str | None = None  # a failure's message: shown, not compared

    @property
    def digest(self) -> bytes:
        canonical = json.dumps(self.output, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def read_outcome(content: bytes) -> Outcome:
    """The outcome of one output or error line (without its newline) the service wrote."""
    try:
        record = json.loads(content)
    except ValueError:  # not the service's line: compared as the text it is
        return Outcome(None, False, {"unreadable": content.decode("utf-8", "replace")})
    if not isinstance(record, dict):
        return Outcome(None, False, {"unreadable": record})
    custom_id = record.get("custom_id") if isinstance(record.get("custom_id"), str) else None
    response = record.get("response") if isinstance(record.get("response"), dict) else None
    if response is not None and response.get("status_code") == 200 and isinstance(response.get("body"), dict):
        body = response["body"]
        prompt, completion = token_counts(body.get("usage"))
        fingerprint = body.get("system_fingerprint")
        return Outcome(custom_id, True, model_output(body), prompt, completion,
                       fingerprint if isinstance(fingerprint, str) else None)
    return _failure(custom_id, response, record.get("error"))


def _failure(custom_id: str | None, response: dict | None, error: Any) -> Outcome:
    """A request that ran and was refused (``response`` with its status and error body), or one
    that never ran (``error``: ``batch_expired``, ``batch_cancelled``, ...)."""
    status = response.get("status_code") if response is not None else None
    if response is not None:
        body = response.get("body")
        error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    message = error.get("message")
    return Outcome(custom_id, False, {"status_code": status, "code": error.get("code")},
                   message=message if isinstance(message, str) else None)


def token_counts(usage: Any) -> tuple[int, int]:
    """(prompt, completion) tokens of any format's ``usage``: chat's and embeddings'
    ``prompt_tokens``, Responses' ``input_tokens``, a Message's ``input_tokens`` plus the ones read
    from the prefix cache (which Anthropic counts apart)."""
    if not isinstance(usage, dict):
        return 0, 0
    if "prompt_tokens" in usage:
        return _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
    prompt = _int(usage.get("input_tokens")) + _int(usage.get("cache_read_input_tokens"))
    return prompt, _int(usage.get("output_tokens"))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def model_output(body: dict) -> Any:
    """The model's part of a succeeded body, by its shape."""
    kind = body.get("object")
    if kind == "chat.completion":
        return [_chat_choice(c) for c in _list(body.get("choices"))]
    if kind == "text_completion":
        return [_pick(c, "index", "text", "finish_reason", "logprobs") for c in _list(body.get("choices"))]
    if kind == "response":
        return {"status": body.get("status"), "incomplete_details": body.get("incomplete_details"),
                "output": [_without(item, "id", "call_id") for item in _list(body.get("output"))]}
    if kind == "list":  # embeddings
        return [_pick(item, "index", "embedding") for item in _list(body.get("data"))]
    if body.get("type") == "message":
        return {"content": [_without(block, "id", "signature") for block in _list(body.get("content"))],
                "stop_reason": body.get("stop_reason"), "stop_sequence": body.get("stop_sequence")}
    return _without(body, *VOLATILE)


def _chat_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    out = _pick(choice, "index", "finish_reason", "logprobs")
    message = choice.get("message")
    if isinstance(message, dict):
        out["message"] = _without(message, "tool_calls")
        calls = message.get("tool_calls")
        if calls:
            out["message"]["tool_calls"] = [_without(call, "id") for call in _list(calls)]
    return out


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _pick(value: Any, *names: str) -> Any:
    return {name: value.get(name) for name in names} if isinstance(value, dict) else value


def _without(value: Any, *names: str) -> Any:
    return {k: v for k, v in value.items() if k not in names} if isinstance(value, dict) else value


def preview(outcome: Outcome) -> str:
    """A short text of the outcome for people: the answer, the calls, the vectors' sizes, or the error."""
    if not outcome.succeeded:
        failure = outcome.output if isinstance(outcome.output, dict) else {}
        text = f"{failure.get('code') or 'error'}: {outcome.message or ''}".rstrip(": ")
    else:
        text = " | ".join(_texts(outcome.output))
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def _texts(output: Any) -> list[str]:
    """The readable parts of a ``model_output``, in order."""
    if isinstance(output, dict) and "content" in output and "stop_reason" in output:  # a Message
        return [_block_text(b) for b in output["content"]]
    if isinstance(output, dict) and "output" in output:  # a Response
        return [_item_text(i) for i in output["output"]]
    if isinstance(output, list):
        return [_choice_text(c) for c in output]
    return [json.dumps(output, ensure_ascii=False, sort_keys=True)]


def _choice_text(choice: Any) -> str:
    if not isinstance(choice, dict):
        return json.dumps(choice, ensure_ascii=False)
    if "embedding" in choice:
        vector = choice["embedding"]
        size = f"{len(vector)} values" if isinstance(vector, list) else f"{len(str(vector))} base64 characters"
        head = ", ".join(f"{v:.4g}" for v in vector[:3]) + ", …" if isinstance(vector, list) else str(vector)[:16]
        return f"vector {choice.get('index')}: {size} [{head}]"
    if "text" in choice:
        return str(choice["text"])
    message = choice.get("message") or {}
    calls = message.get("tool_calls")
    if calls:
        return "; ".join(f"{(c.get('function') or {}).get('name')}({(c.get('function') or {}).get('arguments')})"
                         for c in calls if isinstance(c, dict))
    return str(message.get("content") or message.get("refusal") or "")


def _item_text(item: Any) -> str:
    if not isinstance(item, dict):
        return json.dumps(item, ensure_ascii=False)
    if item.get("type") == "function_call":
        return f"{item.get('name')}({item.get('arguments')})"
    parts = [p.get("text", "") for p in _list(item.get("content")) if isinstance(p, dict)]
    return ("thinking: " if item.get("type") == "reasoning" else "") + "".join(parts)


def _block_text(block: Any) -> str:
    if not isinstance(block, dict):
        return json.dumps(block, ensure_ascii=False)
    if block.get("type") == "tool_use":
        return f"{block.get('name')}({json.dumps(block.get('input'), ensure_ascii=False, sort_keys=True)})"
    if block.get("type") == "thinking":
        return f"thinking: {block.get('thinking')}"
    return str(block.get("text", ""))
