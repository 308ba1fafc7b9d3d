"""dtype auto picks the faster of bf16 and fp32 on CPU, by measuring, so AVX2-only CPUs get fp32."""

import torch

from batchapi.engine import model_runner
from batchapi.engine.model_runner import fastest_cpu_dtype, resolve_dtype


def test_named_dtypes_are_taken_as_given():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("float16", cpu) is torch.float16


def test_auto_on_cpu_is_bf16_only_where_onednn_has_bf16_kernels(monkeypatch):
    monkeypatch.setattr(model_runner, "_cpu_dtype_choice", {})
    # without AVX512-BF16/AMX a bf16 matmul runs several times slower than fp32; with them, faster
    expected = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    assert fastest_cpu_dtype(576) is expected
    assert resolve_dtype("auto", torch.device("cpu"), 576) is expected


def test_auto_measures_once_per_hidden_size(monkeypatch):
    calls = []
    monkeypatch.setattr(model_runner, "_cpu_dtype_choice", {})
    monkeypatch.setattr(model_runner, "_linear_seconds",
                        lambda hidden, dtype: calls.append((hidden, dtype)) or (1.0 if dtype is torch.float32 else 2.0))
    assert fastest_cpu_dtype(64) is torch.float32
    assert fastest_cpu_dtype(64) is torch.float32
    assert len(calls) == 2  # fp32 and bf16, measured once
