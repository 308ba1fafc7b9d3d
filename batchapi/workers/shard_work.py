"""One claimed shard while its requests are in the engine: results in, result objects out.

Results arrive on the engine thread; ``close`` may come from the monitor (cancel, expiry, a
lost lease) at any moment. A lock orders the two, so a request either finished before the
close (its result is kept) or is reported with the close's reason, never both.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from batchapi.batches.leases import CUT_OFF, Claimed, Outcome
from batchapi.engine import GenerationResult
from batchapi.openai.errors import ErrorCode
from batchapi.openai.lines import InputLine
from batchapi.workers.codec import Codec


@dataclass
class Rendered:
    output: bytes
    errors: bytes
    outcome: Outcome


@dataclass
class ShardWork:
    shard: Claimed
    lines: list[InputLine]
    results: dict[str, GenerationResult] = field(default_factory=dict)  # request id -> result
    pending: set[str] = field(default_factory=set)
    reason: ErrorCode | None = None  # why it was closed early
    lost: bool = False  # the lease went to someone else: write nothing
    done: threading.Event = field(default_factory=threading.Event)  # no result awaited any more
    stored: threading.Event = field(default_factory=threading.Event)  # written and completed (or dropped)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request_id(self, line: InputLine) -> str:
        # the attempt keeps ids unique when this worker runs the shard again before old aborts land
        return f"{self.shard.id}:{self.shard.attempts}:{line.line}"

    def runnable(self) -> list[InputLine]:
        return [line for line in self.lines if line.body is not None]

    def expect(self, request_ids: list[str]) -> None:
        self.pending.update(request_ids)
        if not self.pending:
            self.done.set()

    def add(self, result: GenerationResult) -> bool:
        """Keep a result; True when it was the last one the shard waited for."""
        with self.lock:
            if self.done.is_set() or result.request_id not in self.pending:
                return False
            self.pending.discard(result.request_id)
            self.results[result.request_id] = result
            if self.pending:
                return False
            self.done.set()
            return True

    def close(self, reason: ErrorCode | None, lost: bool = False) -> list[str]:
        """Stop waiting: unfinished requests end with ``reason``. Returns their ids (to abort in
        the engine), or an empty list when the shard had already finished."""
        with self.lock:
            if self.done.is_set():
                return []
            self.reason, self.lost = reason, lost
            aborted, self.pending = sorted(self.pending), set()
            self.done.set()
            return aborted

    def render(self, codec: Codec) -> Rendered:
        """The output and error lines in input order."""
        output, errors = [], []
        completed = failed = unrun = input_tokens = cached = output_tokens = 0
        not_run = self.reason or ErrorCode.SHARD_FAILED
        for line in self.lines:
            result = self.results.get(self.request_id(line))
            rendered, ok = codec.line(line, result, not_run)
            if not ok:
                errors.append(rendered)
                failed += 1
                unrun += result is None and line.error is None and self.reason in CUT_OFF
                continue
            output.append(rendered)
            completed += 1
            input_tokens += result.prompt_tokens
            cached += result.cached_tokens
            output_tokens += result.completion_tokens
        outcome = Outcome(completed, failed, input_tokens, cached, output_tokens, self.reason, unrun)
        return Rendered(b"".join(output), b"".join(errors), outcome)
