"""EncoderFront: a thread-safe door to one ``Encoder`` running on a background thread.

Requests carry lists of token-id inputs; the thread takes everything queued, sorts the inputs
by prompt and then by length (so a batch pads little, and a decoder runs the prompt its batch
shares once), cuts them into batches of at most ``max_batch_tokens`` padded tokens, encodes them
and completes each request's future once all its inputs are done.
No KV cache, no steps: an input is encoded once. A bad request (a token id outside the
vocabulary) finishes with an error; a failed forward fails that round's requests; neither stops
the thread. The interface mirrors ``engine.EngineFront`` where the shard runner uses it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from batchapi.background import Background
from batchapi.encoder.model import Encoder
from batchapi.encoder.pooling import shorten

log = logging.getLogger(__name__)


class EncoderError(StrEnum):
    INVALID_REQUEST = "invalid_request"
    ABORTED = "aborted"
    ENGINE_FAILURE = "engine_failure"


@dataclass
class EncoderConfig:
    model_path: str | Path
    device: str = "cpu"
    dtype: str = "float32"
    # padded tokens per forward; None: 16384 on a GPU, 1024 on the CPU, where a forward whose
    # activations stay in the caches runs 2x faster than one of 16384 tokens (bench/embeddings.py)
    max_batch_tokens: int | None = None

    def __post_init__(self):
        self.model_path = Path(self.model_path).expanduser()
        if self.max_batch_tokens is None:
            self.max_batch_tokens = 1024 if self.device == "cpu" else 16384
        assert self.dtype in ("float32", "bfloat16", "float16"), f"unsupported dtype {self.dtype!r}"
        assert self.max_batch_tokens >= 512, "max_batch_tokens must hold at least one full-window input"


@dataclass(frozen=True)
class EmbeddingRequest:
    request_id: str
    inputs: list[list[int]]  # token ids, each truncated to the model's max_seq_length by the front
    prompt_length: int = 0  # the prompt's tokens at the start of each input (the model may pool without them)
    dimensions: int | None = None  # a Matryoshka model's vectors cut to these (the codec checked them)


@dataclass
class EmbeddingResult:
    """One request's vectors (little-endian float32 bytes each, in input order) and usage."""

    request_id: str
    prompt_tokens: int  # the tokens encoded, after truncation
    vectors: list[bytes] = field(default_factory=list)
    error: str | None = None
    error_code: EncoderError | None = None
    cached_tokens: int = 0  # as a GenerationResult: an embedding has no cache and no output
    completion_tokens: int = 0


@dataclass
class _Pending:
    request: EmbeddingRequest
    future: Future
    vectors: list[bytes | None]
    left: int


