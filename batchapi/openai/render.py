"""Rendering: a request's outcome as an OpenAI response body and as its output or error line.

Shapes of docs/API.md. The engine's results come in as plain objects (``GenerationResult``: ids,
token counts, outputs with text and logprobs); this module never imports the engine, so the
API process can use it without torch. ``workers.codec`` binds it to the engine.
"""

from __future__ import annotations

import json
import secrets
import time

from batchapi.openai.body import ParsedBody
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.reasoning import reasoning_tokens
from batchapi.openai.tools import parse_tool_calls

# why requests that never ran (or were cut short) are in the error file
NOT_RUN_MESSAGES = {
    ErrorCode.BATCH_CANCELLED: "The batch was cancelled before this request finished.",
    ErrorCode.BATCH_EXPIRED: "The batch expired before this request finished.",
    ErrorCode.SHARD_FAILED: "The workers running this request failed too many times; it was not run.",
}


def _dump(record: dict) -> bytes:
    try:
        data = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate has no UTF-8: ASCII JSON writes it back as its escape
        data = json.dumps(record, separators=(",", ":")).encode()
    return data + b"\n"


def _line(custom_id: str | None, response: dict | None, error: dict | None) -> bytes:
    return _dump({"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id, "response": response,
                  "error": error})


def _response(status_code: int, body: dict) -> dict:
    return {"status_code": status_code, "request_id": f"req_{secrets.token_hex(12)}", "body": body}


def succeeded(custom_id: str, body: dict) -> bytes:
    return _line(custom_id, _response(200, body), None)


def rejected(custom_id: str | None, error: RequestError) -> bytes:
    """A request that ran (or was read) and was refused: a 400 with an OpenAI error body; or one
    the service failed (``server_error``): a 500, as OpenAI's error file has it."""
    server = error.code == ErrorCode.SERVER_ERROR
    body = {"error": {"message": error.message, "type": "server_error" if server else "invalid_request_error",
                      "param": error.param, "code": str(error.code)}}
    return _line(custom_id, _response(500 if server else 400, body), None)


def never_ran(custom_id: str | None, code: ErrorCode) -> bytes:
    """A request that was not run (or not to the end): no response, the reason as ``error``."""
    return _line(custom_id, None, {"code": str(code), "message": NOT_RUN_MESSAGES[code]})


def usage(result) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens(result), "audio_tokens": 0,
                                      "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }


def completion_body(parsed: ParsedBody, result, model: str, tokenizer, system_fingerprint: str | None = None,
                    prompts: list[list[int]] | None = None) -> dict:
    """The ``chat.completion`` or ``text_completion`` body of a request the engine finished.
    ``prompts``: the token ids of each prompt of a completions body with ``echo``."""
    assert result.error is None, f"request {result.request_id} failed ({result.error}); render it rejected"
    chat = parsed.messages is not None
    choices = []
    parts = getattr(result, "parts", None) or [result]  # a completions body of several prompts: a part each, in order
    for i, part in enumerate(parts):
        for out in part.outputs:
            # prompt i's sample j is choice i * n + j, as OpenAI numbers them
            choice: dict = {"index": i * parsed.n + out.index, "finish_reason": out.finish_reason}
            if chat:
                choice["message"] = _message(parsed, out, choice)
                choice["logprobs"] = _chat_logprobs(out.logprobs, tokenizer) if parsed.logprobs else None
            elif prompts is not None:  # echo: the prompt, then the completion
                prompt = [parsed.prompt, *parsed.more_prompts][i]
                text = prompt if isinstance(prompt, str) else tokenizer.decode(prompts[i])
                choice["text"] = text + out.text
                choice["logprobs"] = (_completion_logprobs(_prompt_steps(prompts[i], part.prompt_logprobs)
                                                           + (out.logprobs or []), tokenizer)
                                      if parsed.logprobs else None)
            else:
                choice["text"] = out.text
                choice["logprobs"] = _completion_logprobs(out.logprobs, tokenizer) if parsed.logprobs else None
            choices.append(choice)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result),
        "system_fingerprint": system_fingerprint,
    }
    if chat:
        body["service_tier"] = "default"
    return body


def _message(parsed: ParsedBody, out, choice: dict) -> dict:
    """The assistant message of one output; its calls, when it made any, finish the choice with
    ``tool_calls``. Only an output that stopped is read for calls: one cut at the length limit
    stays text, as its calls may be half-written."""
    message = {"role": "assistant", "content": out.text, "refusal": None}
    if getattr(out, "reasoning", None) is not None:  # the thinking, apart from the answer (vLLM's and SGLang's field)
        message["reasoning_content"] = out.reasoning
    calls = parse_tool_calls(out.text, parsed) if out.finish_reason == "stop" else None
    if calls:
        message["content"] = None
        message["tool_calls"] = calls
        choice["finish_reason"] = "tool_calls"
    return message


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _chat_entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = _token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _chat_logprobs(logprobs: list | None, tokenizer) -> dict:
    content = []
    for step in logprobs or []:
        entry = _chat_entry(tokenizer, step.token_id, step.logprob)
        entry["top_logprobs"] = [_chat_entry(tokenizer, t, lp) for t, lp in step.top_logprobs]
        content.append(entry)
    return {"content": content}


class _Unscored:
    """An echoed prompt's first token: nothing before it gives it a logprob (``null`` on the wire)."""

    def __init__(self, token_id: int):
        self.token_id, self.logprob, self.top_logprobs = token_id, None, []


def _prompt_steps(prompt: list[int], entries: list | None) -> list:
    """The logprob steps of an echoed prompt (the engine's prompt logprobs, the first token unscored)."""
    if entries is None:
        return [_Unscored(t) for t in prompt]
    return [_Unscored(prompt[0]), *entries[1:]] if prompt else []


def _completion_logprobs(logprobs: list | None, tokenizer) -> dict:
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for step in logprobs or []:
        text = _token_text(tokenizer, step.token_id)
        tokens.append(text)
        token_logprobs.append(step.logprob)
        top.append({_token_text(tokenizer, t): lp for t, lp in step.top_logprobs} if step.top_logprobs else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
