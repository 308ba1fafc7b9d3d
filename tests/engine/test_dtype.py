"""dtype auto: bf16 on CPU only where oneDNN has bf16 kernels and they measure faster than fp32."""

import pytest
import torch

from batchapi.engine import platform
from batchapi.engine.config import DTYPES
from batchapi.engine.platform import fastest_cpu_dtype, resolve_dtype


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.setattr(platform, "_cpu_dtype_choice", {})


def test_named_dtypes_are_taken_as_given():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("float16", cpu) is torch.float16
    assert set(platform.TORCH_DTYPES) == set(DTYPES) - {"auto"}  # every name the config takes has its dtype


def test_without_bf16_kernels_auto_is_float32_unmeasured(monkeypatch):
    monkeypatch.setattr(platform, "_has_bf16_matmul_kernels", lambda: False)
    monkeypatch.setattr(platform, "_race", lambda *a, **k: pytest.fail("measured needlessly"))
    assert resolve_dtype("auto", torch.device("cpu"), 576) is torch.float32


@pytest.mark.parametrize(("fp32_s", "bf16_s", "expected"), [(1.0, 0.4, torch.bfloat16), (1.0, 2.0, torch.float32)])
def test_with_bf16_kernels_the_faster_is_taken_and_measured_once(monkeypatch, fp32_s, bf16_s, expected):
    calls = []
    monkeypatch.setattr(platform, "_has_bf16_matmul_kernels", lambda: True)

    def race(hidden, dtypes):
        calls.append(hidden)
        return {torch.float32: fp32_s, torch.bfloat16: bf16_s}

    monkeypatch.setattr(platform, "_race", race)
    assert fastest_cpu_dtype(64) is expected
    assert fastest_cpu_dtype(64) is expected
    assert calls == [64]


def test_this_machine():
    # on an AVX2-only CPU (no oneDNN bf16 kernels) auto must give float32
    choice = resolve_dtype("auto", torch.device("cpu"), 576)
    if not platform._has_bf16_matmul_kernels():
        assert choice is torch.float32
    else:
        assert choice in (torch.float32, torch.bfloat16)


def test_race_times_each_dtype_through_the_engines_own_layers():
    times = platform._race(64, (torch.float32, torch.bfloat16), rows=4, rounds=2)
    assert set(times) == {torch.float32, torch.bfloat16}
    assert all(0 < t < 10 for t in times.values())
