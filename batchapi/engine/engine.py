"""LLMEngine: requests in, finished results out; each step is schedule -> execute -> update."""

from __future__ import annotations

import functools
import hashlib
import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from batchapi.engine.block_manager import BlockManager
from batchapi.engine.config import EngineConfig
from batchapi.engine.detokenizer import IncrementalDetokenizer, StopChecker, check_finish, load_tokenizer
from batchapi.engine.model_runner import ModelRunner
from batchapi.engine.platform import resolve_device
from batchapi.engine.request import (
    CompletionOutput,
    DuplicateRequestId,
    ErrorCode,
    GenerationRequest,
    GenerationResult,
    TokenLogprob,
)
from batchapi.engine.scheduler import Scheduler
from batchapi.engine.sequence import Sequence, SequenceStatus
from batchapi.engine.thinking import ThinkingState

log = logging.getLogger(__name__)

# pack_linears' kinds of C-kernel layer, as system_fingerprint's kernels string names them: their
# sums run in an order of their own
C_KERNEL_TAGS = (("bf16-stored", "bf16-weights"), ("avx512-bf16", "avx512-bf16"), ("amx-bf16", "amx-bf16"))

# with nothing to run but grammars compiling, a step waits up to this long for one to finish
GRAMMAR_WAIT_SECONDS = 0.01


@dataclass
class _Stream:
    """Text state of one sequence: incremental detokenizer and stop-string search."""

    detok: IncrementalDetokenizer
    stops: StopChecker | None
    block_end: int = 0  # the text of a thinking block ends here in detok.text; stop strings search after it


@dataclass
class _RequestState:
    request: GenerationRequest
    seqs: list[Sequence] = field(default_factory=list)
    streams: dict[int, _Stream] = field(default_factory=dict)  # by seq_id
    grammar: Any = None  # grammar.CompiledGrammar of a constrained request: each sequence gets a matcher


