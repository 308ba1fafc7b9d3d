"""The ``/v1/completions`` bodies the backend sends, and what it reads back from their results.

Every prompt goes as token ids, cut by the backend as lm-eval's ``hf`` backend cuts them, so the
service scores and continues exactly the tokens ``hf`` would. Scoring reads the echoed prompt's
logprobs (OpenAI's completions format: ``token_logprobs`` with ``null`` first, ``top_logprobs``
one dict of alternatives a token).
"""

from __future__ import annotations

MAX_STOP = 4  # the service's limit on ``stop`` (docs/API_EXTENSIONS.md)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed")  # gen_kwargs the body carries as they are


class MalformedResult(ValueError):
    """A result body without what the request asked for."""


def score_prompt(context_enc: list[int], continuation_enc: list[int], max_length: int) -> list[int]:
    """The prompt that scores ``continuation_enc``: what ``hf`` feeds its model (at most
    ``max_length`` tokens, cut on the left) and the last token, whose logprob that pass gives."""
    assert context_enc and continuation_enc, "a scored pair needs a context and a continuation"
    assert len(continuation_enc) <= max_length, f"a continuation of {len(continuation_enc)} tokens > max_length"
    return (context_enc + continuation_enc)[-(max_length + 1):]


def score_body(model: str, tokens: list[int]) -> dict:
    """Prefill only: the prompt's own logprobs, with the most likely alternative at each place."""
    return {"model": model, "prompt": tokens, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}


def generate_body(model: str, tokens: list[int], max_tokens: int, stop: list[str], sampling: dict) -> dict:
    """A continuation of ``tokens``. The service stops at up to ``MAX_STOP`` of the stop strings;
    the backend cuts the text at all of them afterwards, as ``hf`` does, so the rest only cost
    tokens, never change the answer."""
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
    body.update({name: sampling[name] for name in SAMPLING if sampling.get(name) is not None})
    stop = [s for s in stop if s][:MAX_STOP]
    if stop:
        body["stop"] = stop
    return body


def _choice(body: dict) -> dict:
    try:
        return body["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise MalformedResult(f"no choice in the result body: {str(body)[:200]}") from None


def read_score(body: dict, prompt_len: int, scored: int) -> tuple[float, bool]:
    """The summed logprob of the prompt's last ``scored`` tokens, and whether each of them was the
    most likely token at its place (lm-eval's ``is_greedy``)."""
    assert 0 < scored < prompt_len, f"cannot score {scored} of {prompt_len} prompt tokens"
    logprobs = _choice(body).get("logprobs") or {}
    token_logprobs, top = logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    if not isinstance(token_logprobs, list) or not isinstance(top, list) or len(token_logprobs) < prompt_len:
        raise MalformedResult(f"expected the logprobs of {prompt_len} echoed prompt tokens, got "
                              f"{len(token_logprobs) if isinstance(token_logprobs, list) else 'none'}")
    window = range(prompt_len - scored, prompt_len)
    values = [token_logprobs[i] for i in window]
    if any(v is None for v in values):
        raise MalformedResult("a scored prompt token has no logprob")
    # greedy: no alternative more likely than the token itself (its own logprob is among them)
    greedy = all(not top[i] or values[k] >= max(top[i].values()) for k, i in enumerate(window))
    return float(sum(values)), greedy


def read_text(body: dict) -> str:
    text = _choice(body).get("text")
    if not isinstance(text, str):
        raise MalformedResult(f"no text in the result body: {str(body)[:200]}")
    return text
