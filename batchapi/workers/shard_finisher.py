"""The finisher: a finished shard stored, one shard at a time, on a thread of its own.

It writes the shard's objects to its attempt's keys, completes the shard and finalizes the batch
when it was the last shard. A store the storage or the database refuses is tried again with
backoff, under a lease the lease monitor keeps renewing; if it keeps failing the shard's results
go to the result writer and its lease is left to run out (``_keep``), so nothing finished is lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from batchapi.batches import leases
from batchapi.batches.finalize import finalize_batch
from batchapi.context import Context
from batchapi.errors import TRANSIENT
from batchapi.storage import discard
from batchapi.storage.keys import shard_error_key, shard_output_key, superseded_shard_keys
from batchapi.workers.codec import LineCodec
from batchapi.workers.result_writer import ResultWriter
from batchapi.workers.shard_work import ShardWork

log = logging.getLogger(__name__)

# a finisher that cannot store a shard tries again after 0.5, 1, 2 and 4 s, under a lease it renews
STORE_TRIES = 5
STORE_BACKOFF_SECONDS = 0.5


class ShardFinisher:
    def __init__(self, ctx: Context, owner: str, writer: ResultWriter, codec_of: Callable[[ShardWork], LineCodec],
                 stopping: threading.Event, stored: Callable[[ShardWork], None]):
        """``stopping``: the runner's (once set, a refused store is not tried again); ``stored``:
        called on the finisher's thread once it is done with a shard, stored or not."""
        self.ctx, self.owner, self.codec_of = ctx, owner, codec_of
        self._writer = writer
        self._stopping = stopping
        self._stored = stored
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchapi-finish")

    def submit(self, work: ShardWork) -> None:
        self._pool.submit(self._write, work)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def _write(self, work: ShardWork) -> None:
        try:
            if not work.lost:
                self._store(work)
        finally:
            self._stored(work)

    def _store(self, work: ShardWork) -> None:
        """Store the shard, trying again with backoff when the storage or the database is briefly
        away (the monitor keeps renewing the lease meanwhile). If it stays away, the shard is
        left to the sweeper, its results kept for the result writer (``_keep``)."""
        delay = STORE_BACKOFF_SECONDS
        for attempt in range(1, STORE_TRIES + 1):
            try:
                self._store_once(work)
                return
            except TRANSIENT as exc:
                if attempt == STORE_TRIES or self._stopping.is_set():
                    log.error("could not store shard %s after %d tries (%s); its lease is left to run out, its "
                              "results to the result writer", work.shard.id, attempt, exc, exc_info=True)
                    break
                log.warning("could not store shard %s (try %d of %d: %s); trying again in %.1f s", work.shard.id,
                            attempt, STORE_TRIES, exc, delay)
                self._stopping.wait(delay)
                delay *= 2
        self._keep(work)

    def _keep(self, work: ShardWork) -> None:
        """The shard could not be stored: its lease is no longer renewed, so it runs out and the
        shard is run again, by whoever takes it, for only its requests without a durable result.
        The results this attempt has go to the result writer, which writes them while the lease
        is still ours (then the runner lets the work go: ``ShardRunner._let_go_kept``), or drops
        them, logged, if the shard was taken over first."""
        work.kept = True
        self._writer.notify_now()

    def _store_once(self, work: ShardWork) -> None:
        shard = work.shard
        rendered = work.render(self.codec_of(work))
        out_key = shard_output_key(shard.batch_id, shard.index, shard.attempts)
        err_key = shard_error_key(shard.batch_id, shard.index, shard.attempts)
        if shard.id not in leases.heartbeat(self.ctx, [shard.id], self.owner):
            log.warning("lost the lease of shard %s before writing; dropping its results", shard.id)
            return
        # objects of this attempt only: if the lease runs out while they are written and someone
        # else completes the shard, these are never read (the completed attempt's keys are)
        self.ctx.storage.put_chunks(out_key, [rendered.output])
        self.ctx.storage.put_chunks(err_key, [rendered.errors])
        with self._writer.lock:  # no rows of this shard are being written meanwhile
            completed = leases.complete(self.ctx, shard, self.owner, rendered.outcome, out_key, err_key,
                                        cache_entries=work.entries)
            if completed:
                work.take_unsaved()  # in the objects now: nothing left for the writer
        if not completed:
            log.warning("lost the lease of shard %s while writing; its retry counts", shard.id)
            discard(self.ctx.storage, [out_key, err_key])  # this attempt's alone: nobody reads them
            return
        discard(self.ctx.storage, superseded_shard_keys(shard.batch_id, shard.index, shard.attempts))
        writer = self._writer
        log.info("shard %s done: %d ok, %d failed%s; request results written so far: %d rows in %d writes (%.3f s)",
                 shard.id, rendered.outcome.completed, rendered.outcome.failed,
                 f" ({work.reason})" if work.reason else "", writer.rows_written, writer.writes, writer.write_seconds)
        try:
            finalize_batch(self.ctx, shard.batch_id)
        except TRANSIENT:
            log.warning("could not finalize batch %s now; the sweeper will", shard.batch_id, exc_info=True)
