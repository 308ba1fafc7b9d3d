"""The only part of the engine that touches the device: weights, KV pool, forward, sampling."""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import torch

from batchapi.engine.config import EngineConfig
from batchapi.engine.loader import ModelConfig, load_config, load_weights
from batchapi.engine.model import AttentionMetadata, CausalLM
from batchapi.engine.packed_linear import PackedLinear, can_pack, pack_linears
from batchapi.engine.sampler import Sampler, SampleRow
from batchapi.engine.scheduler import ScheduledBatch
from batchapi.engine.sequence import Sequence
from batchapi.kernels import get_ops

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def keep_freed_memory() -> None:
    """Stop glibc handing each step's large activations back to the OS and faulting them in again.

    By default a buffer over ~128 KiB is mmap-ed and unmapped on free, so every step page-faults
    its activations and gathered KV afresh; on a VM that doubled the decode step. Process-wide."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    libc.mallopt(m_trim_threshold, 1 << 30)


def resolve_dtype(name: str, device: torch.device, hidden_size: int = 1024) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return fastest_cpu_dtype(hidden_size)


_cpu_dtype_choice: dict[int, torch.dtype] = {}
_cpu_dtype_lock = threading.Lock()  # engines starting at once must not time each other's matmuls


def fastest_cpu_dtype(hidden_size: int) -> torch.dtype:
    """bfloat16 where this CPU's bf16 matmuls beat fp32 ones, else float32 (both are exact enough).

    Where oneDNN has no bf16 kernels for the CPU (AVX2 only) a bf16 matmul falls back to loops
    about 6x slower than fp32: float32, without measuring. Where it has them (AVX512-BF16, AMX)
    a packed bf16 matmul usually runs 2-3x fp32, but that is measured, not assumed."""
    with _cpu_dtype_lock:
        if hidden_size not in _cpu_dtype_choice:
            _cpu_dtype_choice[hidden_size] = _choose_cpu_dtype(hidden_size)
        return _cpu_dtype_choice[hidden_size]


def _choose_cpu_dtype(hidden_size: int) -> torch.dtype:
    if not _has_bf16_matmul_kernels():
        log.info("dtype auto on CPU: float32 (oneDNN has no bf16 matmul kernels for this CPU)")
        return torch.float32
    times = _race(hidden_size, (torch.float32, torch.bfloat16))
    choice = min(times, key=times.get)
    log.info("dtype auto on CPU: %s (linear [64, %d] x [%d, %d], best of 5: %s)", choice, hidden_size,
             hidden_size, 4 * hidden_size, ", ".join(f"{d}: {t * 1e3:.2f} ms" for d, t in times.items()))
    return choice


def _has_bf16_matmul_kernels() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_is_mkldnn_bf16_supported")
            and ops._is_mkldnn_bf16_supported())


def _race(hidden_size: int, dtypes: tuple[torch.dtype, ...], rows: int = 64, rounds: int = 5) -> dict:
    """Best time of the matmul a decode step is made of, run the way the engine would run it, per
    dtype; the dtypes take turns so that a burst of other load hits them alike."""
    runs = {}
    for dtype in dtypes:
        linear = torch.nn.Linear(hidden_size, 4 * hidden_size, bias=False).to(dtype).requires_grad_(False)
        if can_pack(linear):
            linear = PackedLinear.from_linear(linear, batch_hint=rows)
        runs[dtype] = (linear, torch.randn(rows, hidden_size, dtype=dtype))
    best = dict.fromkeys(dtypes, float("inf"))
    with torch.inference_mode():
        for linear, x in runs.values():
            linear(x)  # first call: oneDNN picks and caches its kernel
        for _ in range(rounds):
            for dtype, (linear, x) in runs.items():
                start = time.perf_counter()
                linear(x)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
        self.model_config: ModelConfig = load_config(config.model_path)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.hidden_size)
        self.ops = get_ops(config.kernels, self.device)
        self.model = self._load_model()
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks()
        self._allocate_kv_cache()
        self.sampler = Sampler()

    # ---- set-up ----

    def _load_model(self) -> CausalLM:
        cfg = self.model_config
        with torch.device("meta"):
            model = CausalLM(cfg, self.ops)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.load(load_weights(self.config.model_path))
        max_pos = self.config.max_model_len or cfg.max_position_embeddings
        model.cos_sin = self.ops.build_rope_cache(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling,
                                                  self.device, self.dtype)  # [max_pos, D]
        model = model.eval().requires_grad_(False)
        if self.device.type == "cpu":
            packed = pack_linears(model, batch_hint=self.config.max_num_seqs)
            log.info("packed %d linear layers for oneDNN", packed)
        return model

    def _kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _num_blocks(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            cfg = self.model_config
            # activations of the largest step: hidden states, the MLP's gate/up and fp32 logits
            reserve = self.config.max_num_batched_tokens * (6 * cfg.hidden_size + 4 * cfg.intermediate_size) * 4
            reserve += self.config.max_num_seqs * cfg.vocab_size * 4 * 4
            budget = int(total * self.config.gpu_memory_utilization) - (total - free) - reserve
        else:
            budget = self.config.kv_cache_bytes
        num_blocks = budget // self._kv_bytes_per_block()
        assert num_blocks > 0, f"the KV budget ({budget} bytes) holds no {self.block_size}-token block"
        return int(num_blocks)

    def _allocate_kv_cache(self) -> None:
        cfg = self.model_config
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        for layer in self.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        log.info("KV pool: %d blocks of %d tokens (%.0f MiB)", self.num_blocks, self.block_size,
                 self.num_blocks * self._kv_bytes_per_block() / 2**20)

    # ---- one step ----

    def _prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        input_ids, positions, slots, cu_seqlens, context_lens, logit_rows = [], [], [], [0], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu_seqlens.append(cu_seqlens[-1] + n)
            context_lens.append(end)
            if end == seq.num_tokens:  # caught up: the last token's logits pick the next token
                logit_rows.append(cu_seqlens[-1] - 1)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [-1] * (width - len(s.block_table)) for s in batch.seqs]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        waves: dict[int, tuple[list[int], list[int]]] = {}
        for copy in batch.kv_copies:
            src, dst = waves.setdefault(copy.wave, ([], []))
            src.extend(range(copy.src * bs, copy.src * bs + copy.num_tokens))
            dst.extend(range(copy.dst * bs, copy.dst * bs + copy.num_tokens))
        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(tables, torch.int32),
            cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            max_seqlen_q=max(batch.num_new_tokens),
            max_context_len=max(context_lens),
            kv_copies=[(tensor(src, torch.int64), tensor(dst, torch.int64)) for _, (src, dst) in sorted(waves.items())],
        )
        return tensor(input_ids, torch.int64), tensor(positions, torch.int64), meta, tensor(logit_rows, torch.int64)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[tuple[Sequence, int]], list]:
        """Run one step; return ``sample_rows(batch)`` and a sample for each of those rows."""
        input_ids, positions, meta, logit_rows = self._prepare(batch)
        logits = self.model(input_ids, positions, meta, logit_rows)  # [S, V]
        rows = sample_rows(batch)
        if len(rows) != logits.shape[0]:  # n > 1: a finished prompt is sampled once per child
            repeat = torch.tensor([1 + seq.num_forks for seq, _ in _sampled(batch)], device=logits.device)
            logits = logits.repeat_interleave(repeat, dim=0)
        return rows, self.sampler(logits, [SampleRow(seq.params, seq.output_token_ids, index) for seq, index in rows])


def _sampled(batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
    return [(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if seq.num_computed_tokens + n == seq.num_tokens]


def sample_rows(batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
    """(seq, sample index) of every token this step samples; forks get their own rows."""
    rows = []
    for seq, _ in _sampled(batch):
        rows.append((seq, seq.sample_index))
        rows.extend((seq, seq.sample_index + 1 + i) for i in range(seq.num_forks))
    return rows
