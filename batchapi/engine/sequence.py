"""One generation stream: prompt tokens, generated tokens and its place in the KV cache.

Plain Python (no torch). A request with n > 1 becomes n sequences: the first computes the
prompt, the others fork from it and share its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import count
from typing import Any

from batchapi.engine.request import ErrorCode

_seq_ids = count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: Any  # SamplingParams
    sample_index: int = 0
    num_prompt_tokens: int = -1
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache on first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of this seq's full blocks
    finish_reason: str | None = None
    error: str | None = None
    error_code: ErrorCode | None = None
    logprobs: list | None = None
    num_forks: int = 0  # children still to fork once the prompt is computed (n > 1)
    text: str = ""
    matcher: Any = None  # grammar.Matcher of a constrained request, advanced by each output token
    thinking: Any = None  # thinking.ThinkingState of a request that thinks
    # prompt logprobs (engine.prompt_scores): an entry per prompt token (None for the first), the
    # top alternatives kept for the score cache, and the prompt's block hashes
    prompt_logprobs: list | None = None
    prompt_top: dict = field(default_factory=dict)
    prompt_hashes: list | None = None

    @property
    def active_matcher(self):
        """The matcher that constrains the next token: none while a thinking block is open."""
        if self.thinking is not None and not self.thinking.constrained:
            return None
        return self.matcher

    @property
    def forced_token(self) -> int | None:
        """The token the next step must take (a thinking marker), if any."""
        return self.thinking.forced_token() if self.thinking is not None else None

    def __post_init__(self):
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str) -> None:
        """End the sequence: "stop" or "length" (an error ends it through ``fail``)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def fail(self, code: ErrorCode, message: str) -> None:
        self.finish("error")
        self.error, self.error_code = message, code
