"""The shard runner: keeps several shards in flight in one engine, pulling by capacity.

Its feeder thread claims the next shard whenever the engine's waiting queue is below the
watermark (and fewer than ``max_shards_in_flight`` are held), so the engine never idles on a
shard's tail; an idle feeder looks again every ``worker_poll_seconds`` or when woken (told that
shards may be queued: room freed by a finished request alone does not send it back to a queue it
found empty less than a poll ago). Beside it
run the lease monitor (``lease_monitor``: cancels, expiries, heartbeats), the result writer
(``result_writer``: each finished request durable within about a second, so a shard taken over
after a crash runs only the rest) and the finisher (``shard_finisher``: a finished shard's
objects, its completion, its batch's finalize; a shard it cannot store is kept here until the
result writer has written its results, ``_let_go_kept``). Celery tasks and the embedded worker
share this class; the broker only wakes the feeder.

A dead engine thread (a BaseException escaped it) is final: within a second the monitor stops
claiming, writes the results it has, gives the unfinished shards back to the queue (whoever runs
them next runs only their requests without a result), lets the finished ones be stored, and
calls ``on_engine_death``, whose host stops the process so its supervisor restarts it with a
fresh engine. An engine thread that lives but hangs is noticed later (``LeaseMonitor.stalled``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from sqlalchemy.exc import OperationalError

from batchapi.background import Background
from batchapi.batches import leases, request_results, result_cache
from batchapi.batches.leases import Claimed
from batchapi.batches.shard_input import read_shard
from batchapi.context import Context
from batchapi.errors import TRANSIENT, NotFound
from batchapi.openai.errors import ErrorCode
from batchapi.workers.codec import Codec, LineCodec
from batchapi.workers.lease_monitor import LeaseMonitor
from batchapi.workers.result_writer import ResultWriter
from batchapi.workers.shard_finisher import ShardFinisher
from batchapi.workers.shard_work import ShardWork, engine_failure

if TYPE_CHECKING:
    from batchapi.engine.core import EngineProcess
    from batchapi.engine.front import EngineFront

log = logging.getLogger(__name__)


class ShardRunner:
    def __init__(self, ctx: Context, front: EngineFront | EngineProcess | None, codec: Codec | None, owner: str,
                 on_engine_death: Callable[[], None] | None = None, encoders: dict[str, tuple] | None = None):
        """``front``/``codec``: the chat model's engine (None on a worker of embedding models only);
        ``encoders``: model id -> (``encoder.EncoderFront``, ``EmbeddingCodec``) of its embedding models."""
        self.ctx = ctx
        self.settings = ctx.settings
        self.front = front
        self.codec = codec
        # model id -> (front, codec); a shard runs on its batch's model's
        self.backends: dict[str, tuple] = {} if front is None else {codec.model_id: (front, codec)}
        self.backends.update(encoders or {})
        assert self.backends, "a runner serves at least one model"
        self.models = list(self.backends)
        self.fronts = [f for f, _ in self.backends.values()]
        self.owner = owner
        self.on_engine_death = on_engine_death  # called once, on the monitor thread
        self.engine_dead = threading.Event()  # set under _lock, so _start never adds work after it
        self._inflight: dict[str, ShardWork] = {}
        # shards that could not be stored, held only until the result writer has written their results
        self._kept: dict[str, ShardWork] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # set by ``wake`` (shards may have been queued): after a claim found the queue empty, only
        # this or the poll interval lets the feeder look again, not every finished request's wake
        self._news = threading.Event()
        self._found_empty: float | None = None  # monotonic time of the last claim that found nothing
        self._stop = threading.Event()  # the feeder's and the monitor's: they stop together
        self._writer = ResultWriter(ctx, owner, self._unstored, self._codec_of)
        self._finisher = ShardFinisher(ctx, owner, self._writer, self._codec_of, self._stop, self._stored)
        self._monitor = LeaseMonitor(ctx, owner, self.fronts, self._held, self._close, self._tick, self._stop)
        self._feeder = Background("batchapi-feeder", self._feed_loop, wake=self._wake.set, stopping=self._stop)

    # ---- control ----

    def start(self) -> ShardRunner:
        self._feeder.start()
        self._monitor.start()
        self._writer.start()
        return self

    def wake(self) -> None:
        """New shards may be queued: look now instead of at the next poll."""
        self._news.set()
        self._wake.set()

    def run_shard(self, shard_id: str, timeout: float | None = None) -> str:
        """Claim ``shard_id`` and wait until it is finished (a Celery task's body). A shard that
        someone else holds or already finished is left alone: duplicated messages do nothing."""
        while not self._has_room() and not self._stop.is_set() and not self.engine_dead.is_set():
            time.sleep(0.1)  # the feeder may claim this very shard meanwhile: then it is skipped
        if self.engine_dead.is_set():
            return "skipped"  # left queued: a live worker's feeder finds it
        claimed = leases.claim(self.ctx, shard_id, self.owner, self.models)
        if claimed is None:
            self.wake()
            return "skipped"
        work = self._start(claimed)
        if work is None:
            return "released"
        work.stored.wait(timeout)  # acknowledged only once its results are in storage
        return "released" if work.lost or work.kept else work.reason or "done"

    def abort_batch(self, batch_id: str, reason: ErrorCode) -> int:
        """Cut the batch's shards short now (the embedded API calls this on cancel)."""
        works = [w for w in self._held() if w.shard.batch_id == batch_id]
        for work in works:
            self._close(work, reason)
        return len(works)

    def shutdown(self) -> None:
        """Stop pulling, give held shards back to the queue, stop the engine."""
        self._feeder.stop(timeout=10)  # sets the monitor's stop too
        self._monitor.stop(timeout=10)
        works = self._held()
        for work in works:
            work.close(None, lost=True)
        self._writer.stop()
        self._writer.write_last()  # before the leases go: what finished is not run again
        for work in works:
            work.stored.set()
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        released = leases.release(self.ctx, [w.shard.id for w in works + kept], self.owner)
        if released:
            log.info("gave %d shards back to the queue", released)
        self._finisher.shutdown()
        for front in self.fronts:
            front.shutdown()

    def _held(self) -> list[ShardWork]:
        with self._lock:
            return list(self._inflight.values())

    def _unstored(self) -> list[ShardWork]:
        """What the result writer writes: the held shards and the kept ones (``_let_go_kept``)."""
        with self._lock:
            return list(self._inflight.values()) + list(self._kept.values())

    def _backend(self, work: ShardWork) -> tuple:
        """The (front, codec) of the shard's model (a row from before models were recorded: the first)."""
        return self.backends.get(work.shard.model) or next(iter(self.backends.values()))

    def _codec_of(self, work: ShardWork) -> LineCodec:
        return self._backend(work)[1]

    def _alive(self) -> bool:
        return all(front.is_alive() for front in self.fronts)

    def _waiting(self) -> int:
        return sum(front.num_waiting() for front in self.fronts)

    # ---- feeder ----

    def _has_room(self) -> bool:
        if not self._alive():
            return False
        with self._lock:
            held = len(self._inflight)
        if held and self._monitor.stalled():
            return False
        return held < self.settings.max_shards_in_flight and self._waiting() <= self.settings.engine_watermark

    def _feed_loop(self) -> None:
        poll = self.settings.worker_poll_seconds
        while not self._stop.is_set():
            if not self._has_room():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            since_empty = None if self._found_empty is None else time.monotonic() - self._found_empty
            if since_empty is not None and since_empty < poll and not self._news.is_set():
                self._wake.wait(poll - since_empty)  # room came, but nothing new was queued
                self._wake.clear()
                continue
            self._news.clear()
            try:
                claimed = leases.claim_next(self.ctx, self.owner, self.models)
            except OperationalError:
                log.warning("database unavailable while claiming; retrying", exc_info=True)
                claimed = None
            if claimed is not None:
                self._found_empty = None
                try:
                    self._start(claimed)
                except Exception:  # noqa: BLE001 - one shard that cannot start must not end the feeding
                    # of every other: its lease runs out, and the sweeper re-queues or fails it
                    log.exception("could not start shard %s; leaving it to its lease", claimed.id)
                continue
            self._found_empty = time.monotonic()
            self._wake.wait(poll)
            self._wake.clear()

    def _start(self, claimed: Claimed) -> ShardWork | None:
        try:
            lines = read_shard(self.ctx.storage, claimed, self.settings.max_line_bytes)
            earlier = request_results.stored(self.ctx, claimed.id)
        except TRANSIENT:
            log.warning("could not read shard %s; giving it back", claimed.id, exc_info=True)
            try:
                leases.release(self.ctx, [claimed.id], self.owner)
            except TRANSIENT:  # the database away too: the lease runs out, and the sweeper re-queues it
                log.warning("could not give shard %s back; leaving it to its lease", claimed.id, exc_info=True)
            return None
        except NotFound:
            # never renewed, so the lease runs out and the attempts run up to shard_failed
            log.error("the input of shard %s is gone from storage", claimed.id)
            return None
        work = ShardWork(claimed, lines, earlier)
        front, codec = self._backend(work)
        fingerprint = getattr(front, "system_fingerprint", None) if self.settings.result_cache else None
        requests = self._from_cache(work, work.requests(codec, fingerprint))
        work.expect([r.request_id for r in requests])
        with self._lock:
            dead = self.engine_dead.is_set()
            if not dead:
                if not self._inflight:
                    self._monitor.moved()
                earlier_work = self._inflight.get(claimed.id)
                if earlier_work is not None:  # an earlier attempt of ours, whose lease ran out: fenced off
                    earlier_work.lost = True
                self._inflight[claimed.id] = work
        if dead:  # claimed while the engine died: straight back
            leases.release(self.ctx, [claimed.id], self.owner)
            return None
        log.info("shard %s (attempt %d): %d requests to run, %d finished by an earlier attempt", claimed.id,
                 claimed.attempts, len(requests), len(earlier))
        if work.done.is_set():  # nothing to run: every line was rejected
            self._finish(work)
        for request, future in zip(requests, front.submit_many(requests), strict=True):  # one message to a core
            future.add_done_callback(lambda f, w=work, rid=request.request_id: self._on_done(w, rid, f))
        return work

    def _from_cache(self, work: ShardWork, requests: list) -> list:
        """Where the shard's batch has the result cache: answer the requests it has (one query),
        durable at once like any finished request, and run one of each group of copies among the
        rest (``ShardWork.coalesce``); returns what to run. The database away: everything runs."""
        if not work.keys:
            return requests
        shard = work.shard
        try:
            if not result_cache.enabled(self.ctx, shard.batch_id):
                return requests
            rows = work.cached(result_cache.lookup(self.ctx, shard.batch_id, set(work.keys.values())))
            if rows:
                group = request_results.Group(shard.id, shard.batch_id, shard.attempts, list(rows.values()),
                                              shard.model)
                if shard.id not in request_results.record(self.ctx, [group], self.owner):
                    return requests  # no longer ours: whatever we do is not written
        except Exception:  # noqa: BLE001 - the cache only saves work: without it, everything runs
            log.warning("could not use the result cache for shard %s; running its requests", shard.id, exc_info=True)
            return requests
        if rows:
            work.earlier.update(rows)
            log.info("shard %s: %d requests answered from the result cache", shard.id, len(rows))
        requests = work.coalesce([r for r in requests if work.seq_of(r.request_id) not in rows])
        if work.copies:
            log.info("shard %s: %d copies of other requests of it wait on their first's result", shard.id,
                     len(work.copies))
        return requests

    def _on_done(self, work: ShardWork, request_id: str, future: Future) -> None:
        """Engine thread: keep it short. A future, not the front's callback, so that a request
        failed by an engine crash is reported too instead of leaving its shard waiting."""
        exc = future.exception()
        result = future.result() if exc is None else engine_failure(request_id, exc)
        last = work.add(result)
        self._writer.notify()
        if last:
            self._finish(work)
        elif self._waiting() <= self.settings.engine_watermark:
            self._wake.set()  # the queue drained: let the feeder claim now, not at its next tick

    def _finish(self, work: ShardWork) -> None:
        self._finisher.submit(work)
        self._wake.set()

    # ---- after the finisher ----

    def _stored(self, work: ShardWork) -> None:
        """The finisher is done with the shard (stored, dropped, or kept: ``ShardFinisher._keep``)."""
        shard = work.shard
        with self._lock:
            if self._inflight.get(shard.id) is work:  # not a later attempt that took its place
                del self._inflight[shard.id]
                if work.kept:
                    self._kept[shard.id] = work
        work.stored.set()
        self._wake.set()

    def _let_go_kept(self) -> None:
        """Forget the kept shards whose results are all written (or were dropped: taken over)."""
        with self._writer.lock, self._lock:  # not while a write that may put rows back is under way
            done = [sid for sid, work in self._kept.items() if not work.has_unsaved()]
            for sid in done:
                del self._kept[sid]
        for sid in done:
            log.info("the results of shard %s, which could not be stored, are written; it is the sweeper's", sid)

    # ---- on the monitor's thread ----

    def _tick(self) -> None:
        """Each second, before the monitor looks at the leases."""
        if not self.engine_dead.is_set() and not self._alive():
            self._give_up_engine()
        self._let_go_kept()

    def _give_up_engine(self) -> None:
        """The engine thread is gone and nothing it held will come back: give the unfinished
        shards back to the queue now instead of heartbeating them until a stall shows. A shard
        that already has all its results is still stored by the finisher."""
        with self._lock:
            self.engine_dead.set()
            works = list(self._inflight.values())
        unfinished = [w for w in works if w.close(None, lost=True)]  # lost: this worker writes no objects
        self._writer.write_last()  # while the leases are still ours
        try:
            released = leases.release(self.ctx, [w.shard.id for w in unfinished], self.owner, lost=True)
        except OperationalError:
            released = 0  # no longer renewed, so they come back when their leases run out
            log.warning("database unavailable while giving shards back", exc_info=True)
        log.error("the engine thread died; gave %d of %d unfinished shards back to the queue and stopped "
                  "claiming", released, len(unfinished))
        for work in unfinished:
            self._finish(work)
        if self.on_engine_death is not None:
            self.on_engine_death()

    def _close(self, work: ShardWork, reason: ErrorCode | None, lost: bool = False) -> None:
        aborted = work.close(reason, lost)
        if not aborted:  # it had finished already
            return
        front = self._backend(work)[0]
        for request_id in aborted:
            front.abort(request_id)
        log.info("shard %s closed (%s): %d requests aborted", work.shard.id, reason or "lease lost", len(aborted))
        self._finish(work)
