"""dtype auto: bf16 on CPU only where the CPU multiplies bf16 natively (AVX512-BF16 or AMX),
decided by the instruction sets, never by timing (a race flipped with the machine's load)."""

import pytest
import torch

from batchapi.engine import platform
from batchapi.engine.config import DTYPES
from batchapi.engine.model import onednn
from batchapi.engine.platform import fastest_cpu_dtype, resolve_dtype


def test_named_dtypes_are_taken_as_given():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("float16", cpu) is torch.float16
    assert set(platform.TORCH_DTYPES) == set(DTYPES) - {"auto"}  # every name the config takes has its dtype


@pytest.mark.parametrize(("native_kernels", "avx512_bf16", "amx", "expected"), [
    (False, True, True, torch.float32), (True, False, False, torch.float32),
    (True, True, False, torch.bfloat16), (True, False, True, torch.bfloat16),
])
def test_auto_follows_the_instruction_sets(monkeypatch, native_kernels, avx512_bf16, amx, expected):
    monkeypatch.setattr(onednn, "bf16_native", lambda: native_kernels)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_dtype("auto", torch.device("cpu"), 576) is expected


def test_this_machine_always_gets_the_same_answer():
    choices = {fastest_cpu_dtype(576) for _ in range(5)}
    assert len(choices) == 1
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert choices == {torch.bfloat16 if native and onednn.bf16_native() else torch.float32}
