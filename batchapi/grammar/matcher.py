"""A sequence's position in its grammar, and the step's token masks applied to the logits."""

from __future__ import annotations

import threading
from collections.abc import Callable

import llguidance
import torch

from batchapi.grammar.bitmask import bitmask_words

# logits [B, V], bitmask [R, W] int32, rows (R host ints) -> None: in place, logits[rows[k], v] = -inf
# wherever bit v of bitmask[k] is 0. The engine passes its kernel set's ops.apply_token_bitmask.
ApplyBitmask = Callable[[torch.Tensor, torch.Tensor, list[int]], None]


class Matcher:
    """One sequence's state in its grammar (an llguidance matcher). Not thread-safe: a matcher
    belongs to one sequence and is used from the engine's step thread only."""

    __slots__ = ("_inner", "_masks")

    def __init__(self, inner: llguidance.LLMatcher, masks: MaskWriter):
        self._inner = inner
        self._masks = masks

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the matcher stops) if the grammar refuses it."""
        return self._inner.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The document is complete (only EOS may follow), or the matcher stopped on an error."""
        return self._inner.is_stopped()

    def fork(self) -> Matcher:
        """An independent copy at the same position, for a sequence forked mid-generation."""
        return Matcher(self._inner.deep_copy(), self._masks)


class MaskWriter:
    """The token bitmask of one vocabulary's decode steps: allocated once, grown as needed, filled
    for all constrained rows in one llguidance call (which drops the GIL)."""

    def __init__(self, vocab_size: int, threads: int):
        self.vocab_size = vocab_size
        self._words = bitmask_words(vocab_size)
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._bitmask = torch.zeros(0, self._words, dtype=torch.int32)
        self._lock = threading.Lock()  # the bitmask is shared by every caller of this vocabulary

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher],
              apply: ApplyBitmask) -> None:
        assert logits.shape[1] == self.vocab_size, (
            f"logits have {logits.shape[1]} columns, the grammar compiler was built for {self.vocab_size}"
        )
        with self._lock:
            if len(self._bitmask) < len(rows):
                self._bitmask = torch.zeros(max(len(rows), 2 * len(self._bitmask)), self._words, dtype=torch.int32)
            bitmask = self._bitmask[: len(rows)]  # [R, W]
            self._executor.unsafe_compute_mask_ptr(
                [(matcher, k) for k, matcher in enumerate(matchers)], bitmask.data_ptr(), self._words * 4, len(rows)
            )
            apply(logits, bitmask, rows)


def apply_masks(logits: torch.Tensor, matchers: list[Matcher | None], apply: ApplyBitmask) -> None:
    """In place on logits [B, V] (fp32 or bf16): in every row whose matcher is not None, the tokens
    its grammar does not allow next become -inf; rows with None are untouched. ``apply`` writes the
    step's bitmask into the logits: the kernel op ``ops.apply_token_bitmask`` of batchapi.kernels
    (the engine's sampler passes its kernel set's; tests may pass the twin, ``TORCH_OPS``')."""
    assert logits.dim() == 2 and len(matchers) == len(logits), (
        f"logits {tuple(logits.shape)} do not match {len(matchers)} matchers"
    )
    rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return
    masks = matchers[rows[0]]._masks
    assert all(matchers[i]._masks is masks for i in rows), "one step's matchers must come from one compiler"
    masks.apply(logits, rows, [matchers[i]._inner for i in rows], apply)
