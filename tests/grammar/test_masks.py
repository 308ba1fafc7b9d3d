"""apply_masks against llguidance's own single-matcher mask, bit by bit, with the kernels' bitmask op
(the twin's; the bit-exact test runs the C one too)."""

import pytest
import torch

from batchapi.grammar import GrammarSpec, apply_masks
from batchapi.kernels import CPU_OPS, TORCH_OPS
from tests.grammar.schemas import EXTRACTION, LABEL, SHAPES

APPLY = TORCH_OPS.apply_token_bitmask  # the twin: what the grammar's tests pass to apply_masks


def library_allowed(matcher, vocab: int) -> torch.Tensor:
    """[vocab] bool oracle: the library's mask for this state, decoded bit by bit in Python."""
    raw = matcher._inner.compute_bitmask()  # test-only: the wrapped llguidance matcher
    return torch.tensor([bool(raw[i >> 3] >> (i & 7) & 1) for i in range(vocab)])


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of float tensors: equal only if bit-identical (-0.0 is not 0.0)."""
    return x.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[x.dtype])


def advanced(grammar, tokenizer, prefix: str):
    matcher = grammar.matcher()
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        assert matcher.accept(token), prefix
    return matcher


@pytest.fixture
def matchers(compiler, tokenizer):
    def grammar(schema):
        spec = GrammarSpec.json_schema(schema) if schema else GrammarSpec.json_object()
        return compiler.submit(spec).result(timeout=30)

    return [
        grammar(LABEL).matcher(),
        advanced(grammar(EXTRACTION), tokenizer, '{"title":"Hello'),
        advanced(grammar(SHAPES), tokenizer, '{"shapes":[{"kind":"circle","center":{"x":1'),
        grammar(None).matcher(),
        advanced(grammar(None), tokenizer, '{"a":[1,2'),
    ]


@pytest.mark.parametrize("kernels", [TORCH_OPS, CPU_OPS], ids=lambda ops: ops.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_free_rows", [True, False])
def test_masks_put_minus_inf_exactly_on_disallowed_tokens(compiler, vocab, tokenizer, matchers, dtype, with_free_rows,
                                                         kernels):
    rows = [matchers[0], None, matchers[1], matchers[2], None, matchers[3], matchers[4], None]
    if not with_free_rows:
        rows = [m for m in rows if m is not None]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[:, 5::101] = -0.0
    before = logits.clone()
    apply_masks(logits, rows, kernels.apply_token_bitmask)
    for i, matcher in enumerate(rows):
        if matcher is None:
            assert torch.equal(bits(logits[i]), bits(before[i]))
            continue
        allowed = library_allowed(matcher, vocab)
        assert 0 < allowed.sum() < vocab
        assert torch.equal(bits(logits[i][allowed]), bits(before[i][allowed]))
        assert torch.equal(logits[i][~allowed], torch.full_like(logits[i][~allowed], float("-inf")))
        assert not allowed[len(tokenizer):].any()  # padding past the tokenizer


def test_allowed_tokens_are_accepted(compiler, vocab, matchers):
    logits = torch.zeros(len(matchers), vocab)
    apply_masks(logits, matchers, APPLY)
    for row, matcher in enumerate(matchers):
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        for token in allowed[:: max(1, len(allowed) // 50)]:  # up to ~50 per row
            assert matcher.fork().accept(token), token


def test_the_bitmask_grows_and_is_reused(compiler, vocab, matchers):
    expected = library_allowed(matchers[1], vocab)
    for batch in (3, 40, 2):
        rows = [matchers[1].fork() for _ in range(batch)]
        logits = torch.zeros(batch, vocab)
        apply_masks(logits, rows, APPLY)
        assert all(torch.equal(torch.isfinite(logits[i]), expected) for i in range(batch))


def test_a_batch_without_grammars_is_untouched(compiler, vocab):
    logits = torch.randn(4, vocab)
    before = logits.clone()
    apply_masks(logits, [None] * 4, APPLY)
    assert torch.equal(logits, before)


def test_a_refused_token_stops_the_matcher_and_leaves_only_eos(compiler, vocab, tokenizer):
    matcher = compiler.submit(GrammarSpec.json_schema(LABEL)).result(timeout=30).matcher()
    assert not matcher.accept(tokenizer.encode("hello", add_special_tokens=False)[0])
    assert matcher.is_terminated
    logits = torch.zeros(1, vocab)
    apply_masks(logits, [matcher], APPLY)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_eos_is_allowed_exactly_when_the_grammar_may_end(compiler, vocab, tokenizer):
    matcher = compiler.submit(GrammarSpec.json_schema({"type": "integer"})).result(timeout=30).matcher()
    eos, digit = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("7")

    def allowed():
        logits = torch.zeros(1, vocab)
        apply_masks(logits, [matcher], APPLY)
        return torch.isfinite(logits[0])

    assert not allowed()[eos] and allowed()[digit]
    assert matcher.accept(tokenizer.convert_tokens_to_ids("4"))
    assert allowed()[eos] and allowed()[digit] and not matcher.is_terminated
    assert matcher.accept(eos)
    assert matcher.is_terminated


def test_a_fork_goes_its_own_way(compiler, tokenizer):
    grammar = compiler.submit(GrammarSpec.json_schema(LABEL)).result(timeout=30)
    parent = advanced(grammar, tokenizer, '{"label":"')
    child = parent.fork()
    for token in tokenizer.encode('billing"}', add_special_tokens=False):
        assert parent.accept(token)
    assert parent.is_terminated and not child.is_terminated
    for token in tokenizer.encode('sales"}', add_special_tokens=False):
        assert child.accept(token)
    assert child.is_terminated


def test_eos_token_ids_replace_the_tokenizers(tokenizer):
    from batchapi.grammar import GrammarCompiler

    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    compiler = GrammarCompiler(tokenizer, len(tokenizer), eos_token_ids=[tokenizer.eos_token_id, end])
    try:
        matcher = advanced(compiler.submit(GrammarSpec.json_object()).result(timeout=30), tokenizer, "{}")
        logits = torch.zeros(1, len(tokenizer))
        apply_masks(logits, [matcher], APPLY)
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted([tokenizer.eos_token_id, end])
    finally:
        compiler.close()
