"""What goes into the engine and what comes out: plain dataclasses, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchapi.engine.sampling_params import SamplingParams


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


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


@dataclass
class GenerationResult:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    outputs: list[CompletionOutput]
    error: str | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
