"""Piecewise token counts equal whole-text counts, and are only used where that holds."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from batchapi.validation.token_counts import PromptCounter, SegmentCounter

PIECES = ["hello", " world", "\n", "\n\n", "  ", "<|im_start|>", "<|im_end|>", "🤖", "é", "日本", " ", "\t", "x",
          "<|endoftext|>", "<|im_", "end|>", "'s", " 123", "Ÿ", "<|im_start|>assistant\n"]


def test_piecewise_counts_match_whole_text_counts(tiny_llama_dir):
    counter = PromptCounter(tiny_llama_dir)
    segments = SegmentCounter(counter.tokenizer)
    assert segments.enabled
    rng = random.Random(7)
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40))) for _ in range(2000)]
    for add in (False, True):
        whole = [len(e.ids) for e in counter.tokenizer.encode_batch_fast(texts, add_special_tokens=add)]
        assert segments.count(texts, add) == whole
        assert segments.count(texts, add) == whole  # again, from what it remembers
    assert segments.enabled  # the self-check found nothing


def test_tokenizers_with_a_normalizer_count_whole_texts():
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<s>": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>"])
    segments = SegmentCounter(tokenizer)
    assert not segments.enabled
    assert segments.count(["A b<s>a", ""], False) == [4, 0]
