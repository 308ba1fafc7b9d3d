"""OpenAI request bodies to engine requests, and engine results to OpenAI response bodies."""

from __future__ import annotations

import time

from batchapi.engine import GenerationRequest, GenerationResult, SamplingParams, TokenLogprob
from batchapi.jobs.request_body import ParsedBody


def prompt_token_ids(parsed: ParsedBody, tokenizer) -> list[int]:
    if parsed.messages is not None:
        text = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)  # the template already holds them
    if isinstance(parsed.prompt, list):
        return list(parsed.prompt)
    return tokenizer.encode(parsed.prompt)


def sampling_params(parsed: ParsedBody) -> SamplingParams:
    return SamplingParams(
        max_tokens=parsed.max_tokens, temperature=parsed.temperature, top_p=parsed.top_p, top_k=parsed.top_k,
        min_p=parsed.min_p, seed=parsed.seed, presence_penalty=parsed.presence_penalty,
        frequency_penalty=parsed.frequency_penalty, logit_bias=dict(parsed.logit_bias), stop=list(parsed.stop),
        stop_token_ids=list(parsed.stop_token_ids), ignore_eos=parsed.ignore_eos, logprobs=parsed.logprobs,
        top_logprobs=parsed.top_logprobs, n=parsed.n,
    )


def to_request(parsed: ParsedBody, tokenizer, request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, prompt_token_ids(parsed, tokenizer), sampling_params(parsed))


def usage(result: GenerationResult) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def to_body(parsed: ParsedBody, result: GenerationResult, model: str, tokenizer) -> dict:
    """The ``chat.completion`` or ``text_completion`` body of a finished request."""
    assert result.error is None, f"request {result.request_id} failed ({result.error}); use error_body"
    chat = parsed.messages is not None
    choices = []
    for out in result.outputs:
        choice: dict = {"index": out.index, "finish_reason": out.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
            choice["logprobs"] = _chat_logprobs(out.logprobs, tokenizer) if parsed.logprobs else None
        else:
            choice["text"] = out.text
            choice["logprobs"] = _completion_logprobs(out.logprobs, tokenizer) if parsed.logprobs else None
        choices.append(choice)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{result.request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result),
    }


def error_body(result: GenerationResult) -> dict:
    """The OpenAI error body of a request the engine refused (too long, bad token ids)."""
    code = "context_length_exceeded" if "tokens per sequence" in (result.error or "") else "invalid_value"
    return {"error": {"message": result.error, "type": "invalid_request_error", "param": None, "code": code}}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _chat_entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = _token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _chat_logprobs(logprobs: list[TokenLogprob] | None, tokenizer) -> dict:
    content = []
    for step in logprobs or []:
        entry = _chat_entry(tokenizer, step.token_id, step.logprob)
        entry["top_logprobs"] = [_chat_entry(tokenizer, t, lp) for t, lp in step.top_logprobs]
        content.append(entry)
    return {"content": content}


def _completion_logprobs(logprobs: list[TokenLogprob] | None, tokenizer) -> dict:
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for step in logprobs or []:
        text = _token_text(tokenizer, step.token_id)
        tokens.append(text)
        token_logprobs.append(step.logprob)
        top.append({_token_text(tokenizer, t): lp for t, lp in step.top_logprobs} if step.top_logprobs else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
