"""The only part of the engine that touches the device: weights, KV pool, forward, sampling."""

from __future__ import annotations

import logging
from itertools import chain

import numpy as np
import torch
from torch import nn

from batchapi.engine.config import EngineConfig
from batchapi.engine.model.layers import AttentionMetadata
from batchapi.engine.model.linears import make_invariant, pack_linears
from batchapi.engine.model.llama import CausalLM
from batchapi.engine.model.loader import ModelConfig, UnsupportedModelError, load_config, load_weights
from batchapi.engine.model.moe import SparseMoE
from batchapi.engine.platform import PoolWarmer, keep_freed_memory, resolve_dtype
from batchapi.engine.prompt_scores import PromptScorer, ScoreCache
from batchapi.engine.sampler import OutputTokens, Sampler, SampleRow
from batchapi.engine.scheduler import ScheduledBatch
from batchapi.engine.sequence import Sequence
from batchapi.kernels import get_ops
from batchapi.kernels.cpu import memory
from batchapi.kernels.torch.rope import rope_type

log = logging.getLogger(__name__)


def check_context(cfg: ModelConfig, max_pos: int) -> None:
    """Refuse a context the model's rope cannot serve exactly as transformers does."""
    scalings = [cfg.rope_scaling, cfg.local_rope.scaling if cfg.local_rope else None]
    if any(rope_type(s) == "dynamic" for s in scalings) and max_pos > cfg.max_position_embeddings:
        raise UnsupportedModelError(
            f"max_model_len {max_pos} passes the model's {cfg.max_position_embeddings} positions: dynamic rope "
            "scales there by the batch's longest sequence, which batch-invariant results cannot follow")


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
        self.linear_kinds: dict[str, int] = {}  # CPU: how many linear layers run bf16-stored, oneDNN-packed
        self.model = self._load_model()
        self.block_size = config.block_size
        self.max_context_len = config.max_model_len or self.model_config.context_limit
        self.num_blocks = self._num_blocks()
        self._allocate_kv_cache()
        self.pool_warmer = self._prefault(config.kv_pool_prefault)
        self._steps_before_warming = 2 if config.kv_pool_prefault == "idle" and self.pool_warmer else 0
        self.sampler = Sampler(self.ops)
        # prompt logprobs: scored at most max_num_seqs rows at a time, the rows lm_head is invariant for
        self.scores = ScoreCache(capacity=self.num_blocks)
        self.scorer = PromptScorer(self.model, self.scores, self.block_size, config.max_num_seqs, self.device)
        self.inputs = StepInputs(config.max_num_batched_tokens, config.max_num_seqs, self.block_size, self.device)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and config.cuda_graphs:
            self.graphs = DecodeGraphs(self.model, config.max_num_seqs, self.max_context_len, self.block_size,
                                       self.device, capture=True)

    # ---- set-up ----

    def _load_model(self) -> CausalLM:
        cfg = self.model_config
        max_pos = self.config.max_model_len or cfg.context_limit
        check_context(cfg, max_pos)  # before any weight is read
        with torch.device("meta"):
            model = CausalLM(cfg, self.ops)
        model = materialize(model.to(self.dtype), self.device)
        model.load(load_weights(self.config.model_path))
        model.cos_sin = self.ops.build_rope_cache(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling,
                                                  self.device, self.dtype, cfg.max_position_embeddings)  # [max_pos, D]
        model.cos_sin_local = model.cos_sin
        if cfg.local_rope is not None:  # Gemma 3's local layers: a base of their own
            model.cos_sin_local = self.ops.build_rope_cache(cfg.head_dim, max_pos, cfg.local_rope.theta,
                                                            cfg.local_rope.scaling, self.device, self.dtype,
                                                            cfg.max_position_embeddings)
        model = model.eval().requires_grad_(False)
        if self.ops.name == "triton":  # one grouped GEMM per projection of a MoE layer
            for module in model.modules():
                if isinstance(module, SparseMoE):
                    module.fuse()
        if self.device.type == "cpu":
            self.linear_kinds = pack_linears(model, batch_hint=self.config.max_num_seqs,
                                             bf16_weights=self.config.bf16_weights)
            log.info("linear layers on CPU: %s", self.linear_kinds)
        if self.config.batch_invariant:
            self.matmul_plan = make_invariant(model, self.device, self.config.max_num_batched_tokens,
                                              self.config.max_num_seqs)
            log.info("batch invariant matmuls (layer: rows a call is padded to, blocks or pieces): %s",
                     self.matmul_plan)
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
            layer.self_attn.k_cache = zeroed(shape, self.dtype, self.device)
            layer.self_attn.v_cache = zeroed(shape, self.dtype, self.device)
        log.info("KV pool: %d blocks of %d tokens (%.0f MiB)", self.num_blocks, self.block_size,
                 self.num_blocks * self._kv_bytes_per_block() / 2**20)

    def _prefault(self, when: str) -> PoolWarmer | None:
        """A CPU pool's pages faulted in ahead of the steps (config.kv_pool_prefault): now, or on an
        idle-class thread once the first step has ended; None on CUDA (its memory is the device's,
        mapped at once)."""
        if self.device.type != "cpu" or when == "off":
            return None
        caches = [c for layer in self.model.layers for c in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
        warmer = PoolWarmer(caches, self.num_blocks)
        if when == "start":
            warmer.run()
            return warmer
        return warmer.start()

    def close(self) -> None:
        """Stop the pool's warmer, if it runs (the pool itself goes with the model)."""
        if self.pool_warmer is not None:
            self.pool_warmer.stop()

    # ---- one step ----

    def _prepare(self, batch: ScheduledBatch):
        """The step's inputs: (input_ids, positions, metadata, logit_rows) on the device."""
        return self.inputs.build(batch)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[tuple[Sequence, int]], list]:
        """Run one step; return ``sample_rows(batch)`` and a sample for each of those rows."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Start one step: on CUDA the forward and the choice of tokens are queued on the device
        and this returns at once; ``result()`` waits for the tokens. On CPU it is done on return."""
        if self._steps_before_warming:  # the pool's warmer goes once the first step has ended
            self._steps_before_warming -= 1
            if not self._steps_before_warming:
                self.pool_warmer.go()
        input_ids, positions, meta, logit_rows = self._prepare(batch)
        scored = self.scorer.plan(batch.seqs, batch.num_new_tokens, self.inputs.cu_seqlens)
        rows = sample_rows(batch)
        sample_rows_ = [SampleRow(seq.params, OutputTokens(seq.token_ids, seq.num_prompt_tokens), index,
                                  _matcher(seq, index), _forced(seq, index)) for seq, index in rows]
        if (scored is None and self.graphs is None and len(rows) == len(logit_rows) and self.model.greedy_in_lm_head
                and Sampler.argmax_only(sample_rows_)):  # greedy tokens from the lm_head itself: no logits written
            token_ids = self.model.greedy(input_ids, positions, meta, logit_rows)
            return LaunchedStep(self.sampler, rows, None, sample_rows_, Sampler.with_forced(token_ids, sample_rows_))
        if scored is not None:  # prompt logprobs: the forward keeps those positions' hidden states too
            logits, hidden = self.model(input_ids, positions, meta, logit_rows, scored[0])
            self.scorer.finish(hidden, scored[1])
        elif self.graphs is not None and self.graphs.takes(input_ids, meta, logit_rows):
            logits = self.graphs.run(input_ids, positions, meta)  # [S, V]
        else:
            logits = self.model(input_ids, positions, meta, logit_rows)  # [S, V]
        if len(rows) != logits.shape[0]:  # n > 1: a finished prompt is sampled once per child
            repeat = torch.tensor([1 + seq.num_forks for seq, _ in _sampled(batch)], device=logits.device)
            logits = logits.repeat_interleave(repeat, dim=0, output_size=len(rows))  # the size given: no read-back
        return LaunchedStep(self.sampler, rows, logits, sample_rows_, self.sampler.choose(logits, sample_rows_))


