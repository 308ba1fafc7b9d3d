"""The only part of the engine that touches the device: weights, KV pool, forward, sampling."""

from __future__ import annotations

import logging

import torch

from batchapi.engine.config import EngineConfig
from batchapi.engine.linears import make_invariant, pack_linears
from batchapi.engine.loader import ModelConfig, load_config, load_weights
from batchapi.engine.model import AttentionMetadata, CausalLM
from batchapi.engine.platform import keep_freed_memory, resolve_dtype
from batchapi.engine.sampler import Sampler, SampleRow
from batchapi.engine.scheduler import ScheduledBatch
from batchapi.engine.sequence import Sequence
from batchapi.kernels import get_ops

log = logging.getLogger(__name__)


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
        self.ops = get_ops(config.kernels, self.device, invariant=config.batch_invariant)
        self.matmul_plan: dict[str, int | str] = {}  # batch invariance: min rows of each linear layer
        self.model = self._load_model()
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks()
        self._allocate_kv_cache()
        self.sampler = Sampler(self.ops)

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
        if self.config.batch_invariant:
            self.matmul_plan = make_invariant(model, self.device, self.config.max_num_batched_tokens,
                                              self.config.max_num_seqs)
            log.info("batch invariant matmuls (layer: rows padded up to): %s", self.matmul_plan)
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
        return rows, self.sampler(logits, [SampleRow(seq.params, seq.output_token_ids, index, _matcher(seq, index))
                                           for seq, index in rows])


def _matcher(seq: Sequence, index: int):
    """The grammar matcher of a row: a fork's first row gets a copy of its parent's (both are at
    the grammar's start), as one matcher may fill only one row of a step's bitmask."""
    if seq.matcher is None or index == seq.sample_index:
        return seq.matcher
    return seq.matcher.fork()


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
