"""EngineConfig: every knob of the engine, validated once and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")  # engine.platform maps them to torch dtypes
KERNELS = ("auto", "triton", "cpu", "torch")  # batchapi.kernels.MODES (a test checks they agree)
PREFAULTS = ("idle", "start", "off")  # EngineConfig.kv_pool_prefault


@dataclass
class EngineConfig:
    model_path: str | Path
    device: str = "cpu"  # auto: cuda where torch sees a GPU, else cpu (LLMEngine resolves it)
    dtype: str = "auto"  # auto: CUDA bfloat16 (else float16); CPU the faster of bfloat16 and float32, measured
    kernels: str = "auto"  # auto: triton on CUDA, cpu (C decode attention + twins) elsewhere
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    kv_cache_bytes: int = 1 << 30  # CPU pool size; CUDA sizes from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_threads: int | None = None  # CPU intra-op threads; None leaves torch's default
    # a request's tokens do not depend on the batch it runs in (engine/model/linears.py, README)
    batch_invariant: bool = True
    # CPU, bf16 linear weights in the C kernels (engine/model/linears.py): in float32, weights exact in
    # bf16 (a bf16 checkpoint's) stay bf16, half the bytes a decode step reads, widened as they multiply;
    # in bf16, by AMX tiles (TDPBF16PS) or on AVX512-BF16 without AMX by VDPBF16PS; false: oneDNN's packed layers
    bf16_weights: bool = True
    # a step's detokenizing and stop-string search run while the next step computes (None: on CUDA,
    # where the forward runs on the device; on CPU the forward holds the cores and nothing overlaps)
    overlap_text: bool | None = None
    # CUDA: decode steps replayed from CUDA graphs captured at bucketed batch sizes (model_runner.DecodeGraphs)
    cuda_graphs: bool = True
    # CPU: when the KV pool's pages are faulted in (engine/platform.py, PoolWarmer). "idle": by a thread
    # the OS runs only on an otherwise idle CPU, once the first step has ended (or 5 s after start), in
    # the order blocks are handed out;
    # "start": all before the engine is ready (as vLLM zeroes its pool); "off": by the steps that first
    # write each block (on a VM a fresh page can cost 10-30 us: a tenth or more of a cold run)
    kv_pool_prefault: str = "idle"

    def __post_init__(self):
        self.model_path = Path(self.model_path).expanduser()
        assert self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"
        assert self.kernels in KERNELS, f"kernels must be one of {KERNELS}, got {self.kernels!r}"
        assert self.device in ("auto", "cpu") or self.device.startswith("cuda"), f"unsupported device {self.device!r}"
        assert self.max_num_seqs >= 1, "max_num_seqs must be at least 1"
        assert self.max_num_batched_tokens >= self.max_num_seqs, (
            "max_num_batched_tokens must be at least max_num_seqs (one decode token per sequence)"
        )
        assert self.kv_cache_bytes > 0, "kv_cache_bytes must be positive"
        assert self.kv_pool_prefault in PREFAULTS, f"kv_pool_prefault must be one of {PREFAULTS}"
        assert 0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"
        assert self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, (
            "block_size must be a power of two"
        )
        assert self.max_model_len is None or self.max_model_len > 0, "max_model_len must be positive"
