"""The embedded worker of the default deployment (no broker): the API's dispatcher tells it of new
shards and cancels; the API's own sweep loop runs the sweeper's shard steps, as ``batchapi beat``
does in production.

``WorkerProcess`` is ``batchapi serve``'s: the worker in a child process
(``processes.run_embedded_worker``, the same shard runner as ``batchapi worker``'s), so that the
API, however hard it is polled, never holds the GIL that the worker's threads need to feed the
engine and write its results. ``batchapi serve`` restarts it when it dies (the restarted one
takes back the shards it held at once) and it ends with ``batchapi serve``, stopped or killed.

``EmbeddedWorker`` runs the same runner on threads of the API's own process (the tests' host).
Should its engine thread die, the whole process shuts down (SIGTERM to itself), as vLLM's API
server does when its engine is dead, rather than take batches it can never run.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from batchapi import metrics
from batchapi.context import Context
from batchapi.openai.errors import ErrorCode
from batchapi.workers.engine_setup import start_runner
from batchapi.workers.shard_runner import ShardRunner

log = logging.getLogger(__name__)


class EmbeddedWorker:
    """Pass it as the API's dispatcher and its ``run`` as the API's lifetime hook."""

    def __init__(self) -> None:
        self.runner: ShardRunner | None = None

    # Dispatcher

    def batch_ready(self, batch_id: str, shard_ids: list[str], model: str | None = None) -> None:
        if self.runner is not None:
            self.runner.wake()

    def batch_cancelled(self, batch_id: str) -> None:
        if self.runner is not None:
            self.runner.abort_batch(batch_id, ErrorCode.BATCH_CANCELLED)

    # lifetime

    @contextmanager
    def run(self, ctx: Context) -> Iterator[EmbeddedWorker]:
        self.runner = start_runner(ctx)
        metrics.attach_runner(self.runner)  # the engine's gauges on the API's /metrics
        try:
            yield self
        finally:
            metrics.detach_runner(self.runner)
            self.runner.shutdown()
            self.runner = None


# a child that lived this long before it died is restarted at once; one that dies sooner, after a
# wait that doubles up to RESTART_MAX_SECONDS (a worker that cannot start must not spin)
STEADY_SECONDS = 60.0
RESTART_MAX_SECONDS = 30.0
STOP_SECONDS = 60.0  # for the child to give its shards back and stop its engine
# `batchapi worker --embedded` under this Python (the command reads its settings from the
# environment, as serve did)
CHILD = "import sys; from batchapi.cli.commands import main; sys.exit(main(['worker', '--embedded']))"


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WorkerProcess:
    """``batchapi serve``'s worker as a supervised child process. Pass it as the API's dispatcher
    and its ``run`` as the API's lifetime hook. ``command``: the child's command line (default: ``CHILD``)."""

    def __init__(self, command: list[str] | None = None) -> None:
        self.command = command or [sys.executable, "-c", CHILD]
        # the child serves its engine's metrics here, on loopback; serve's /metrics adds them
        self.metrics_port = _free_loopback_port()
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # the child's stdin and ``proc``
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # Dispatcher: a line on the child's stdin (a child that is down finds its shards in the database)

    def batch_ready(self, batch_id: str, shard_ids: list[str], model: str | None = None) -> None:
        self._send("wake")

    def batch_cancelled(self, batch_id: str) -> None:
        self._send(f"cancel {batch_id}")

    def metrics_text(self) -> bytes:
        """The child's engine metrics in the Prometheus text format; empty while it is down."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as answer:
                return answer.read()
        except OSError:
            return b""

    def _send(self, line: str) -> None:
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                return
            try:
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):  # it just died (ValueError: its pipe is closed)
                pass

    # lifetime

    @contextmanager
    def run(self, ctx: Context) -> Iterator[WorkerProcess]:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._supervise, name="batchapi-worker-process", daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop()

    def _spawn(self) -> subprocess.Popen:
        # its own session: a Ctrl-C or a signal to serve's process group is serve's to handle;
        # serve stops it, and a serve that died closes its stdin, which stops it too
        env = {**os.environ, "BATCHAPI_EMBEDDED_METRICS_PORT": str(self.metrics_port)}
        # the engine's CPU threads sleep, not spin, while they wait on each other: on cores the API
        # shares, a spinning thread burns the core its descheduled sibling (or the API) needed, and
        # the engine slowed several times the share the API took (docs/BENCHMARKS.md, "Polling")
        env.setdefault("OMP_WAIT_POLICY", "passive")
        proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, text=True, start_new_session=True, env=env)
        log.info("worker process %d started", proc.pid)
        return proc

    def _supervise(self) -> None:
        wait = 0.5
        while True:
            with self._lock:
                if self._stopping.is_set():
                    return
                self.proc = proc = self._spawn()
            started = time.monotonic()
            code = proc.wait()
            if self._stopping.is_set():
                return
            lived = time.monotonic() - started
            wait = 0.0 if lived > STEADY_SECONDS else min(max(wait * 2, 1.0), RESTART_MAX_SECONDS)
            log.error("worker process %d exited with %s after %.0f s; starting another in %.0f s", proc.pid,
                      code, lived, wait)
            if self._stopping.wait(wait):
                return

    def _stop(self) -> None:
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                log.error("worker process %d did not stop in %.0f s; killing it", proc.pid, STOP_SECONDS)
                proc.kill()
                proc.wait()
        if proc is not None:
            proc.stdin.close()
        if self._thread is not None:
            self._thread.join(STOP_SECONDS)