class EncoderFront:
    def __init__(self, config: EncoderConfig, encoder: Encoder | None = None,
                 compute_turn: AbstractContextManager | None = None):
        """compute_turn: held around each forward (see EngineFront: a chat engine on the same CPU)."""
        self.config = config
        self._compute_turn = compute_turn or nullcontext()
        self.encoder = encoder or Encoder(config.model_path, config.device, config.dtype)
        self.tokenizer = self.encoder.tokenizer
        self.max_seq_length = self.encoder.max_seq_length
        self.dimensions = self.encoder.dimensions
        self.pipeline = self.encoder.pipeline
        self.system_fingerprint = None
        self._wake = threading.Condition()
        self._inbox: list[_Pending] = []
        self._running: dict[str, _Pending] = {}
        self._aborts: set[str] = set()
        self._thread = Background("batchapi-encoder", self._run, wake=self._notify)
        # called on the encoder thread after each forward with (seconds, requests it finished): metrics
        self.on_step: Callable[[float, list[EmbeddingResult]], None] | None = None

    # ---- any thread ----

    def start(self) -> EncoderFront:
        self._thread.start()
        return self

    def submit_many(self, requests: list[EmbeddingRequest]) -> list[Future]:
        """``submit`` each (the engine fronts' interface)."""
        return [self.submit(request) for request in requests]

    def submit(self, request: EmbeddingRequest, callback=None) -> Future:
        assert callback is None, "the encoder front reports through the future only"
        future: Future = Future()
        with self._wake:
            if self._thread.stopping.is_set():
                raise RuntimeError("the encoder front is shut down")
            self._inbox.append(_Pending(request, future, [None] * len(request.inputs), len(request.inputs)))
            self._wake.notify()
        return future

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._aborts.add(request_id)
            self._wake.notify()

    def num_waiting(self) -> int:
        with self._wake:
            return len(self._inbox)

    def num_running(self) -> int:
        with self._wake:
            return len(self._running)

    def kv_usage(self) -> float:
        return 0.0

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._thread.stop(timeout=30)
        with self._wake:
            left, self._inbox = self._inbox, []
        for pending in left:
            self._fail(pending, EncoderError.ABORTED, "the encoder shut down")

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    # ---- the encoder thread ----

    def _run(self) -> None:
        stopping = self._thread.stopping
        while True:
            with self._wake:
                while not self._inbox and not stopping.is_set():
                    self._wake.wait()
                if stopping.is_set():
                    return
                batch, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
                self._running = {p.request.request_id: p for p in batch}
            try:
                self._round(batch, aborts)
            finally:
                with self._wake:
                    self._running = {}

    def _round(self, batch: list[_Pending], aborts: set[str]) -> None:
        items = []  # (length, pending, input index, ids)
        for pending in batch:
            if pending.request.request_id in aborts:
                self._fail(pending, EncoderError.ABORTED, "aborted")
                continue
            problem = self._check(pending.request)
            if problem is not None:
                self._fail(pending, EncoderError.INVALID_REQUEST, problem)
                continue
            for i, ids in enumerate(pending.request.inputs):
                ids = ids[: self.max_seq_length]
                items.append((len(ids), pending, i, ids))
        # the inputs of one prompt together (a decoder runs a prompt a batch shares once), longest first
        items.sort(key=lambda item: (_prompt_of(item), item[0]), reverse=True)
        for group in self._groups(items):
            self._forward(group)

    def _forward(self, group: list) -> None:
        started = time.perf_counter()
        try:
            with self._compute_turn:
                vectors = self.encoder.encode([ids for _, _, _, ids in group],
                                              [p.request.prompt_length for _, p, _, _ in group])
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its requests, never the thread
            log.exception("the encoder failed on a batch of %d inputs", len(group))
            for _, pending, _, _ in group:
                self._fail(pending, EncoderError.ENGINE_FAILURE, f"the encoder failed: {exc}")
            return
        finished = []  # (pending, result) of the requests whose last input this forward encoded
        for (_, pending, i, _), vector in zip(group, vectors, strict=True):
            vector = shorten(vector, pending.request.dimensions, self.pipeline.normalize)
            result = self._done(pending, i, vector.numpy().astype("<f4").tobytes())
            if result is not None:
                finished.append((pending, result))
        if self.on_step is not None:  # before the futures, as EngineFront: a result its caller sees is counted
            self.on_step(time.perf_counter() - started, [result for _, result in finished])
        for pending, result in finished:
            pending.future.set_result(result)

    def _groups(self, items: list) -> list[list]:
        """Sorted by prompt, then longest first, so a group's first input sets its padded length; a
        group holds one prompt's inputs."""
        groups, current = [], []
        for item in items:
            if current and (current[0][0] * (len(current) + 1) > self.config.max_batch_tokens
                            or _prompt_of(item) != _prompt_of(current[0])):
                groups.append(current)
                current = []
            current.append(item)
        if current:
            groups.append(current)
        return groups

    def _check(self, request: EmbeddingRequest) -> str | None:
        vocab = self.encoder.vocab_size
        for i, ids in enumerate(request.inputs):
            if not ids:
                return f"input {i} is empty"
            if any(t < 0 or t >= vocab for t in ids):
                return f"input {i} holds a token id outside the model's vocabulary of {vocab}"
        return None

    def _done(self, pending: _Pending, index: int, vector: bytes) -> EmbeddingResult | None:
        """The request's result, not yet delivered, when this was its last input."""
        if pending.future.done():
            return None
        pending.vectors[index] = vector
        pending.left -= 1
        if pending.left > 0:
            return None
        tokens = sum(min(len(ids), self.max_seq_length) for ids in pending.request.inputs)
        return EmbeddingResult(pending.request.request_id, tokens, list(pending.vectors))

    def _fail(self, pending: _Pending, code: EncoderError, message: str) -> None:
        if not pending.future.done():
            pending.future.set_result(EmbeddingResult(pending.request.request_id, 0, error=message, error_code=code))


def _prompt_of(item: tuple) -> tuple[int, ...]:
    """The prompt ids an item (length, pending, input index, ids) starts with."""
    return tuple(item[3][: item[1].request.prompt_length])