class LaunchedStep:
    """A step whose tokens are chosen on the device, maybe not yet read back."""

    def __init__(self, sampler: Sampler, rows, logits, sample_rows_, token_ids):
        self.sampler, self.rows, self.logits, self.sample_rows, self.token_ids = (
            sampler, rows, logits, sample_rows_, token_ids)

    def result(self) -> tuple[list[tuple[Sequence, int]], list]:
        """(``sample_rows(batch)``, a sample for each row): waits for the device."""
        with torch.inference_mode():
            return self.rows, self.sampler.outputs(self.logits, self.sample_rows, self.token_ids)


def _matcher(seq: Sequence, index: int):
    """The grammar matcher of a row: a fork's first row gets a copy of its parent's (both are at
    the grammar's start), as one matcher may fill only one row of a step's bitmask."""
    matcher = seq.active_matcher
    if matcher is None or index == seq.sample_index:
        return matcher
    return matcher.fork()


def _forced(seq: Sequence, index: int) -> int | None:
    """The token a row must take: a thinking marker (a fork's first row starts as its parent did)."""
    if seq.thinking is None:
        return None
    if index == seq.sample_index:
        return seq.forced_token
    return None if seq.params.thinking.opened else seq.params.thinking.start[0]


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


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to_empty(device=device)`` for a model built on the meta device, without its cost:
    ``to_empty`` goes through ``empty_like`` on meta tensors, whose Python reference imports
    sympy and torch.fx's symbolic shapes (about a second of a worker's start). A parameter shared
    by two modules stays shared; the loader fills every one."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=device)
        return made[id(t)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = nn.Parameter(empty(param), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = empty(buffer)
    return model


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU its memory is fresh pages of the OS (kernels/cpu/memory.py), zero
    until first written: a pool of gigabytes costs nothing at start, and only the blocks a run touches
    are ever faulted in (``torch.zeros`` writes every byte first: half a second a 2 GiB pool). The
    pages are huge ones where the OS gives them, so that a step's walk over blocks anywhere in the
    pool does not miss the TLB at nearly every block; and it starts on a page (calloc's pointer, used
    before, lay 16 bytes past one, which put every KV row across one more cache line than it fills,
    and every 64-byte load of the attention kernel across two: 7-9% of its time,
    bench/kernels_cpu.py's shapes)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return memory.zeroed(shape, dtype)


class StepInputs:
    """The step's input tensors, built with a few numpy ops into buffers kept across steps.

    Each sequence keeps a row of a persistent block-table array, written only where its table
    grew (a table the block manager replaced, after a preemption or a fork, is written afresh), so
    a step copies no Python list of block ids. Token ids are the one per-sequence read (a slice of
    its token list); positions, slots, the cumulative lengths and the sampled rows are whole-array
    ops. On CUDA the host buffers are pinned and copied to the device without blocking.

    The tensors returned are new objects every step (views of the buffers): the attention kernels
    plan once a step by the identity of the metadata tensors."""

    def __init__(self, max_tokens: int, max_seqs: int, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, device
        pin = device.type == "cuda"

        def host(n: int, dtype) -> np.ndarray:
            return torch.zeros(n, dtype=dtype, pin_memory=pin).numpy()

        self.input_ids, self.positions, self.slots = (host(max_tokens, torch.int64) for _ in range(3))
        self.cu_seqlens, self.context_lens = host(max_seqs + 1, torch.int32), host(max_seqs, torch.int32)
        self.arange = np.arange(max_tokens, dtype=np.int64)
        self.tables = np.full((2 * max_seqs + 8, 16), -1, dtype=np.int32)  # rows grow on demand
        self.rows: dict[int, list] = {}  # seq_id -> [row, the block_table list written, entries written]
        self.free_rows = list(range(self.tables.shape[0] - 1, -1, -1))

    def build(self, batch: ScheduledBatch):
        seqs, bs = batch.seqs, self.block_size
        num_seqs = len(seqs)
        n = np.array(batch.num_new_tokens, dtype=np.int64)
        start = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=num_seqs)
        end = start + n
        total = int(n.sum())
        cu = self.cu_seqlens[: num_seqs + 1]
        cu[0] = 0
        np.cumsum(n, out=cu[1:])
        self.context_lens[:num_seqs] = end
        rows = self._table_rows(seqs)
        ids, positions, slots = self.input_ids[:total], self.positions[:total], self.slots[:total]
        if total == num_seqs:  # decode only: one token a sequence, at its computed count
            ids[:] = [s.token_ids[p] for s, p in zip(seqs, start.tolist(), strict=True)]
            positions[:] = start
            token_rows = rows
        else:
            ids[:] = np.fromiter(chain.from_iterable(s.token_ids[a:b] for s, a, b in
                                                     zip(seqs, start.tolist(), end.tolist(), strict=True)),
                                 dtype=np.int64, count=total)
            owner = np.repeat(self.arange[:num_seqs], n)  # the sequence of each token
            np.add(self.arange[:total] - cu[:-1][owner], start[owner], out=positions)
            token_rows = rows[owner]
        np.add(self.tables[token_rows, positions // bs] * bs, positions % bs, out=slots)
        width = int((end.max() + bs - 1) // bs)
        tables = self.tables[rows, :width]  # a fresh contiguous [B, width] array
        num_tokens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=num_seqs)
        logit_rows = cu[1:][end == num_tokens].astype(np.int64) - 1  # caught up: these tokens pick the next one
        waves: dict[int, tuple[list[int], list[int]]] = {}
        for copy in batch.kv_copies:
            src, dst = waves.setdefault(copy.wave, ([], []))
            src.extend(range(copy.src * bs, copy.src * bs + copy.num_tokens))
            dst.extend(range(copy.dst * bs, copy.dst * bs + copy.num_tokens))
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            block_tables=self._to_device(tables),
            cu_seqlens_q=self._to_device(cu),
            context_lens=self._to_device(self.context_lens[:num_seqs]),
            max_seqlen_q=int(n.max()),
            max_context_len=int(end.max()),
            kv_copies=[(self._to_device(np.array(src, dtype=np.int64)), self._to_device(np.array(dst, dtype=np.int64)))
                       for _, (src, dst) in sorted(waves.items())],
        )
        return self._to_device(ids), self._to_device(positions), meta, self._to_device(logit_rows)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _table_rows(self, seqs: list[Sequence]) -> np.ndarray:
        """The persistent block-table row of each sequence, brought up to date -> [B] int64."""
        out = np.empty(len(seqs), dtype=np.int64)
        for i, seq in enumerate(seqs):
            table, entry = seq.block_table, self.rows.get(seq.seq_id)
            if entry is None or entry[1] is not table:  # new, or a table the block manager replaced
                row = entry[0] if entry is not None else self._free_row(seqs)
                if entry is not None:
                    self.tables[row, : entry[2]] = -1
                entry = self.rows[seq.seq_id] = [row, table, 0]
            if len(table) > entry[2]:
                if len(table) > self.tables.shape[1]:
                    self._widen(len(table))
                self.tables[entry[0], entry[2] : len(table)] = table[entry[2] :]
                entry[2] = len(table)
            out[i] = entry[0]
        return out

    def _free_row(self, seqs: list[Sequence]) -> int:
        if not self.free_rows:  # forget the rows of sequences not in this step (finished, preempted)
            live = {s.seq_id for s in seqs}
            for seq_id in [k for k in self.rows if k not in live]:
                row, _, used = self.rows.pop(seq_id)
                self.tables[row, :used] = -1
                self.free_rows.append(row)
        if not self.free_rows:
            grown = np.full((self.tables.shape[0], self.tables.shape[1]), -1, dtype=np.int32)
            self.free_rows = list(range(2 * self.tables.shape[0] - 1, self.tables.shape[0] - 1, -1))
            self.tables = np.concatenate([self.tables, grown])
        return self.free_rows.pop()

    def _widen(self, width: int) -> None:
        wider = np.full((self.tables.shape[0], max(width, 2 * self.tables.shape[1])), -1, dtype=np.int32)
        wider[:, : self.tables.shape[1]] = self.tables
        self.tables = wider


def graph_buckets(max_seqs: int) -> list[int]:
    """Batch sizes with a decode graph, as vLLM picks them: 1, 2, 4, then every 8 to 256, every 16
    beyond, and max_seqs itself; a step pads up to the next one (under 8 rows, 16 past 256)."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_seqs + 1, 16)]
    return sorted({b for b in sizes if b < max_seqs} | {max_seqs})


class DecodeGraphs:
    """Decode steps run from CUDA graphs, one graph per bucket of batch sizes.

    A decode-only step (one token a sequence, no KV copies) of B sequences runs as the graph of
    the smallest bucket of at least B rows: its inputs are copied into the graphs' static buffers,
    and rows B.. of the bucket are padding (slot -1: nothing stored; a context of one token in
    block 0), whose logits are dropped. Padding changes no real row: attention, norms and
    activations are per row, and with batch invariance (the default) so are the matmuls (without
    it a padded step may differ from an eager one in the last bits, as any two batch sizes may).
    A graph is captured the first time its bucket is used, after two warm-up runs that compile
    the Triton kernels; the graphs share one memory pool (they never run at once) and write one
    logits buffer (a graph's own output would hold [bucket, V] for each of ~40 buckets). The
    attention's tiling is fixed at the model's longest context, so a graph serves any context.

    capture=False runs the same padded step eagerly: the CPU tests check the padding with it."""

    def __init__(self, model, max_seqs: int, max_context_len: int, block_size: int, device: torch.device,
                 capture: bool):
        self.model, self.capture, self.max_context_len = model, capture, max_context_len
        self.buckets = graph_buckets(max_seqs)
        width = -(-max_context_len // block_size) + 1

        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids, self.positions = zeros(max_seqs, dtype=torch.int64), zeros(max_seqs, dtype=torch.int64)
        self.slots = torch.full((max_seqs,), -1, dtype=torch.int64, device=device)
        self.tables = zeros(max_seqs, width, dtype=torch.int32)
        self.cu_seqlens = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)  # one token a sequence
        self.context_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.logit_rows = torch.arange(max_seqs, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}  # bucket -> (CUDAGraph, its rows of logits)
        self.logits: torch.Tensor | None = None  # [max_seqs, V], written by every graph
        self.pool = None
        self.replays = 0  # steps run from a graph (or padded, capture=False)

    def takes(self, input_ids: torch.Tensor, meta: AttentionMetadata, logit_rows: torch.Tensor) -> bool:
        """Whether this step is a decode step a bucket holds."""
        num = input_ids.shape[0]
        return (meta.max_seqlen_q == 1 and not meta.kv_copies and logit_rows.shape[0] == num
                and num <= self.buckets[-1] and meta.block_tables.shape[1] <= self.tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The logits [B, V] of the step's B sequences."""
        num = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= num)
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(positions)
        self.slots[:num].copy_(meta.slot_mapping)
        self.tables[:num, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.context_lens[:num].copy_(meta.context_lens)
        if bucket > num:  # padding rows: store nothing, attend to one slot of block 0
            self.input_ids[num:bucket] = 0
            self.positions[num:bucket] = 0
            self.slots[num:bucket] = -1
            self.tables[num:bucket, 0] = 0
            self.context_lens[num:bucket] = 1
        self.replays += 1
        if not self.capture:
            return self._forward(bucket)[:num]
        entry = self.graphs.get(bucket)
        if entry is None:
            entry = self.graphs[bucket] = self._capture(bucket)
        entry[0].replay()
        return entry[1][:num]

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slots[:bucket], block_tables=self.tables[:bucket],
                                 cu_seqlens_q=self.cu_seqlens[: bucket + 1], context_lens=self.context_lens[:bucket],
                                 max_seqlen_q=1, max_context_len=self.max_context_len)
        return self.model(self.input_ids[:bucket], self.positions[:bucket], meta, self.logit_rows[:bucket])

    def _capture(self, bucket: int):
        stream = torch.cuda.Stream(self.input_ids.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up runs: Triton compiles, allocator settles
            for _ in range(2):
                logits = self._forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        if self.logits is None:  # one output buffer for every graph: a graph keeps no logits of its own
            self.logits = torch.empty(len(self.logit_rows), logits.shape[1], dtype=logits.dtype, device=logits.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[:bucket].copy_(self._forward(bucket))
        self.pool = graph.pool()
        log.info("captured the decode graph of %d rows", bucket)
        return graph, self.logits[:bucket]
