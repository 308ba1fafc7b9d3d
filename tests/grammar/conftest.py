"""The default model's real tokenizer, and grammar compilers for it with a padded logits width."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from batchapi.grammar import GrammarCompiler

PADDING = 64  # models pad lm_head past the tokenizer, e.g. to a multiple of 64


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def vocab(tokenizer) -> int:
    """The logits width: the tokenizer's vocabulary and the padding after it."""
    return len(tokenizer) + PADDING


@pytest.fixture
def compiler(tokenizer, vocab):
    compiler = GrammarCompiler(tokenizer, vocab)
    yield compiler
    compiler.close()
