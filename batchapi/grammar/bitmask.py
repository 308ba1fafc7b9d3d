"""Token bitmasks in the layout llguidance and xgrammar share: one row per sequence of int32 words,
bit j of word w allows token 32 * w + j. Applying them to logits is a kernel op, the engine's
``ops.apply_token_bitmask`` (batchapi.kernels), which the grammar takes from its caller: this
package imports no kernels."""

from __future__ import annotations


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
