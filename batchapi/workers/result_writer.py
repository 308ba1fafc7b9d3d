"""The result writer: a runner's finished requests made durable within seconds, in small groups.

Its thread writes whatever its shards finished every ``result_flush_seconds``, or sooner once
``result_flush_rows`` results wait (``notify``): one transaction for all of them
(``request_results.record``). ``lock`` is held for each write, and the finisher takes it to
complete a shard, so a shard's rows and its completion never cross. Results of a shard whose
lease was taken away are dropped (its new owner runs them); a write the database refused is put
back and tried again. A shard closed as lost (the engine died, the worker stops) still has its
results written while its lease is ours: whoever runs it next runs only the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy.exc import OperationalError

from batchapi.background import Background
from batchapi.batches import request_results
from batchapi.context import Context
from batchapi.workers.codec import LineCodec
from batchapi.workers.shard_work import ShardWork

log = logging.getLogger(__name__)


class ResultWriter:
    def __init__(self, ctx: Context, owner: str, held: Callable[[], list[ShardWork]],
                 codec_of: Callable[[ShardWork], LineCodec]):
        self.ctx, self.owner, self.held, self.codec_of = ctx, owner, held, codec_of
        self.settings = ctx.settings
        self.lock = threading.Lock()
        self.rows_written = 0  # since start: the write load, for logs and the benchmark
        self.writes = 0
        self.write_seconds = 0.0  # wall time inside those transactions
        self._waiting = 0  # results notified since the last write (approximate: no lock)
        self._wake = threading.Event()
        self._thread = Background("batchapi-results", self._loop, wake=self._wake.set)

    def start(self) -> ResultWriter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._thread.stop(timeout=30)

    def notify(self) -> None:
        """A result was kept (engine thread: just a counter)."""
        self._waiting += 1
        if self._waiting >= self.settings.result_flush_rows:
            self._wake.set()

    def notify_now(self) -> None:
        """Write at once (a shard that could not be stored left its results here)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._thread.stopping.is_set():
            self._wake.wait(self.settings.result_flush_seconds)
            self._wake.clear()
            try:
                self.write()
            except Exception:  # the writer thread must outlive one bad write; its rows were put back
                log.exception("writing request results failed; retrying")

    def write_last(self) -> None:
        """The last write before the runner gives its shards back (it stops, its engine died)."""
        try:
            self.write()
        except Exception:  # noqa: BLE001 - on the way out (shutdown, a dead engine): give the shards back anyway
            log.warning("could not write the last results; their requests run again", exc_info=True)

    def write(self) -> int:
        """Write every held shard's unsaved results now; returns how many rows were written."""
        with self.lock:
            self._waiting = 0
            taken = [(work, work.take_unsaved()) for work in self.held()]
            taken = [(work, seqs) for work, seqs in taken if seqs]
            if not taken:
                return 0
            groups = [
                request_results.Group(w.shard.id, w.shard.batch_id, w.shard.attempts, w.finish(self.codec_of(w), seqs),
                                      w.shard.model)
                for w, seqs in taken
            ]
            started = time.perf_counter()
            try:
                written = request_results.record(self.ctx, groups, self.owner)
            except (OperationalError, OSError):
                for work, seqs in taken:
                    work.put_back(seqs)
                log.warning("database unavailable while writing request results; retrying", exc_info=True)
                return 0
            except Exception:
                for work, seqs in taken:
                    work.put_back(seqs)
                raise
            rows = sum(len(g.rows) for g in groups if g.shard_id in written)
            self.rows_written += rows
            self.writes += 1
            self.write_seconds += time.perf_counter() - started
            for work, _ in taken:
                if work.shard.id not in written:
                    log.warning("shard %s is no longer ours; dropped its unsaved results", work.shard.id)
            return rows
