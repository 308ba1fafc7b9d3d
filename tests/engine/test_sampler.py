import dataclasses
import math

import pytest
import torch

from batchapi.engine.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SampleRow,
    _apply_penalties,
    _keep_thresholds,
    seeded_uniform,
)
from batchapi.engine.sampling_params import SamplingParams
from batchapi.kernels import CPU_OPS, TORCH_OPS

VOCAB = 1000
# a hand-built distribution: top_p, min_p and top_k cuts fall well away from ties and rounding
PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]


def rows_of(params: SamplingParams, count: int, output: list[int] | None = None) -> list[SampleRow]:
    return [SampleRow(params, list(output or []), 0) for _ in range(count)]


def tokens(sampler: Sampler, logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    return [o.token_id for o in sampler(logits, rows)]


def hand_built(count: int) -> torch.Tensor:
    return torch.tensor(PROBS).log().expand(count, -1).contiguous()


def drawn(params: SamplingParams, count: int = 4000) -> list[int]:
    return tokens(Sampler(seed=0), hand_built(count), rows_of(params, count))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = tokens(Sampler(seed=0), logits, rows_of(SamplingParams(temperature=0), 64))
    assert out == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kernels", [TORCH_OPS, CPU_OPS], ids=lambda ops: ops.name)
def test_greedy_rows_take_the_argmax_of_the_runners_kernels(kernels):
    calls = []
    ops = dataclasses.replace(kernels, argmax=lambda x: calls.append(tuple(x.shape)) or kernels.argmax(x))
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    greedy = rows_of(SamplingParams(temperature=0), 4)
    mixed = greedy[:2] + rows_of(SamplingParams(temperature=0.8, top_k=5), 2)
    assert tokens(Sampler(ops, seed=0), logits[:4], greedy) == logits[:4].argmax(-1).tolist()
    assert tokens(Sampler(ops, seed=0), logits[:4], mixed)[:2] == logits[:2].argmax(-1).tolist()
    assert calls == [(4, VOCAB), (2, VOCAB)]  # the fast path, then the greedy block of a mixed batch


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = [SampleRow(SamplingParams(temperature=0 if i % 2 else 0.8, top_k=5), [], 0) for i in range(6)]
    out = tokens(Sampler(seed=0), logits, rows)
    assert out[1::2] == logits[1::2].argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_of_100_forces_a_token(temperature):
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    params = SamplingParams(temperature=temperature, logit_bias={123: 100.0, 7: -100.0})
    assert tokens(Sampler(seed=0), logits, rows_of(params, 32)) == [123] * 32


def test_logit_bias_of_minus_100_bans_the_argmax():
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(-1).tolist()
    rows = [SampleRow(SamplingParams(temperature=0, logit_bias={b: -100.0}), [], 0) for b in best]
    expected = logits.topk(2, dim=-1).indices[:, 1].tolist()
    assert tokens(Sampler(seed=0), logits, rows) == expected


def test_penalties_follow_openai_formula_exactly():
    x = torch.zeros(3, 6)
    rows = [
        SampleRow(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [1, 1, 4, 1], 0),
        SampleRow(SamplingParams(), [0, 0, 0], 0),  # no penalties: untouched
        SampleRow(SamplingParams(frequency_penalty=-1.0), [5, 2, 5], 0),
    ]
    _apply_penalties(x, rows)
    expected = torch.tensor(
        [
            [0.0, -(3 * 0.5 + 0.25), 0.0, 0.0, -(1 * 0.5 + 0.25), 0.0],
            [0.0] * 6,
            [0.0, 0.0, 1.0, 0.0, 0.0, 2.0],
        ]
    )
    assert torch.equal(x, expected)


@pytest.mark.parametrize(("frequency", "expected"), [(0.2, 0), (0.3, 1)])
def test_penalties_move_the_greedy_choice_at_the_right_margin(frequency, expected):
    # token 0: 1.0 - 2 * frequency - 0.05 against token 1: 0.5
    logits = torch.tensor([[1.0, 0.5, -5.0]])
    params = SamplingParams(temperature=0, frequency_penalty=frequency, presence_penalty=0.05)
    assert tokens(Sampler(seed=0), logits, [SampleRow(params, [0, 0], 0)]) == [expected]


def test_penalties_count_only_output_tokens_of_their_own_row():
    logits = torch.tensor([[1.0, 0.9, 0.0]] * 2)
    params = SamplingParams(temperature=0, presence_penalty=0.5)
    rows = [SampleRow(params, [0], 0), SampleRow(params, [1], 0)]
    assert tokens(Sampler(seed=0), logits, rows) == [1, 0]


def test_top_k_1_equals_greedy():
    logits = torch.randn(128, VOCAB, generator=torch.Generator().manual_seed(4))
    out = tokens(Sampler(seed=0), logits, rows_of(SamplingParams(temperature=1.5, top_k=1), 128))
    assert out == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(), set(range(8))),
        (SamplingParams(top_p=0.7), {0, 1, 2}),  # mass before token 3 is 0.8
        (SamplingParams(top_p=0.3), {0}),
        (SamplingParams(min_p=0.2), {0, 1, 2, 3}),  # keep p >= 0.08
        (SamplingParams(min_p=0.5), {0, 1}),  # keep p >= 0.2
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=3, top_p=0.8), {0, 1}),  # top_p of the top 3: 0.5, 0.3125, 0.1875
        (SamplingParams(min_p=0.1, top_p=0.9), {0, 1, 2, 3}),  # min_p leaves 0.95; 0.9 of it needs token 3
        (SamplingParams(temperature=0.5, top_p=0.7), {0, 1}),  # p^2: 0.16, 0.0625 of 0.2574...
    ],
)
def test_filters_keep_exactly_the_right_tokens(params, kept):
    assert set(drawn(params)) == kept


