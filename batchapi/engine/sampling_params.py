"""How to pick the tokens of one request: the engine-side twin of an OpenAI body's sampling fields.

Plain Python (no torch), so the scheduler side and the workers can build and pass it around.
Bounds are those OpenAI documents, or wider where the engine has no reason to refuse
(temperature above 2, any top_k); ``batchapi.openai.body`` applies the API's own limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchapi.engine.thinking import Thinking
from batchapi.grammar.spec import GrammarSpec

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: until a stop or the model's context runs out
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    grammar: GrammarSpec | None = None  # the output follows it, token by token (structured outputs)
    thinking: Thinking | None = None  # the output opens with a thinking block; the grammar applies after it
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many alternatives (0-20)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI lets `stop` be one string
            self.stop = [self.stop]
        self._check_lengths()
        self._check_distribution()
        self._check_token_maps()
        self._check_logprobs()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a token id named here is outside the model's vocabulary.

        The engine calls this when a request is submitted, so that the sampler never sees one."""
        markers = (*self.thinking.start, *self.thinking.end) if self.thinking is not None else ()
        bad = [t for t in (*self.logit_bias, *self.stop_token_ids, *markers) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be an integer >= 0 or None, got {self.max_tokens!r}")
        if self.max_tokens == 0 and (self.prompt_logprobs is None or self.n != 1):
            raise ValueError("max_tokens 0 (a prompt scored, nothing generated) needs prompt_logprobs and n 1")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")

    def _check_distribution(self) -> None:
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 <= self.top_p <= 1:  # 0: the most likely token (and its ties)
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or abs(value) > MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}")

    def _check_token_maps(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias key {token!r} is not a token id")
            if not _is_finite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {bias!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")

    def _check_logprobs(self) -> None:
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=True")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}] or None, got {self.prompt_logprobs!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {self.grammar!r}")
        if self.thinking is not None and not isinstance(self.thinking, Thinking):
            raise ValueError(f"thinking must be a Thinking, got {self.thinking!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