def system_fingerprint(config: EngineConfig, dtype: str, kernels: str) -> str:
    """``fp_`` and 12 hex digits naming what decides a result: the model's files (names, sizes,
    config and tokenizer), the dtype, the kernels and batch invariance, the device kind (the CPU's
    instruction sets, or the GPU's name), torch's version, the engine's limits and batchapi's
    version. With batch invariance on, two runs of a request with the same fingerprint give the
    same tokens (greedy, or seeded); see docs/USAGE.md, "Reproducible results". The engine's and the
    kernels' own source is hashed in too (``code_digest``), so a model family's new code path, a
    kernel's new reduction order, or any other change of the code that computes a token names itself,
    also between two builds of one release."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    model_dir = Path(config.model_path)
    for path in sorted(model_dir.iterdir()) if model_dir.is_dir() else [model_dir]:
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
        if path.name in ("config.json", "generation_config.json", "tokenizer_config.json"):
            digest.update(path.read_bytes())
    try:
        release = version("batchapi")
    except PackageNotFoundError:
        release = "dev"
    digest.update(f"{dtype}|{config.device}|{device_kind(config.device)}|{kernels}|"
                  f"invariant={config.batch_invariant}|{config.block_size}|{config.max_model_len}|"
                  f"torch {torch.__version__}|{release}|{code_digest()}".encode())
    return "fp_" + digest.hexdigest()[:12]


@functools.cache
def code_digest() -> str:
    """A hash of the source of the engine and its kernels (Python and C), read once a process."""
    root = Path(__file__).resolve().parents[1]  # batchapi/
    digest = hashlib.sha256()
    for path in code_files():
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def code_files() -> list[Path]:
    root = Path(__file__).resolve().parents[1]
    return sorted(p for folder in ("engine", "kernels") for p in (root / folder).rglob("*")
                  if p.suffix in (".py", ".c", ".h"))


def device_kind(device: str) -> str:
    """What kind of device computes the results: the matmul libraries pick kernels by it."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    cpu = torch.cpu
    flags = [name for name, probe in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx", "_is_amx_tile_supported"),
                                      ("amx_fp16", "_is_amx_fp16_supported"))
             if getattr(cpu, probe, lambda: False)()]
    return "+".join([torch.backends.cpu.get_cpu_capability(), *flags])


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None):
        config = replace(config, device=resolve_device(config.device))
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = tokenizer or load_tokenizer(config.model_path)
        mc = self.runner.model_config
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        pool_tokens = self.runner.num_blocks * config.block_size
        window = mc.kv_window  # every layer windowed: a sequence holds the blocks of its window only
        if window is not None and window + config.max_num_batched_tokens + 2 * config.block_size <= pool_tokens:
            pool_tokens = mc.context_limit
        self.max_model_len = min(config.max_model_len or mc.context_limit, pool_tokens)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          window=window)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.runner.scores)
        self.requests: dict[str, _RequestState] = {}
        kinds = self.runner.linear_kinds  # the linear layers in a C kernel sum in an order of their own
        kernels = self.runner.ops.name + "".join(f"+{tag}" for kind, tag in C_KERNEL_TAGS if kinds.get(kind))
        self.system_fingerprint = system_fingerprint(config, str(self.runner.dtype), kernels)
        self._grammars = None  # grammar.GrammarCompiler, made for the first constrained request
        self.overlap_text = config.device.startswith("cuda") if config.overlap_text is None else config.overlap_text
        # tokens appended whose text is still to work out, and whether each is in a thinking block
        self._text_queue: list[tuple[Sequence, int, bool]] = []
        self.compiling: list[tuple[Sequence, Future]] = []  # requests waiting for their grammar
        # requests of several prompts: their id -> the part ids (one per prompt) and the parts finished
        self._groups: dict[str, tuple[list[str], dict[str, GenerationResult], int]] = {}

    @property
    def grammars(self):
        """The grammar compiler (one per engine: a schema shared by many requests compiles once)."""
        if self._grammars is None:
            from batchapi.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.runner.model_config.vocab_size,
                                             eos_token_ids=self.eos_token_ids)
        return self._grammars

    # ---- requests ----

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; one the engine refuses finishes with an error at the next step.
        Raises DuplicateRequestId while a request with the same id is in the engine."""
        if request.request_id in self.requests or request.request_id in self._groups:
            raise DuplicateRequestId(f"request id {request.request_id!r} is already in the engine")
        if request.more_prompts:  # one part per prompt, merged into one result when all are done
            prompts = [request.prompt_token_ids, *request.more_prompts]
            ids = [f"{request.request_id}\x00{i}" for i in range(len(prompts))]
            self._groups[request.request_id] = (ids, {}, request.params.n)
            try:
                for part_id, prompt in zip(ids, prompts, strict=True):
                    self.add_request(GenerationRequest(part_id, prompt, request.params))
            except Exception:
                self.abort(request.request_id)
                self._groups.pop(request.request_id, None)
                raise
            return
        params = request.params
        seq = Sequence(request.request_id, list(request.prompt_token_ids), params, num_forks=params.n - 1)
        if params.thinking is not None:
            seq.thinking = ThinkingState(params.thinking)
        state = _RequestState(request, [seq])
        self.requests[request.request_id] = state
        try:
            params.check_vocab(self.runner.model_config.vocab_size)
            if params.n > self.config.max_num_seqs:
                raise ValueError(f"n is {params.n}; this engine runs at most {self.config.max_num_seqs} sequences "
                                 "at once (max_num_seqs)")
            bad = [t for t in request.prompt_token_ids if not 0 <= t < self.runner.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary")
        except ValueError as exc:
            seq.fail(ErrorCode.INVALID_REQUEST, str(exc))
            self.scheduler.rejected.append(seq)
            return
        self._open_stream(state, seq)
        if params.grammar is not None:  # compiled off the step thread; scheduled once ready
            self.compiling.append((seq, self.grammars.submit(params.grammar)))
            return
        self.scheduler.add(seq)

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar is ready; fail those whose grammar was refused."""
        if not self.compiling:
            return
        waiting = []
        for seq, future in self.compiling:
            state = self.requests.get(seq.request_id)
            if state is None or seq.is_finished:  # aborted while compiling
                continue
            if not future.done():
                waiting.append((seq, future))
                continue
            try:
                state.grammar = future.result()
            except Exception as exc:  # GrammarError: the schema is the request's problem
                seq.fail(ErrorCode.INVALID_GRAMMAR, str(exc))
                self.scheduler.rejected.append(seq)
                continue
            seq.matcher = state.grammar.matcher()
            self.scheduler.add(seq)
        self.compiling = waiting

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()
        self.runner.close()

    def abort(self, request_id: str) -> GenerationResult | None:
        if request_id in self._groups:
            for part_id in self._groups[request_id][0]:
                result = self.abort(part_id)
                if result is not None:
                    self._groups[request_id][1][part_id] = result
            return self._merge(request_id)
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in self.scheduler.abort(request_id):
            seq.fail(ErrorCode.ABORTED, "aborted")
        for seq in state.seqs:
            if not seq.is_finished:
                seq.fail(ErrorCode.ABORTED, "aborted")
        return self._result(state)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def request_ids(self) -> list[str]:
        """The ids of the requests in flight, as they were added (a request of several prompts once)."""
        parts = {part for ids, _, _ in self._groups.values() for part in ids}
        return [rid for rid in self.requests if rid not in parts] + list(self._groups)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.compiling)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def kv_usage(self) -> float:
        return self.block_manager.usage()

    # ---- one step ----

    def step(self) -> list[GenerationResult]:
        """Advance every scheduled sequence by one step; return the requests that finished.

        Token ids are checked as they come (stop tokens, EOS, max_tokens, the grammar); their text
        (detokenizing, stop strings) is worked out in ``_work_text``. With ``overlap_text`` (CUDA)
        that runs while the device computes the next step, so a sequence whose last token
        completed a stop string is in that step too: its extra token is dropped, and its result
        comes one step later. Outputs are the same either way."""
        self._admit_compiled()
        finished = self._take_rejected()
        batch = self.scheduler.schedule()
        if not len(batch) and not self._text_queue:
            if self.compiling and not finished:
                wait([future for _, future in self.compiling], GRAMMAR_WAIT_SECONDS, FIRST_COMPLETED)
            return self._grouped(finished)
        launched = self.runner.launch(batch) if len(batch) else None
        touched = self._work_text() if self.overlap_text else set()  # the last step's text, while this one runs
        if launched is not None:
            rows, samples = launched.result()
            self.scheduler.postprocess(batch)
            for (seq, index), sample in zip(rows, samples, strict=True):
                if index == seq.sample_index and seq.is_finished:
                    continue  # ended meanwhile by a stop string in its last token's text: not part of the output
                target = seq if index == seq.sample_index else self._fork(seq, index)
                self._append(target, sample)
            for seq, _ in rows:
                seq.num_forks = 0
                touched.add(seq.request_id)
        if not self.overlap_text:
            touched |= self._work_text()
        self.scheduler.release_finished()
        pending = {seq.request_id for seq, _, _ in self._text_queue}
        for request_id in touched - pending:
            state = self.requests.get(request_id)
            if state is not None and all(s.is_finished for s in state.seqs):
                finished.append(self._result(self.requests.pop(request_id)))
        return self._grouped(finished)

    def _grouped(self, finished: list[GenerationResult]) -> list[GenerationResult]:
        """Finished results, the parts of a request of several prompts merged once all are done."""
        if not self._groups:
            return finished
        out = []
        for result in finished:
            group_id, part, _ = result.request_id.partition("\x00")
            if not part or group_id not in self._groups:
                out.append(result)
                continue
            self._groups[group_id][1][result.request_id] = result
            merged = self._merge(group_id)
            if merged is not None:
                out.append(merged)
        return out

    def _merge(self, group_id: str) -> GenerationResult | None:
        ids, done, n = self._groups[group_id]
        if len(done) < len(ids):
            return None
        del self._groups[group_id]
        parts = [done[i] for i in ids]
        outputs = [replace(out, index=i * n + out.index) for i, part in enumerate(parts) for out in part.outputs]
        failed = next((p for p in parts if p.error is not None), None)
        return GenerationResult(group_id, sum(p.prompt_tokens for p in parts), sum(p.cached_tokens for p in parts),
                                outputs, failed.error if failed else None, failed.error_code if failed else None,
                                parts=parts)

    def _take_rejected(self) -> list[GenerationResult]:
        results = []
        for seq in self.scheduler.rejected:
            state = self.requests.pop(seq.request_id, None)
            if state is not None:
                results.append(self._result(state))
        self.scheduler.rejected.clear()
        return results

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        child = Sequence(parent.request_id, parent.token_ids[: parent.num_prompt_tokens], parent.params,
                         sample_index=index, num_cached_tokens=parent.num_cached_tokens)
        state = self.requests[parent.request_id]
        if state.grammar is not None:  # a fork starts where its parent did: at the grammar's start
            child.matcher = state.grammar.matcher()
        if parent.params.thinking is not None:
            child.thinking = ThinkingState(parent.params.thinking)
        state.seqs.append(child)
        self._open_stream(state, child)
        self.scheduler.fork(parent, child)
        return child

    def _open_stream(self, state: _RequestState, seq: Sequence) -> None:
        params = seq.params
        detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids[: seq.num_prompt_tokens])
        stops = StopChecker(params.stop) if params.stop else None
        state.streams[seq.seq_id] = _Stream(detok, stops)

    def _append(self, seq: Sequence, sample) -> None:
        """Add a sampled token to ``seq``; finish it if a stop condition of the ids holds. Its
        text goes to the queue that ``_work_text`` works through."""
        token = sample.token_id
        if seq.params.max_tokens == 0:  # a prompt scored (prompt logprobs), nothing generated
            seq.finish("length")
            return
        seq.token_ids.append(token)
        params = seq.params
        if params.logprobs:
            seq.logprobs = seq.logprobs or []
            seq.logprobs.append(TokenLogprob(token, sample.logprob, sample.top_logprobs))
        reason = check_finish(params, token, seq.num_output_tokens, self.eos_token_ids)
        if reason == "stop":  # a stop token: its text is not part of the output
            seq.finish("stop")
            return
        matcher = seq.active_matcher  # none while a thinking block is open: the grammar follows it
        in_block = seq.thinking is not None and not seq.thinking.ended
        if in_block:
            seq.thinking.accept(token, seq.token_ids)
        if matcher is not None and not matcher.accept(token):
            seq.fail(ErrorCode.ENGINE_FAILURE, f"the grammar refused token {token}, which its mask allowed")
            return
        self._text_queue.append((seq, token, in_block))
        if matcher is not None and matcher.is_terminated:  # the document is complete
            seq.finish("stop")
        elif reason == "length" or seq.num_tokens >= self.max_model_len:
            seq.finish("length")

    def _work_text(self) -> set[str]:
        """Detokenize the queued tokens and search them for stop strings; a stop string ends its
        sequence with "stop" (over a length or grammar end of the same token). Returns the
        request ids worked on."""
        queue, self._text_queue = self._text_queue, []
        touched = set()
        for seq, token, in_block in queue:
            state = self.requests.get(seq.request_id)
            if state is None or seq.error:  # aborted meanwhile
                continue
            touched.add(seq.request_id)
            stream = state.streams[seq.seq_id]
            text = stream.detok.add(token)
            if in_block:  # the thinking is not searched for stop strings; the answer after it is
                stream.block_end = len(stream.detok.text)
                continue
            if stream.stops is not None and stream.stops.add(text):  # a stop string beats the length limit
                seq.text = stream.stops.text
                if seq.status is SequenceStatus.WAITING:  # preempted since: it must not run again
                    self.scheduler.waiting.remove(seq)
                seq.finish("stop")
        return touched

    def _result(self, state: _RequestState) -> GenerationResult:
        outputs, failed = [], None
        for seq in sorted(state.seqs, key=lambda s: s.sample_index):
            stream = state.streams.get(seq.seq_id)
            block = ""
            if stream is not None:
                block = stream.detok.text[: stream.block_end]
                if not seq.text:
                    seq.text = stream.stops.text if stream.stops is not None else stream.detok.text[stream.block_end:]
            outputs.append(CompletionOutput(seq.sample_index, seq.text, seq.output_token_ids, seq.finish_reason,
                                            seq.logprobs, seq.thinking.tokens if seq.thinking is not None else 0,
                                            block))
            if failed is None and seq.error:
                failed = seq
        first = state.seqs[0]
        error, code = (failed.error, failed.error_code) if failed is not None else (None, None)
        return GenerationResult(state.request.request_id, first.num_prompt_tokens, first.num_cached_tokens,
                                outputs, error, code, first.prompt_logprobs)