def test_draws_follow_the_filtered_distribution():
    out = drawn(SamplingParams(top_k=2), 8000)
    assert abs(out.count(0) / len(out) - 0.4 / 0.65) < 0.03
    out = drawn(SamplingParams(), 8000)
    for token, p in enumerate(PROBS):
        assert abs(out.count(token) / len(out) - p) < 0.02, token


def test_temperature_sharpens_and_flattens():
    cold = drawn(SamplingParams(temperature=0.25), 4000).count(0) / 4000
    hot = drawn(SamplingParams(temperature=4.0), 4000).count(0) / 4000
    p0 = lambda t: PROBS[0] ** (1 / t) / sum(p ** (1 / t) for p in PROBS)  # noqa: E731
    assert abs(cold - p0(0.25)) < 0.03 and abs(hot - p0(4.0)) < 0.03


def reference_thresholds(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Full-sort oracle: the smallest probability kept by top_k then top_p."""
    out = []
    for row, k, p in zip(probs.double(), top_k.tolist(), top_p.tolist(), strict=True):
        values = row.sort(descending=True).values[:k]
        before = values.cumsum(0) - values
        kept = int((before < p * values.sum()).sum()) if p < 1 else k
        out.append(float(values[max(kept, 1) - 1]))
    return torch.tensor(out, dtype=torch.float64)


def test_top_k_top_p_cut_matches_a_full_sort_even_past_the_candidate_window():
    vocab = 49152
    gen = torch.Generator().manual_seed(5)
    # sharp and flat rows, so top_p cuts land inside the first window, the second, and past both
    scale = torch.tensor([8.0, 4.0, 1.0, 0.05, 0.01, 3.0, 0.01, 2.0, 0.05, 1.0])[:, None]
    probs = torch.softmax(torch.randn(10, vocab, generator=gen) * scale, dim=-1)
    top_k = torch.tensor([vocab, vocab, vocab, vocab, vocab, 40, 5000, 300, vocab, 40])
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.5, 0.99, 0.7, 0.9, 1.0, 0.0, 0.0])
    got = _keep_thresholds(probs, top_k, top_p)
    want = reference_thresholds(probs, top_k, top_p)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=0), (got, want)
    kept = (probs >= got[:, None]).sum(-1)
    assert kept[3] > TOP_P_CANDIDATES[-1], "a row must exercise the full-vocabulary fallback"
    assert kept[8:].tolist() == [1, 1] and got[8:].tolist() == probs[8:].max(-1).values.tolist()  # top_p 0: the top one


def seeded_row(seed: int, output: list[int], sample_index: int = 0, **kw) -> SampleRow:
    return SampleRow(SamplingParams(seed=seed, **kw), output, sample_index)


def test_same_seed_same_tokens_whatever_the_batch():
    gen = torch.Generator().manual_seed(6)
    target = torch.randn(VOCAB, generator=gen)  # the seeded request's logits, step after step
    others = torch.randn(7, VOCAB, generator=gen)
    other_rows = [
        SampleRow(SamplingParams(), [], 0),
        SampleRow(SamplingParams(temperature=0), [3], 0),
        seeded_row(99, [1, 2]),
        SampleRow(SamplingParams(top_k=20, top_p=0.5, min_p=0.1), [], 0),
        seeded_row(42, [5], sample_index=1),
        SampleRow(SamplingParams(presence_penalty=1.0, logit_bias={3: 5.0}), [9, 9], 0),
        seeded_row(7, []),
    ]
    for kw in ({}, {"top_p": 0.9, "temperature": 0.7}, {"top_k": 50, "min_p": 0.02}):
        alone, output_a = Sampler(seed=1), []
        crowded, output_b = Sampler(seed=2), []
        for step in range(12):
            output_a.append(tokens(alone, target[None], [seeded_row(42, list(output_a), **kw)])[0])
            position = step % 8
            logits = torch.cat([others[:position], target[None], others[position:]])
            rows = other_rows[:position] + [seeded_row(42, list(output_b), **kw)] + other_rows[position:]
            output_b.append(tokens(crowded, logits, rows)[position])
        assert output_a == output_b, kw


def test_different_seeds_and_sample_indexes_differ():
    flat = torch.zeros(1, VOCAB)
    draws = {
        (seed, index): [
            tokens(Sampler(), flat, [seeded_row(seed, [0] * step, index)])[0] for step in range(8)
        ]
        for seed in (1, 2)
        for index in (0, 1)
    }
    assert len({tuple(v) for v in draws.values()}) == 4
    assert len(set(draws[1, 0])) > 1, "steps must draw different numbers"


def test_seeded_uniform_is_stable_and_in_range():
    assert seeded_uniform(42, 0, 0) == seeded_uniform(42, 0, 0)
    values = [seeded_uniform(s, i, t) for s in (-(2**63), 0, 2**63 - 1) for i in range(3) for t in range(3)]
    assert all(0.0 <= v < 1.0 for v in values) and len(set(values)) == len(values)


def test_unseeded_rows_of_one_request_are_independent():
    flat = torch.zeros(4, VOCAB)
    out = tokens(Sampler(seed=0), flat, [SampleRow(SamplingParams(n=4), [], i) for i in range(4)])
    assert len(set(out)) == 4


def test_logprobs_are_of_the_raw_model_distribution():
    logits = (torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8)) * 2).to(torch.bfloat16)
    raw = torch.log_softmax(logits.float(), dim=-1)
    rows = [
        SampleRow(
            SamplingParams(temperature=0, logprobs=True, top_logprobs=5, logit_bias={11: 100.0}), [], 0
        ),
        SampleRow(SamplingParams(temperature=0.5, top_k=3, logprobs=True), [], 0),
        SampleRow(SamplingParams(), [], 0),
    ]
    out = Sampler(seed=0)(logits, rows)
    assert out[0].token_id == 11
    assert out[0].logprob == pytest.approx(float(raw[0, 11]), abs=1e-5)
    top = raw[0].topk(5)
    assert [t for t, _ in out[0].top_logprobs] == top.indices.tolist()
    assert [v for _, v in out[0].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out[1].logprob == pytest.approx(float(raw[1, out[1].token_id]), abs=1e-5)
    assert out[1].top_logprobs == []
    assert out[2].logprob is None and out[2].top_logprobs == []
    assert all(math.isfinite(o.logprob) for o in out[:2])


def test_accepts_logits_on_the_batch_device_only_shape_checked():
    with pytest.raises(AssertionError, match="do not match"):
        Sampler()(torch.zeros(2, VOCAB), rows_of(SamplingParams(), 3))


@pytest.mark.parametrize(("temperature", "p0"), [(1.0, 0.75), (2.0, 3**0.5 / (1 + 3**0.5))])
def test_logit_bias_applies_before_temperature(temperature, p0):
    # logits equal, bias log(3) on token 0: P(0) = 3^(1/T) / (3^(1/T) + 1)
    logits = torch.zeros(8000, 2)
    params = SamplingParams(temperature=temperature, logit_bias={0: math.log(3)})
    out = tokens(Sampler(seed=0), logits, rows_of(params, 8000))
    assert abs(out.count(0) / len(out) - p0) < 0.02


def test_penalties_scale_with_the_row_factor():
    x = torch.zeros(2, 3)
    rows = [SampleRow(SamplingParams(frequency_penalty=1.0), [2, 2], 0)] * 2
    _apply_penalties(x, rows, torch.tensor([1.0, 0.5]))
    assert torch.equal(x, torch.tensor([[0.0, 0.0, -2.0], [0.0, 0.0, -1.0]]))


def test_nan_logits_still_give_a_valid_token_id():
    logits = torch.full((2, VOCAB), float("nan"))
    out = tokens(Sampler(seed=0), logits, rows_of(SamplingParams(top_p=0.9), 2))
    assert all(0 <= t < VOCAB for t in out)


def test_rows_regrouped_internally_come_back_in_their_places():
    kinds = [
        {"temperature": 0},
        {"top_p": 0.9},
        {},
        {"min_p": 0.1},
        {"top_k": 5, "min_p": 0.1},
        {"temperature": 0, "presence_penalty": 1.0},
        {"top_k": 3},
        {"seed": 1, "top_p": 0.5},
    ]
    rows = [
        SampleRow(SamplingParams(logit_bias={100 + i: 100.0}, **kw), [1], 0) for i, kw in enumerate(kinds * 3)
    ]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(9))
    assert tokens(Sampler(seed=0), logits, rows) == [100 + i for i in range(len(rows))]


def test_logit_bias_past_the_vocabulary_is_ignored_not_raised():
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    params = SamplingParams(temperature=0, logit_bias={7: 100.0, 2: 1.0})
    assert tokens(Sampler(seed=0), logits, [SampleRow(params, [], 0)]) == [2]
