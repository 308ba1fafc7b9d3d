"""Greedy walks: argmax of random logits under the mask, token by token, give valid documents.

Random logits would keep a free string going for thousands of tokens (few tokens close one), so the
walks nudge every token that holds a quote up, as a model that knows when to stop would.
"""

import json

import jsonschema
import pytest
import torch

from batchapi.grammar import GrammarSpec, apply_masks
from batchapi.kernels import TORCH_OPS
from tests.grammar.schemas import EXTRACTION, LABEL, NO_STRINGS, SHAPES

APPLY = TORCH_OPS.apply_token_bitmask
MAX_TOKENS = 3000
QUOTE_NUDGE = 2.5


@pytest.fixture(scope="module")
def nudge(tokenizer, vocab) -> torch.Tensor:
    """[V] logit bonus of the tokens that hold a quote (the padding ids get none)."""
    bonus = torch.zeros(vocab)
    bonus[[i for i in range(len(tokenizer)) if '"' in tokenizer.decode([i])]] = QUOTE_NUDGE
    return bonus


def only_eos_left(matcher, vocab: int, eos: int) -> bool:
    logits = torch.zeros(1, vocab)
    apply_masks(logits, [matcher], APPLY)
    return torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]


def greedy_walk(grammar, tokenizer, vocab: int, seed: int, bonus: torch.Tensor, dtype=torch.float32) -> str:
    gen = torch.Generator().manual_seed(seed)
    matcher, tokens = grammar.matcher(), []
    while len(tokens) < MAX_TOKENS:
        logits = (torch.randn(1, vocab, generator=gen) + bonus).to(dtype)
        apply_masks(logits, [matcher], APPLY)
        assert torch.isinf(logits[0, len(tokenizer):]).all(), "a padding id was allowed"
        token = int(logits[0].argmax())
        assert token != tokenizer.eos_token_id, f"EOS before the document was complete: {tokenizer.decode(tokens)!r}"
        assert matcher.accept(token)
        tokens.append(token)
        if matcher.is_terminated:
            assert only_eos_left(matcher, vocab, tokenizer.eos_token_id)
            return tokenizer.decode(tokens)
    raise AssertionError(f"no complete document in {MAX_TOKENS} tokens: {tokenizer.decode(tokens)[:300]!r}")


@pytest.mark.parametrize("schema", [LABEL, EXTRACTION, SHAPES], ids=["enum", "nested", "defs-anyof"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_walks_validate_against_the_schema(compiler, vocab, tokenizer, nudge, schema, seed):
    grammar = compiler.submit(GrammarSpec.json_schema(schema)).result(timeout=30)
    text = greedy_walk(grammar, tokenizer, vocab, seed, nudge)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object_walks_give_an_object(compiler, vocab, tokenizer, nudge, seed):
    grammar = compiler.submit(GrammarSpec.json_object()).result(timeout=30)
    assert isinstance(json.loads(greedy_walk(grammar, tokenizer, vocab, seed, nudge)), dict)


def test_bf16_walks_validate(compiler, vocab, tokenizer, nudge):
    grammar = compiler.submit(GrammarSpec.json_schema(EXTRACTION)).result(timeout=30)
    text = greedy_walk(grammar, tokenizer, vocab, 3, nudge, dtype=torch.bfloat16)
    jsonschema.validate(json.loads(text), EXTRACTION)


def test_whitespace_cannot_run_away(compiler, vocab, tokenizer):
    """A walk that prefers whitespace above all still ends, compact, with no whitespace at all."""
    bonus = torch.zeros(vocab)
    spaces = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).isspace()]
    assert len(spaces) > 10
    bonus[spaces] = 100.0
    bonus[len(tokenizer):] = 1000.0  # padding ids are never allowed, however likely
    grammar = compiler.submit(GrammarSpec.json_schema(NO_STRINGS)).result(timeout=30)
    text = greedy_walk(grammar, tokenizer, vocab, 0, bonus)
    assert not any(ch.isspace() for ch in text)
    jsonschema.validate(json.loads(text), NO_STRINGS)


def test_a_batch_of_mixed_rows_walks_to_valid_documents(compiler, vocab, tokenizer, nudge):
    """Constrained rows end in valid documents; unconstrained rows are never touched."""
    schemas = [LABEL, None, EXTRACTION, None, SHAPES, {}]  # None: unconstrained; {}: json_object
    specs = {i: GrammarSpec.json_schema(s) if s else GrammarSpec.json_object() for i, s in enumerate(schemas)
             if s is not None}
    matchers = [compiler.submit(specs[i]).result(timeout=30).matcher() if i in specs else None
                for i in range(len(schemas))]
    tokens = {i: [] for i in specs}
    gen = torch.Generator().manual_seed(7)
    for _ in range(MAX_TOKENS):
        if all(m is None for m in matchers):
            break
        logits = torch.randn(len(schemas), vocab, generator=gen) + nudge
        before = logits.clone()
        apply_masks(logits, matchers, APPLY)
        for row, matcher in enumerate(matchers):
            if matcher is None:
                assert torch.equal(logits[row], before[row])
                continue
            token = int(logits[row].argmax())
            assert matcher.accept(token)
            tokens[row].append(token)
            if matcher.is_terminated:
                matchers[row] = None
    assert all(m is None for m in matchers), "a document did not finish"
    for row, spec in specs.items():
        doc = json.loads(tokenizer.decode(tokens[row]))
        if spec.kind == "json_schema":
            jsonschema.validate(doc, schemas[row])
        assert isinstance(doc, dict)
