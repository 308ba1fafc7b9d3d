"""A reasoning model's thinking block at the start of an output, token by token (no torch).

A request that thinks carries a ``Thinking`` in its sampling params: the token ids of the model's
own markers (read from its chat template by ``openai.reasoning``), whether the prompt already
opened the block, and a budget. Each of its sequences keeps a ``ThinkingState``: it forces the
opening marker first when the prompt did not open the block, counts the tokens inside, and once
they reach the budget forces the closing marker. A grammar (structured outputs, tool calls)
applies only after the block has closed, so a model thinks in free text and answers in the
schema. Forcing picks the token, it does not bend the logits: a forced token's logprob is the
model's own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thinking:
    start: tuple[int, ...]  # the tokens that open a thinking block
    end: tuple[int, ...]  # the tokens that close it
    budget: int | None = None  # at most this many tokens inside the block (markers aside); None: no limit
    opened: bool = False  # the prompt ends inside the block (its generation prompt opened it)

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("thinking markers must be non-empty token id sequences")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 0):
            raise ValueError(f"the thinking budget must be an integer >= 0 or None, got {self.budget!r}")


class ThinkingState:
    """One sequence's place in its thinking block."""

    __slots__ = ("spec", "forced", "inside", "ended", "inner", "tokens")

    def __init__(self, spec: Thinking):
        self.spec = spec
        self.forced: list[int] = [] if spec.opened else list(spec.start)  # the next tokens, in order
        self.inside = spec.opened
        self.ended = False
        self.inner = 0  # tokens inside the block so far, markers aside
        self.tokens = 0  # output tokens of the block, its markers included

    def forced_token(self) -> int | None:
        """The token the next step must take, if any (a marker being forced)."""
        if not self.forced and self.inside and not self.ended and self._over_budget:
            self.forced = list(self.spec.end)
        return self.forced[0] if self.forced else None

    @property
    def constrained(self) -> bool:
        """Whether a grammar applies to the next token: only once the block has closed."""
        return self.ended

    @property
    def _over_budget(self) -> bool:
        return self.spec.budget is not None and self.inner >= self.spec.budget

    def accept(self, token: int, tokens: list[int]) -> None:
        """Take the sequence's new output token (already appended to ``tokens``, its whole token
        list: only the block's own tail is read, so nothing is copied per token)."""
        if self.ended:
            return
        self.tokens += 1
        if self.forced:
            if token != self.forced[0]:  # a stop or a length cut raced the marker; nothing follows
                self.forced.clear()
                return
            self.forced.pop(0)
            if self.forced:
                return
            if self.inside:  # the closing marker is complete
                self.ended = True
            else:
                self.inside = True
            return
        if not self.inside:  # not reached: the block opens by force or by the prompt
            return
        end = self.spec.end
        if self.tokens >= len(end) and tuple(tokens[-len(end):]) == end:  # the tail lies inside the block
            self.ended = True
            self.inner -= len(end) - 1  # the marker's first tokens were counted as inside
            return
        self.inner += 1
