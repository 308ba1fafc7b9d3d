"""Token counts that reuse the work done for text seen before (shared system prompts,
few-shot examples).

A Hugging Face tokenizer first cuts the text at its added tokens (``<|im_start|>`` ...) and
tokenizes each piece between them on its own, so a prompt's count is the number of added
tokens plus the counts of the pieces. Pieces are counted once and remembered by hash. This
only holds for tokenizers whose pieces do not depend on their position or neighbours, so it
is switched on only for those (no stripping added tokens, no normalizer, no SentencePiece
prefix), and checked against whole-text encoding on the first prompts before it is trusted.
"""

from __future__ import annotations

import json
import logging
import re

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

MAX_REMEMBERED = 200_000
CHECKED_TEXTS = 64


class SegmentCounter:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._splitter = _added_token_splitter(tokenizer)
        self._counts: dict[int, int] = {}
        self._to_check = CHECKED_TEXTS

    @property
    def enabled(self) -> bool:
        return self._splitter is not None

    def count(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        if not texts:
            return []
        if self._splitter is None:
            return self._whole(texts, add_special_tokens)
        counts = self._segmented(texts, add_special_tokens)
        if self._to_check > 0:
            self._check(texts[: self._to_check], counts, add_special_tokens)
        return counts if self._splitter is not None else self._whole(texts, add_special_tokens)

    def _whole(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [len(e.ids) for e in encodings]

    def _segmented(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        split = [self._splitter.split(text) for text in texts]  # text, added, text, added, ..., text
        unknown: dict[int, str] = {}
        for parts in split:
            for piece in parts[::2]:
                key = hash(piece)
                if piece and key not in self._counts:
                    unknown[key] = piece
        if len(self._counts) + len(unknown) > MAX_REMEMBERED:
            self._counts.clear()
            unknown = {hash(p): p for parts in split for p in parts[::2] if p}
        self._counts.update(zip(unknown, self._whole(list(unknown.values()), False), strict=True))
        extra = self.tokenizer.num_special_tokens_to_add(False) if add_special_tokens else 0
        return [
            extra + len(parts) // 2 + sum(self._counts[hash(p)] for p in parts[::2] if p) for parts in split
        ]

    def _check(self, texts: list[str], counts: list[int], add_special_tokens: bool) -> None:
        self._to_check -= len(texts)
        if self._whole(texts, add_special_tokens) != counts[: len(texts)]:
            log.warning("piecewise token counts differ from whole-text counts; counting whole texts")
            self._splitter = None


def _added_token_splitter(tokenizer: Tokenizer) -> re.Pattern | None:
    spec = json.loads(tokenizer.to_str())
    if spec.get("normalizer") is not None or "Metaspace" in json.dumps(spec.get("pre_tokenizer")):
        return None
    added = list(tokenizer.get_added_tokens_decoder().values())
    if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
        return None
    # longest first, so the regex takes the longest token at the leftmost match, as the tokenizer does
    contents = sorted({t.content for t in added}, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(c) for c in contents) + ")")
