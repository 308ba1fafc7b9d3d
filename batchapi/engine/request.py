"""What goes into the engine and what comes out: plain dataclasses, no torch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum

from batchapi.engine.sampling_params import SamplingParams


class ErrorCode(StrEnum):
    """Why the engine finished a request with an error (GenerationResult.error_code)."""

    PROMPT_EMPTY = "prompt_empty"
    PROMPT_TOO_LONG = "prompt_too_long"  # the prompt cannot fit this engine's max model length
    INVALID_REQUEST = "invalid_request"  # token ids or sampling params refused when the request is added
    INVALID_GRAMMAR = "invalid_grammar"  # the grammar engine refused the request's schema
    ABORTED = "aborted"
    ENGINE_FAILURE = "engine_failure"  # the engine failed while running the request, not the request itself


class DuplicateRequestId(ValueError):
    """A request was added while another with the same id is still in flight."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # more prompts of the same request (a completions body's list of prompts): each runs with
    # ``params``, and the result holds one part per prompt (``GenerationResult.parts``)
    more_prompts: list[list[int]] = field(default_factory=list)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # stop | length | error
    logprobs: list[TokenLogprob] | None = None
    # a request that thinks: its first output tokens form a thinking block (markers included), whose
    # text is ``thinking_text``; ``text`` is then the answer after it (stop strings search only that)
    thinking_tokens: int = 0
    thinking_text: str = ""
    reasoning: str | None = None  # the block's text without its markers, set by the codec (workers.codec)


@dataclass
class GenerationResult:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    outputs: list[CompletionOutput]
    error: str | None = None  # for people; error_code is what callers act on
    error_code: ErrorCode | None = None
    # SamplingParams.prompt_logprobs: an entry per prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # a request of several prompts: one result per prompt, in order (the counts above are their sums,
    # ``outputs`` all their outputs, indexed prompt by prompt: prompt i's sample j is i * n + j)
    parts: list[GenerationResult] | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


Callback = Callable[[GenerationResult], None]  # called with a request's result once it is done

log = logging.getLogger(__name__)


def resolve(future: Future, callback: Callback | None, result: GenerationResult) -> None:
    """Give a request its result: the future first, then its callback (one that raises is logged)."""
    future.set_result(result)
    if callback is not None:
        try:
            callback(result)
        except Exception:
            log.exception("result callback for %s raised", result.request_id)
