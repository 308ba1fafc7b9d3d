"""The shard runner: keeps several shards in flight in one engine, pulling by capacity.

Three threads besides the engine's own:
- the feeder claims the next shard whenever the engine's waiting queue is below the watermark
  (and fewer than ``max_shards_in_flight`` are held), so the engine never idles on a shard's
  tail; an idle feeder looks again every ``worker_poll_seconds`` or when woken;
- the monitor, once a second, aborts the requests of shards whose batch was cancelled or
  expired, and every ``heartbeat_seconds`` extends the leases (a shard whose lease was taken
  away is dropped without writing anything);
- the result writer (``result_writer``) makes each finished request durable within about a
  second, counted in its batch at once; a shard taken over after a crash runs only the requests
  without a durable result;
- the finisher writes a finished shard's objects to its attempt's keys, completes it and
  finalizes the batch when it was the last shard; a store the storage or the database refuses
  is tried again with backoff, and if it keeps failing the shard's results go to the result
  writer and its lease is left to run out (``_keep``), so nothing finished is lost.
Celery tasks and the embedded worker share this class; the broker only wakes the feeder.

A dead engine thread (a BaseException escaped it) is final: within a second the monitor stops
claiming, writes the results it has, gives the unfinished shards back to the queue (whoever runs
them next runs only their requests without a result), lets the finished ones be stored, and
calls ``on_engine_death``, whose host stops the process so its supervisor restarts it with a
fresh engine. An engine thread that lives but hangs is noticed later, by ``_stalled``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from batchapi.batches import leases, request_results
from batchapi.batches.finalize import finalize_batch
from batchapi.batches.leases import Claimed
from batchapi.batches.shard_input import read_shard
from batchapi.batches.states import BatchStatus
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.models import Batch
from batchapi.engine import EngineFront, GenerationResult
from batchapi.engine import ErrorCode as EngineError
from batchapi.errors import TRANSIENT, NotFound
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.storage import discard
from batchapi.storage.keys import shard_error_key, shard_output_key, superseded_shard_keys
from batchapi.workers.codec import Codec
from batchapi.workers.result_writer import ResultWriter
from batchapi.workers.shard_work import ShardWork

log = logging.getLogger(__name__)

MONITOR_SECONDS = 1.0
# a finisher that cannot store a shard tries again after 0.5, 1, 2 and 4 s, under a lease it renews
STORE_TRIES = 5
STORE_BACKOFF_SECONDS = 0.5


def engine_failure(request_id: str, exc: BaseException) -> GenerationResult:
    return GenerationResult(request_id, 0, 0, [], error=f"the engine failed while running this request: {exc}",
                            error_code=EngineError.ENGINE_FAILURE)


class ShardRunner:
    def __init__(self, ctx: Context, front: EngineFront | None, codec: Codec | None, owner: str,
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
        self._stop = threading.Event()
        self._last_progress = time.monotonic()  # when the engine's state last moved (or work arrived)
        self._engine_state: tuple = ()
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchapi-finish")
        self._writer = ResultWriter(ctx, owner, self._unstored, lambda work: self._backend(work)[1])
        self._threads = [
            threading.Thread(target=self._feed_loop, name="batchapi-feeder", daemon=True),
            threading.Thread(target=self._monitor_loop, name="batchapi-monitor", daemon=True),
        ]

    # ---- control ----

    def start(self) -> ShardRunner:
        for thread in self._threads:
            thread.start()
        self._writer.start()
        return self

    def wake(self) -> None:
        """New shards may be queued: look now instead of at the next poll."""
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
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=10)
        works = self._held()
        for work in works:
            work.close(None, lost=True)
        self._writer.stop()
        self._save_results()  # before the leases go: what finished is not run again
        for work in works:
            work.stored.set()
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        released = leases.release(self.ctx, [w.shard.id for w in works + kept], self.owner)
        if released:
            log.info("gave %d shards back to the queue", released)
        self._finisher.shutdown(wait=True)
        for front in self.fronts:
            front.shutdown()

    def _save_results(self) -> None:
        try:
            self._writer.write()
        except Exception:  # noqa: BLE001 - on the way out (shutdown, a dead engine): give the shards back anyway
            log.warning("could not write the last results; their requests run again", exc_info=True)

    def _held(self) -> list[ShardWork]:
        with self._lock:
            return list(self._inflight.values())

    def _unstored(self) -> list[ShardWork]:
        """What the result writer writes: the held shards and the kept ones (``_keep``)."""
        with self._lock:
            return list(self._inflight.values()) + list(self._kept.values())

    def _backend(self, work: ShardWork) -> tuple:
        """The (front, codec) of the shard's model (a row from before models were recorded: the first)."""
        return self.backends.get(work.shard.model) or next(iter(self.backends.values()))

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
        if held and self._stalled():
            return False
        return held < self.settings.max_shards_in_flight and self._waiting() <= self.settings.engine_watermark

    def _stalled(self) -> bool:
        """The engine's queues and KV cache have not moved for a whole lease while requests are
        in flight: its thread hangs (a dead one is noticed at once, by ``_give_up_engine``). Its
        leases are then left to run out, so other workers take the shards over."""
        return time.monotonic() - self._last_progress > self.settings.lease_seconds

    def _watch_engine(self) -> None:
        state = tuple((f.num_waiting(), f.num_running(), f.kv_usage()) for f in self.fronts)
        if state != self._engine_state:
            self._engine_state = state
            self._last_progress = time.monotonic()

    def _feed_loop(self) -> None:
        while not self._stop.is_set():
            if not self._has_room():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                claimed = leases.claim_next(self.ctx, self.owner, self.models)
            except OperationalError:
                log.warning("database unavailable while claiming; retrying", exc_info=True)
                claimed = None
            if claimed is not None:
                self._start(claimed)
                continue
            self._wake.wait(self.settings.worker_poll_seconds)
            self._wake.clear()

    def _start(self, claimed: Claimed) -> ShardWork | None:
        try:
            lines = read_shard(self.ctx.storage, claimed, self.settings.max_line_bytes)
            earlier = request_results.stored(self.ctx, claimed.id)
        except TRANSIENT:
            log.warning("could not read shard %s; giving it back", claimed.id, exc_info=True)
            leases.release(self.ctx, [claimed.id], self.owner)
            return None
        except NotFound:
            # never renewed, so the lease runs out and the attempts run up to shard_failed
            log.error("the input of shard %s is gone from storage", claimed.id)
            return None
        work = ShardWork(claimed, lines, earlier)
        front, codec = self._backend(work)
        requests = []
        for seq, line in work.to_run():
            try:
                requests.append(codec.request(line, work.request_id(seq)))
            except RequestError as exc:  # options the model does not have: that request's error
                exc.custom_id = line.custom_id
                line.body, line.error = None, exc
            except ValueError as exc:  # sampling settings the engine refuses: that request's error
                line.body, line.error = None, RequestError(str(exc), custom_id=line.custom_id)
            except Exception as exc:  # the chat template failed on this request: its error, not the feeder's
                log.warning("could not build the engine request of line %d of shard %s", line.line, claimed.id,
                            exc_info=True)
                line.body, line.error = None, RequestError(
                    f"the request could not be prepared for the model: {exc}", None, ErrorCode.SERVER_ERROR,
                    custom_id=line.custom_id)
        work.expect([r.request_id for r in requests])
        with self._lock:
            dead = self.engine_dead.is_set()
            if not dead:
                if not self._inflight:
                    self._last_progress = time.monotonic()
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
        for request in requests:
            future = front.submit(request)
            future.add_done_callback(lambda f, w=work, rid=request.request_id: self._on_done(w, rid, f))
        return work

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
        self._finisher.submit(self._write, work)
        self._wake.set()

    # ---- finisher ----

    def _write(self, work: ShardWork) -> None:
        shard = work.shard
        try:
            if not work.lost:
                self._store(work)
        finally:
            with self._lock:
                if self._inflight.get(shard.id) is work:  # not a later attempt that took its place
                    del self._inflight[shard.id]
                    if work.kept:
                        self._kept[shard.id] = work
            work.stored.set()
            self._wake.set()

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
                if attempt == STORE_TRIES or self._stop.is_set():
                    log.error("could not store shard %s after %d tries (%s); its lease is left to run out, its "
                              "results to the result writer", work.shard.id, attempt, exc, exc_info=True)
                    break
                log.warning("could not store shard %s (try %d of %d: %s); trying again in %.1f s", work.shard.id,
                            attempt, STORE_TRIES, exc, delay)
                self._stop.wait(delay)
                delay *= 2
        self._keep(work)

    def _keep(self, work: ShardWork) -> None:
        """The shard could not be stored: its lease is no longer renewed, so it runs out and the
        shard is run again, by whoever takes it, for only its requests without a durable result.
        The results this attempt has go to the result writer, which writes them while the lease
        is still ours (then the work is let go: ``_let_go_kept``), or drops them, logged, if the
        shard was taken over first."""
        work.kept = True
        self._writer.notify_now()

    def _store_once(self, work: ShardWork) -> None:
        shard = work.shard
        rendered = work.render(self._backend(work)[1])
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
            completed = leases.complete(self.ctx, shard, self.owner, rendered.outcome, out_key, err_key)
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

    def _let_go_kept(self) -> None:
        """Forget the kept shards whose results are all written (or were dropped: taken over)."""
        with self._writer.lock, self._lock:  # not while a write that may put rows back is under way
            done = [sid for sid, work in self._kept.items() if not work.has_unsaved()]
            for sid in done:
                del self._kept[sid]
        for sid in done:
            log.info("the results of shard %s, which could not be stored, are written; it is the sweeper's", sid)

    # ---- monitor ----

    def _monitor_loop(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.wait(MONITOR_SECONDS):
            if not self.engine_dead.is_set() and not self._alive():
                self._give_up_engine()
            self._watch_engine()
            self._let_go_kept()
            try:
                self._check_batches()
                if time.monotonic() - last_beat >= self.settings.heartbeat_seconds:
                    last_beat = time.monotonic()
                    self._beat()
            except OperationalError:
                log.warning("database unavailable in the monitor; retrying", exc_info=True)

    def _check_batches(self) -> None:
        works = self._held()
        if not works:
            return
        with self.ctx.sessions() as session:
            rows = {
                batch_id: (status, expires_at)
                for batch_id, status, expires_at in session.execute(
                    select(Batch.id, Batch.status, Batch.expires_at)
                    .where(Batch.id.in_({w.shard.batch_id for w in works}))
                )
            }
        t = now()
        for work in works:
            status, expires_at = rows.get(work.shard.batch_id, (None, work.shard.expires_at))
            if status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
                self._close(work, ErrorCode.BATCH_CANCELLED)
            elif status == BatchStatus.EXPIRED or t >= expires_at:
                self._close(work, ErrorCode.BATCH_EXPIRED)

    def _beat(self) -> None:
        works = self._held()
        if works and self._stalled():
            log.error("the engine returned nothing for %ds; leaving %d shards' leases to run out",
                      self.settings.lease_seconds, len(works))
            return
        held = leases.heartbeat(self.ctx, [w.shard.id for w in works], self.owner)
        for work in works:
            if work.shard.id not in held and not work.done.is_set():
                log.warning("lease of shard %s was taken away; dropping it", work.shard.id)
                self._close(work, None, lost=True)

    def _give_up_engine(self) -> None:
        """The engine thread is gone and nothing it held will come back: give the unfinished
        shards back to the queue now instead of heartbeating them until a stall shows. A shard
        that already has all its results is still stored by the finisher."""
        with self._lock:
            self.engine_dead.set()
            works = list(self._inflight.values())
        unfinished = [w for w in works if w.close(None, lost=True)]  # lost: this worker writes no objects
        self._save_results()  # while the leases are still ours
        try:
            released = leases.release(self.ctx, [w.shard.id for w in unfinished], self.owner)
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
