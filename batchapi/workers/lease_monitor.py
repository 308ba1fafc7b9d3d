"""The lease monitor: once a second, a shard runner's watch over the leases of what it holds.

- it aborts the requests of shards whose batch was cancelled or expired;
- every ``heartbeat_seconds`` it extends the leases; a shard whose lease was taken away is
  dropped without writing anything;
- it keeps the stall clock (``stalled``): an engine thread that lives but hangs has its leases
  left to run out, so other workers take its shards over.
Before that, each second, the runner's own ``tick`` runs (a dead engine given up, kept shards let
go). A database briefly away is logged and met again at the next tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from batchapi.background import Background
from batchapi.batches import leases
from batchapi.batches.states import BatchStatus
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.models import Batch
from batchapi.openai.errors import ErrorCode
from batchapi.workers.shard_work import ShardWork

log = logging.getLogger(__name__)

MONITOR_SECONDS = 1.0

Close = Callable[[ShardWork, ErrorCode | None, bool], None]


class LeaseMonitor:
    def __init__(self, ctx: Context, owner: str, fronts: list, held: Callable[[], list[ShardWork]], close: Close,
                 tick: Callable[[], None], stopping: threading.Event):
        """``fronts``: the runner's engine and encoder fronts; ``held``: its shards in flight;
        ``close(work, reason, lost)``: cut one short; ``stopping``: the runner's."""
        self.ctx, self.settings, self.owner = ctx, ctx.settings, owner
        self.fronts = fronts
        self._held, self._close, self._tick = held, close, tick
        self._last_progress = time.monotonic()  # when the engine's state last moved (or work arrived)
        self._engine_state: tuple = ()
        self._thread = Background("batchapi-monitor", self._loop, stopping=stopping)

    def start(self) -> LeaseMonitor:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._thread.stop(timeout)

    def stalled(self) -> bool:
        """The engine's queues and KV cache have not moved for a whole lease while requests are
        in flight: its thread hangs (a dead one is noticed at once, by the runner's ``tick``). Its
        leases are then left to run out, so other workers take the shards over."""
        return time.monotonic() - self._last_progress > self.settings.lease_seconds

    def moved(self) -> None:
        """Work arrived for an idle engine: the stall clock starts again."""
        self._last_progress = time.monotonic()

    def _watch_engine(self) -> None:
        state = tuple((f.num_waiting(), f.num_running(), f.kv_usage()) for f in self.fronts)
        if state != self._engine_state:
            self._engine_state = state
            self._last_progress = time.monotonic()

    def _loop(self) -> None:
        last_beat = time.monotonic()
        while not self._thread.stopping.wait(MONITOR_SECONDS):
            self._tick()
            self._watch_engine()
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
                self._close(work, ErrorCode.BATCH_CANCELLED, False)
            elif status == BatchStatus.EXPIRED or t >= expires_at:
                self._close(work, ErrorCode.BATCH_EXPIRED, False)

    def _beat(self) -> None:
        works = self._held()
        if works and self.stalled():
            log.error("the engine returned nothing for %ds; leaving %d shards' leases to run out",
                      self.settings.lease_seconds, len(works))
            return
        held = leases.heartbeat(self.ctx, [w.shard.id for w in works], self.owner)
        for work in works:
            if work.shard.id not in held and not work.done.is_set():
                log.warning("lease of shard %s was taken away; dropping it", work.shard.id)
                self._close(work, None, True)
