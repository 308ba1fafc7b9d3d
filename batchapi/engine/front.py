"""EngineFront: a thread-safe door to one LLMEngine running steps on a background thread.

Any thread may submit requests and abort them; results come back through a
``concurrent.futures.Future`` and an optional callback (called on the engine thread, so it
should be quick). The engine itself is only ever touched by its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext

from batchapi.background import Background
from batchapi.engine.config import EngineConfig
from batchapi.engine.engine import LLMEngine
from batchapi.engine.request import Callback, DuplicateRequestId, GenerationRequest, GenerationResult, resolve

log = logging.getLogger(__name__)



class EngineFront:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None,
                 compute_turn: AbstractContextManager | None = None):
        """compute_turn: held around each step; a worker whose chat engine and embedding encoder
        share the CPU passes both one (workers.engine_setup.TakeTurns), so that their OpenMP teams,
        each as wide as the cores, never run at once."""
        self.config = config
        self.engine = engine or LLMEngine(config)
        self._compute_turn = compute_turn or nullcontext()
        self.tokenizer = self.engine.tokenizer
        self.system_fingerprint = self.engine.system_fingerprint
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[GenerationRequest, Future, Callback | None]] = []
        self._aborts: list[str] = []
        self._pending: dict[str, tuple[Future, Callback | None]] = {}
        self._thread = Background("batchapi-engine", self._run, wake=self._notify)
        # called on the engine thread after each step with (seconds, finished results): metrics
        self.on_step: Callable[[float, list[GenerationResult]], None] | None = None

    # ---- any thread ----

    def start(self) -> EngineFront:
        self._thread.start()
        return self

    def submit(self, request: GenerationRequest, callback: Callback | None = None) -> Future:
        """Queue a request; raises DuplicateRequestId while one with the same id is in flight."""
        future: Future = Future()
        with self._wake:
            if self._thread.stopping.is_set():
                raise RuntimeError("the engine front is shut down")
            if request.request_id in self._pending:
                raise DuplicateRequestId(f"request id {request.request_id!r} is already in flight")
            self._pending[request.request_id] = (future, callback)
            self._inbox.append((request, future, callback))
            self._wake.notify()
        return future

    def submit_many(self, requests: list[GenerationRequest], callback: Callback | None = None) -> list[Future]:
        """``submit`` each (``EngineProcess`` sends them to its core in one message)."""
        return [self.submit(request, callback) for request in requests]

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def is_alive(self) -> bool:
        """Whether the engine thread is running (a worker stops claiming work when it is not)."""
        return self._thread.is_alive()

    def num_waiting(self) -> int:
        return self.engine.num_waiting() + len(self._inbox)

    def num_running(self) -> int:
        return self.engine.num_running()

    def num_in_flight(self) -> int:
        return len(self._pending)

    def kv_usage(self) -> float:
        return self.engine.kv_usage()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def grammar_compiles(self) -> int:
        """Schemas compiled so far (one shared by many requests compiles once)."""
        grammars = self.engine._grammars
        return grammars.compiles if grammars is not None else 0

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine thread; requests still in flight fail with RuntimeError."""
        self._thread.stop(timeout)
        self.engine.close()
        with self._lock:
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(RuntimeError("the engine front was shut down"))

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def __enter__(self) -> EngineFront:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- engine thread ----

    def _run(self) -> None:
        engine, stopping = self.engine, self._thread.stopping
        while True:
            with self._wake:
                while not (stopping.is_set() or self._inbox or self._aborts or engine.has_unfinished()):
                    self._wake.wait()
                if stopping.is_set():
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            for request, _, _ in inbox:
                self._add(request)
            for request_id in aborts:
                result = engine.abort(request_id)
                if result is not None:
                    self._deliver(result)
            if engine.has_unfinished():
                self._step()

    def _add(self, request: GenerationRequest) -> None:
        # a malformed request (wrong types, a duplicate id) fails its own future, never the thread
        known = request.request_id in self.engine.requests
        try:
            self.engine.add_request(request)
        except Exception as exc:  # bad types, a duplicate id, a grammar compiler that cannot start
            log.warning("request %s refused: %s", request.request_id, exc)
            if not known:
                self.engine.requests.pop(request.request_id, None)
            self._fail(request.request_id, exc)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            with self._compute_turn:
                results = self.engine.step()
        except Exception as exc:  # a bug, not a bad request: fail what is in flight, keep serving
            log.exception("engine step failed; failing %d requests", len(self.engine.requests))
            for request_id in self.engine.request_ids():
                self.engine.abort(request_id)
                self._fail(request_id, exc)
            return
        if self.on_step is not None:
            self.on_step(time.perf_counter() - started, results)
        for result in results:
            self._deliver(result)

    def _deliver(self, result: GenerationResult) -> None:
        with self._lock:
            future, callback = self._pending.pop(result.request_id, (None, None))
        if future is not None:
            resolve(future, callback, result)

    def _fail(self, request_id: str, exc: Exception) -> None:
        with self._lock:
            future, _ = self._pending.pop(request_id, (None, None))
        if future is not None and not future.done():
            future.set_exception(exc)
