"""The engine core in a process of its own, and the door to it (``EngineProcess``).

In one process, every Python thread beside the engine's (a worker's feeder, writer and lease
monitor, the API of the embedded default, ``run-batch``'s reader and writer) takes the GIL from
the engine thread between its kernel calls: a forward makes hundreds of them, and each waits up
to the interpreter's switch interval while another thread runs Python. So the engine core
(schedule, forward, sample, grammar masks, and the token text that decides when a sequence
stops) runs alone in a child process, where nothing else holds its GIL, and its parent does
the rest: parsing, chat templates, tokenizing, rendering, writing, the database. As vLLM V1's
engine-core process does.

The channel is a socket pair (``multiprocessing.Pipe``) carrying pickled batches: the parent
sends the requests it has (a message per ``submit``, read by the core all at once between two
steps), the core sends one message per step with the requests that finished and its counts.
Batch requests are not streamed, so a request crosses twice: its prompt ids in, its result out.

``EngineProcess`` has ``EngineFront``'s interface (submit, abort, counts, on_step, shutdown), so
the shard runner and ``run-batch`` take either. Should the core die (killed, out of memory),
the door starts a new one and resubmits every request in flight: nothing is lost, and none is
delivered twice (a future resolves once; with batch invariance the rerun gives the same
tokens). After ``max_restarts`` deaths within ``RESTART_WINDOW`` seconds it gives up, fails
what is in flight and reports itself dead (``is_alive``), as a dead engine thread does.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from batchapi.background import Background
from batchapi.engine.config import EngineConfig
from batchapi.engine.request import (
    Callback,
    DuplicateRequestId,
    ErrorCode,
    GenerationRequest,
    GenerationResult,
    resolve,
)

log = logging.getLogger(__name__)

RESTART_WINDOW = 600.0  # seconds: deaths older than this no longer count against max_restarts
START_TIMEOUT = 600.0  # seconds a new core may take to load its model
MAX_MESSAGES_A_STEP = 4096  # messages the core takes in between two steps, so that a flood never stops them


@dataclass
class CoreStats:
    """The core's counts after a step (or after taking messages in)."""

    received: int = 0  # requests taken in since the core started
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    grammar_compiles: int = 0


@dataclass
class CoreInfo:
    """What the core tells its parent once its model is loaded."""

    system_fingerprint: str
    max_model_len: int
    eos_token_ids: frozenset[int]
    pid: int


# ---- the child ----


def run_core(config: EngineConfig, conn, compute_turn: AbstractContextManager | None) -> None:
    """The child's loop: take every message waiting, step while there is work, send what
    finished. Blocks on the channel only when the engine has nothing to do. Returns when told to
    stop or when the parent's end closes (the parent died)."""
    # Ctrl-C, or a supervisor's SIGTERM to the process group, reaches the parent too, which stops
    # the core in its own shutdown (after giving its shards back); a parent that dies closes the
    # channel, and the core ends at its next look at it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from batchapi.engine.engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except Exception as exc:  # an unsupported model, a missing file: the parent raises it
        conn.send(("error", _sendable(exc)))
        return
    # what start-up made (torch, the tokenizer, the model: ~300,000 objects) lives as long as the
    # core: out of the collector's sight, so that no full collection walks it mid-run (one took
    # 160-210 ms, a step and a half at 256 sequences, on a 2-core EPYC: docs/BENCHMARKS.md);
    # collected first, so that no start-up garbage is kept for good
    gc.collect()
    gc.freeze()
    conn.send(("ready", CoreInfo(engine.system_fingerprint, engine.max_model_len,
                                 frozenset(engine.eos_token_ids), os.getpid())))
    core = _Core(engine, conn, compute_turn or nullcontext())
    try:
        core.loop()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone: nobody is left to read a result
    engine.close()
    conn.close()
    logging.shutdown()
    os._exit(0)  # nothing is left to flush; tearing down torch's interpreter state takes most of a second


