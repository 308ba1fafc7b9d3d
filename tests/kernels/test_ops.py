"""The kernel sets and get_ops: which set each mode and device gets, and the C set's fallbacks."""

import pytest
import torch

from batchapi.kernels import CPU_OPS, MODES, TORCH_OPS, Ops, get_ops
from batchapi.kernels.cpu import attention as cpu_attention
from batchapi.kernels.cpu import build
from batchapi.kernels.cpu import elementwise as cpu_elementwise
from tests.kernels.paged import dense_attention, make_case

ELEMENTWISE = ["rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "store_kvcache", "argmax",
               "apply_token_bitmask"]


def test_get_ops_modes():
    assert get_ops("auto", "cpu") is CPU_OPS and get_ops("torch", "cuda") is TORCH_OPS
    with pytest.raises(AssertionError, match="kernel mode cpu runs on CPU tensors"):
        get_ops("cpu", "cuda")
    assert get_ops("triton", "cpu").name == "triton"  # imports the Triton modules; launching them is triton/'s
    with pytest.raises(AssertionError, match="kernel mode"):
        get_ops("cuda", "cpu")
    assert MODES == ("auto", "triton", "cpu", "torch")


def test_every_set_has_every_op():
    ops = [name for name in Ops.__dataclass_fields__ if name not in ("name", "invariant")]
    for kernels in (TORCH_OPS, CPU_OPS, get_ops("triton", "cpu")):
        for invariant in (False, True):
            chosen = get_ops(kernels.name, "cpu", invariant=invariant) if kernels.name != "cpu" else (
                get_ops("cpu", "cpu", invariant=invariant))
            assert chosen.invariant is invariant
            assert all(callable(getattr(chosen, name)) for name in ops), kernels.name


def test_invariant_sets_differ_only_in_attention():
    for mode in ("cpu", "torch", "triton"):
        plain, invariant = get_ops(mode, "cpu"), get_ops(mode, "cpu", invariant=True)
        differ = [name for name in Ops.__dataclass_fields__ if getattr(plain, name) != getattr(invariant, name)]
        assert differ == ["paged_attention", "invariant"], mode


def test_greedy_argmax_of_every_set_is_torchs():
    x = torch.randint(-3, 3, (5, 2048), generator=torch.Generator().manual_seed(0)).float()
    x[1, 7] = float("nan")
    for kernels in (TORCH_OPS, CPU_OPS):
        assert kernels.argmax(x).tolist() == x.argmax(-1).tolist(), kernels.name


def test_every_set_has_the_token_bitmask_and_the_cpu_ones_agree():
    for kernels in (TORCH_OPS, CPU_OPS, get_ops("triton", "cpu")):
        assert callable(kernels.apply_token_bitmask), kernels.name
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=g).bfloat16()
    bitmask = torch.randint(-2**31, 2**31, (2, 4), generator=g, dtype=torch.int64).to(torch.int32)
    outs = []
    for kernels in (TORCH_OPS, CPU_OPS):
        out = logits.clone()
        kernels.apply_token_bitmask(out, bitmask, [3, 1])
        outs.append(out.view(torch.int16))
    assert torch.equal(*outs) and bool(outs[0][[3, 1]].eq(-128).any())  # 0xff80: some -inf written
    assert torch.equal(outs[0][[0, 2]], logits.view(torch.int16)[[0, 2]])


def test_auto_picks_the_c_kernel_on_cpu_and_torch_stays_pure():
    assert get_ops("auto", "cpu") is CPU_OPS
    assert get_ops("cpu", "cpu") is CPU_OPS
    assert get_ops("torch", "cpu") is TORCH_OPS
    assert CPU_OPS.paged_attention is cpu_attention.paged_attention


def test_without_a_compiler_auto_falls_back_to_the_twins(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("BATCHAPI_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(build, "_state", {})
    assert build.load() is None
    assert "building paged_decode.c failed" in caplog.text
    assert get_ops("auto", "cpu") is TORCH_OPS
    with pytest.raises(AssertionError, match="kernel mode cpu needs a C compiler"):
        get_ops("cpu", "cpu")
    case = make_case([1, 5], [9, 5], 4, 2, 64, seed=4)
    out = cpu_attention.paged_attention(*case.args(), case.scale)  # the twin, whole
    torch.testing.assert_close(out, dense_attention(case), atol=2e-5, rtol=2e-5)


def test_auto_takes_the_c_set_when_only_one_library_builds(monkeypatch):
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_load", lambda: None)  # decode attention failed to build
    assert build.load() is None and build.load_elementwise() is not None
    assert get_ops("auto", "cpu") is CPU_OPS and get_ops("cpu", "cpu") is CPU_OPS
    case = make_case([1, 5], [9, 5], 4, 2, 64, seed=4)
    out = cpu_attention.paged_attention(*case.args(), case.scale)  # the twin, whole
    torch.testing.assert_close(out, dense_attention(case), atol=2e-5, rtol=2e-5)


def test_cpu_ops_use_the_c_kernels():
    assert get_ops("cpu", "cpu") is CPU_OPS
    assert [getattr(CPU_OPS, name) for name in ELEMENTWISE] == [getattr(cpu_elementwise, name) for name in ELEMENTWISE]


def test_a_failed_build_leaves_these_ops_on_the_twins(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("BATCHAPI_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(build, "_state", {})
    assert build.load_elementwise() is None
    assert "building elementwise.c failed" in caplog.text
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(64).bfloat16()
    assert torch.equal(CPU_OPS.rms_norm(x, w, 1e-6), TORCH_OPS.rms_norm(x, w, 1e-6))