class _Core:
    def __init__(self, engine, conn, turn: AbstractContextManager):
        self.engine, self.conn, self.turn = engine, conn, turn
        self.received = 0

    def loop(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            if not engine.has_unfinished():
                conn.poll(None)  # idle: wait for the parent
            failed: list[tuple[str, BaseException]] = []
            aborted: list[GenerationResult] = []
            for _ in range(MAX_MESSAGES_A_STEP):
                if not conn.poll(0):
                    break
                kind, payload = conn.recv()
                if kind == "stop":
                    return
                if kind == "add":
                    failed += self.add(payload)
                elif kind == "abort":
                    aborted += [r for r in map(engine.abort, payload) if r is not None]
            seconds, results = 0.0, []
            if engine.has_unfinished():
                started = time.perf_counter()
                results = self.step(failed)
                seconds = time.perf_counter() - started
            conn.send(("step", seconds, aborted + results, failed, self.stats()))

    def add(self, requests: list[GenerationRequest]) -> list[tuple[str, BaseException]]:
        """Queue requests; one the engine refuses (bad types, a duplicate id) fails alone:
        ``(request id, exception)`` each, for the parent to fail its future with."""
        failed = []
        for request in requests:
            self.received += 1
            known = request.request_id in self.engine.requests
            try:
                self.engine.add_request(request)
            except Exception as exc:
                log.warning("request %s refused: %s", request.request_id, exc)
                if not known:
                    self.engine.requests.pop(request.request_id, None)
                failed.append((request.request_id, _sendable(exc)))
        return failed

    def step(self, failed: list[tuple[str, BaseException]]) -> list[GenerationResult]:
        try:
            with self.turn:
                return self.engine.step()
        except Exception as exc:  # a bug, not a bad request: fail what is in flight, keep serving
            log.exception("engine step failed; failing %d requests", len(self.engine.requests))
            for request_id in self.engine.request_ids():
                self.engine.abort(request_id)
                failed.append((request_id, _sendable(exc)))
            return []

    def stats(self) -> CoreStats:
        engine = self.engine
        compiles = engine._grammars.compiles if engine._grammars is not None else 0
        return CoreStats(self.received, engine.num_waiting(), engine.num_running(), engine.kv_usage(), compiles)


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# ---- the parent ----


def start_engine(config: EngineConfig, compute_turn: AbstractContextManager | None = None, process: bool = True):
    """The chat model's engine, started: its core in a child process (``EngineProcess``), or with
    ``process`` false on a thread of this one (``EngineFront``). Both have one interface."""
    if process:
        return EngineProcess(config, compute_turn=compute_turn).start()
    from batchapi.engine.front import EngineFront

    return EngineFront(config, compute_turn=compute_turn).start()


class CoreDied(RuntimeError):
    """The engine core process died more often than ``max_restarts`` allows."""


class EngineProcess:
    """The door to an engine core in a child process; ``EngineFront``'s interface."""

    def __init__(self, config: EngineConfig, compute_turn: AbstractContextManager | None = None,
                 max_restarts: int = 3, tokenizer=None):
        """Starts the core and waits until its model is loaded (the tokenizer loads here meanwhile).
        ``compute_turn``: one that works across processes and can be given up for a dead core
        (``workers.engine_setup.TakeTurns(processes=True)``, with its ``forfeit``)."""
        self.config = config
        self.max_restarts = max_restarts
        self._compute_turn = compute_turn
        self._mp = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()  # the pending table and the counts
        self._send_lock = threading.Lock()
        self._pending: dict[str, tuple[GenerationRequest, Future, Callback | None]] = {}
        self._aborted: set[str] = set()
        self._sent = 0  # requests sent to the current core
        self._stats = CoreStats()
        self._deaths: list[float] = []
        self._dead = threading.Event()
        self.restarts = 0
        self.on_step: Callable[[float, list[GenerationResult]], None] | None = None
        self._process, self._conn = self._spawn()
        if tokenizer is None:  # transformers is imported here, while the core imports torch beside us
            from batchapi.engine.detokenizer import load_tokenizer

            tokenizer = load_tokenizer(config.model_path)
        self.tokenizer = tokenizer
        info = self._await_ready(self._process, self._conn)
        self.system_fingerprint = info.system_fingerprint
        self.max_model_len = info.max_model_len
        self.eos_token_ids = info.eos_token_ids
        self._thread = Background("batchapi-engine-door", self._receive_loop)

    # ---- any thread ----

    def start(self) -> EngineProcess:
        self._thread.start()
        return self

    @property
    def pid(self) -> int:
        """The core process's id (a test or an operator may kill it; a new one takes over)."""
        return self._process.pid

    def submit(self, request: GenerationRequest, callback: Callback | None = None) -> Future:
        """Queue a request; raises DuplicateRequestId while one with the same id is in flight."""
        return self.submit_many([request], callback)[0]

    def submit_many(self, requests: list[GenerationRequest], callback: Callback | None = None) -> list[Future]:
        """Queue requests in one message to the core, which takes them into one step; a request
        id already in flight raises DuplicateRequestId and queues none of them."""
        futures = [Future() for _ in requests]
        # Registered and written under the send lock: a restart (which takes it first) then sees
        # these requests either pending before its resubmission or not at all, never sent twice.
        with self._send_lock:
            with self._lock:
                if self._thread.stopping.is_set() or self._dead.is_set():
                    raise RuntimeError("the engine core is shut down")
                seen: set[str] = set()
                for request in requests:
                    rid = request.request_id
                    if rid in self._pending or rid in seen:
                        raise DuplicateRequestId(f"request id {rid!r} is already in flight")
                    seen.add(rid)
                for request, future in zip(requests, futures, strict=True):
                    self._pending[request.request_id] = (request, future, callback)
                self._sent += len(requests)
            if requests:
                self._write(("add", list(requests)))
        return futures

    def abort(self, request_id: str) -> None:
        with self._send_lock:
            with self._lock:
                if request_id not in self._pending:
                    return
                self._aborted.add(request_id)
            self._write(("abort", [request_id]))

    def is_alive(self) -> bool:
        """Whether a core runs or is being restarted (a worker stops claiming work when not)."""
        return self._thread.is_alive() and not self._dead.is_set()

    def num_waiting(self) -> int:
        with self._lock:
            return self._stats.waiting + max(0, self._sent - self._stats.received)

    def num_running(self) -> int:
        return self._stats.running

    def num_in_flight(self) -> int:
        return len(self._pending)

    def kv_usage(self) -> float:
        return self._stats.kv_usage

    @property
    def grammar_compiles(self) -> int:
        return self._stats.grammar_compiles

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the core; requests still in flight fail with RuntimeError."""
        self._thread.stopping.set()
        try:
            self._send(("stop", None))
        except OSError:
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
            self._forfeit_turn()
        self._thread.stop(timeout)
        self._conn.close()
        self._fail_all(RuntimeError("the engine front was shut down"))

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- the core's lifetime ----

    def _spawn(self):
        parent, child = self._mp.Pipe()
        process = self._mp.Process(target=run_core, args=(self.config, child, self._compute_turn),
                                   name="batchapi-engine-core", daemon=True)
        process.start()
        child.close()
        return process, parent

    def _await_ready(self, process, conn) -> CoreInfo:
        deadline = time.monotonic() + START_TIMEOUT
        while not conn.poll(0.5):
            if not process.is_alive():
                raise CoreDied(f"the engine core exited with code {process.exitcode} while loading the model")
            if time.monotonic() > deadline:
                process.kill()
                raise CoreDied(f"the engine core did not load its model within {START_TIMEOUT:.0f} s")
        try:
            kind, payload = conn.recv()
        except EOFError:
            process.join(5)
            raise CoreDied(f"the engine core exited with code {process.exitcode} while loading the model") from None
        if kind == "error":
            process.join(5)
            raise payload
        assert kind == "ready", kind
        return payload

    def _forfeit_turn(self) -> None:
        """A core that died holding (or awaiting) the compute turn gives it up: a turn shared
        across processes has ``forfeit`` (``workers.engine_setup.TakeTurns``)."""
        forfeit = getattr(self._compute_turn, "forfeit", None)
        if forfeit is not None:
            forfeit()

    def _send(self, message) -> None:
        with self._send_lock:
            self._write(message)

    def _write(self, message) -> None:
        """Send to the current core; the caller holds the send lock."""
        try:
            self._conn.send(message)
        except OSError:  # the core died: the receiver restarts it and resends what is pending
            pass

    # ---- the receiver thread ----

    def _receive_loop(self) -> None:
        while not self._thread.stopping.is_set():
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if self._thread.stopping.is_set():
                    return
                if not self._restart():
                    return
                continue
            _, seconds, results, failed, stats = message
            with self._lock:
                self._stats = stats
            if self.on_step is not None and seconds:
                self.on_step(seconds, results)
            for result in results:
                self._deliver(result)
            for request_id, exc in failed:
                self._fail(request_id, exc)

    def _restart(self) -> bool:
        """Start a new core after the old one died and resubmit what was in flight; False (and
        every request failed) once it has died too often."""
        self._process.join(5)
        code = self._process.exitcode
        self._forfeit_turn()
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW] + [now]
        if len(self._deaths) > self.max_restarts:
            log.error("the engine core died (exit code %s) %d times in %.0f s; giving up",
                      code, len(self._deaths), RESTART_WINDOW)
            self._dead.set()
            self._fail_all(CoreDied(f"the engine core died (exit code {code}) and was not restarted"))
            return False
        log.warning("the engine core died (exit code %s); starting a new one and resubmitting %d requests",
                    code, len(self._pending))
        if self._thread.stopping.is_set():
            return False
        try:
            process, conn = self._spawn()
            self._await_ready(process, conn)
        except Exception as exc:
            log.exception("the engine core could not be restarted")
            self._dead.set()
            self._fail_all(exc)
            return False
        with self._send_lock, self._lock:
            old = self._conn
            self._process, self._conn = process, conn
            self.restarts += 1
            self._stats = CoreStats()
            aborted = [rid for rid in self._aborted if rid in self._pending]
            again = [request for rid, (request, _, _) in self._pending.items() if rid not in self._aborted]
            self._sent = len(again)
            if again:
                conn.send(("add", again))
        old.close()
        for request_id in aborted:
            request = self._pending[request_id][0]
            self._deliver(GenerationResult(request_id, len(request.prompt_token_ids), 0, [], "aborted",
                                           ErrorCode.ABORTED))
        return True

    def _deliver(self, result: GenerationResult) -> None:
        with self._lock:
            _, future, callback = self._pending.pop(result.request_id, (None, None, None))
            self._aborted.discard(result.request_id)
        if future is not None:
            resolve(future, callback, result)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            _, future, _ = self._pending.pop(request_id, (None, None, None))
            self._aborted.discard(request_id)
        if future is not None and not future.done():
            future.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for _, future, _ in pending.values():
            if not future.done():
                future.set_exception(exc)
