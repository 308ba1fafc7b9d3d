"""One claimed shard while its requests are in the engine: results in, result rows and objects out.

Results arrive on the engine thread; ``close`` may come from the monitor (cancel, expiry, a
lost lease) at any moment. A lock orders the two, so a request either finished before the
close (its result is kept) or is reported with the close's reason, never both. Each kept
result waits in ``unsaved`` until the result writer makes it durable (``take_unsaved``); the
requests an earlier attempt already made durable (``earlier``) are not run again, nor are those
answered from the result cache (``cached``: they are made durable before the rest runs). A request
identical to an earlier one of the same shard (the same result cache key) does not run either: it
is answered with that request's result when it comes (``coalesce``), as the cache would answer it
in a later batch, and made durable with it.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field

from batchapi.batches import result_cache
from batchapi.batches.leases import CUT_OFF, Claimed, Outcome
from batchapi.batches.request_results import Finished
from batchapi.engine import ErrorCode as EngineError
from batchapi.engine import GenerationResult
from batchapi.openai import render as wire
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.lines import InputLine
from batchapi.openai.reasoning import reasoning_tokens
from batchapi.workers.codec import LineCodec

log = logging.getLogger(__name__)


def engine_failure(request_id: str, exc: BaseException) -> GenerationResult:
    """The result of a request whose future the engine failed (a crash, a shutdown)."""
    return GenerationResult(request_id, 0, 0, [], error=f"the engine failed while running this request: {exc}",
                            error_code=EngineError.ENGINE_FAILURE)


@dataclass
class Rendered:
    output: bytes
    errors: bytes
    outcome: Outcome


@dataclass
class ShardWork:
    shard: Claimed
    lines: list[InputLine]  # the shard's requests in input order: a request's seq is its index here
    earlier: dict[int, Finished] = field(default_factory=dict)  # seq -> made durable by an earlier attempt
    results: dict[int, GenerationResult] = field(default_factory=dict)  # seq -> this attempt's result
    pending: set[str] = field(default_factory=set)  # request ids awaited from the engine
    unsaved: list[int] = field(default_factory=list)  # seqs finished here and not yet durable
    finished: dict[int, Finished] = field(default_factory=dict)  # seq -> rendered by the result writer
    reason: ErrorCode | None = None  # why it was closed early
    lost: bool = False  # the lease went to someone else: write nothing
    kept: bool = False  # could not be stored: left to the sweeper, its results to the result writer
    done: threading.Event = field(default_factory=threading.Event)  # no result awaited any more
    stored: threading.Event = field(default_factory=threading.Event)  # written and completed (or dropped)
    lock: threading.Lock = field(default_factory=threading.Lock)
    keys: dict[int, str] = field(default_factory=dict)  # seq -> result cache key, of deterministic requests
    entries: dict[str, result_cache.Entry] = field(default_factory=dict)  # by ``render``: for the result cache
    copies: dict[int, int] = field(default_factory=dict)  # seq -> the seq of the identical request that runs
    followers: dict[int, list[int]] = field(default_factory=dict)  # that seq -> the seqs answered with it

    def request_id(self, seq: int) -> str:
        # the attempt keeps ids unique when this worker runs the shard again before old aborts land
        return f"{self.shard.id}:{self.shard.attempts}:{seq}"

    def seq_of(self, request_id: str) -> int:
        return int(request_id.rsplit(":", 1)[1])

    def to_run(self) -> list[tuple[int, InputLine]]:
        """The requests this attempt runs: those no earlier attempt finished. The lines that
        cannot run (refused by validation or by ``refuse``) are finished without the engine."""
        return [(seq, line) for seq, line in enumerate(self.lines) if seq not in self.earlier and line.body is not None]

    def requests(self, codec: LineCodec, fingerprint: str | None = None) -> list:
        """The engine requests of the lines ``to_run``; a line the codec cannot turn into one is
        refused instead, with that request's error. ``fingerprint``: the engine's
        ``system_fingerprint``, which keys the result cache (None: no cache)."""
        requests = []
        for seq, line in self.to_run():
            try:
                requests.append(codec.request(line, self.request_id(seq)))
                if (cache_key := result_cache.key(self.shard.model or "", fingerprint, line.body)) is not None:
                    self.keys[seq] = cache_key
            except RequestError as exc:  # options the model does not have: that request's error
                exc.custom_id = line.custom_id
                line.body, line.error = None, exc
            except ValueError as exc:  # sampling settings the engine refuses: that request's error
                line.body, line.error = None, RequestError(str(exc), custom_id=line.custom_id)
            except Exception as exc:  # the chat template failed on this request: its error, not the feeder's
                log.warning("could not build the engine request of line %d of shard %s", line.line, self.shard.id,
                            exc_info=True)
                line.body, line.error = None, RequestError(
                    f"the request could not be prepared for the model: {exc}", None, ErrorCode.SERVER_ERROR,
                    custom_id=line.custom_id)
        return requests

    def cached(self, hits: dict[str, result_cache.Entry]) -> dict[int, Finished]:
        """The rows of the requests ``hits`` answers: its response body under the line's
        custom_id (fresh line ids), no usage charged, the usage it had as ``saved``."""
        rows = {}
        for seq, cache_key in self.keys.items():
            entry = hits.get(cache_key)
            if entry is not None:
                line = wire.succeeded(self.lines[seq].custom_id, json.loads(entry.body))
                rows[seq] = Finished(seq, True, line,
                                     saved=(entry.input_tokens, entry.cached_tokens, entry.output_tokens))
        return rows

    def coalesce(self, requests: list) -> list:
        """The requests to run: of each group with one result cache key, the first; the others
        are answered with its result when it comes (``copies``)."""
        first: dict[str, int] = {}
        out = []
        for request in requests:
            seq = self.seq_of(request.request_id)
            cache_key = self.keys.get(seq)
            leader = first.setdefault(cache_key, seq) if cache_key is not None else seq
            if leader == seq:
                out.append(request)
            else:
                self.copies[seq] = leader
                self.followers.setdefault(leader, []).append(seq)
        return out

    def expect(self, request_ids: list[str]) -> None:
        """Await ``request_ids``; every other line not finished earlier (nor a copy of one of
        them) is finished now (refused)."""
        running = {self.seq_of(rid) for rid in request_ids} | set(self.copies)
        with self.lock:
            self.pending.update(request_ids)
            self.unsaved.extend(seq for seq in range(len(self.lines)) if seq not in self.earlier and seq not in running)
            if not self.pending:
                self.done.set()

    def add(self, result: GenerationResult) -> bool:
        """Keep a result; True when it was the last one the shard waited for."""
        with self.lock:
            if self.done.is_set() or result.request_id not in self.pending:
                return False
            self.pending.discard(result.request_id)
            seq = self.seq_of(result.request_id)
            for answered in (seq, *self.followers.get(seq, ())):  # durable together: one group of rows
                self.results[answered] = result
                self.unsaved.append(answered)
            if self.pending:
                return False
            self.done.set()
            return True

    def take_unsaved(self) -> list[int]:
        with self.lock:
            seqs, self.unsaved = self.unsaved, []
            return seqs

    def has_unsaved(self) -> bool:
        with self.lock:
            return bool(self.unsaved)

    def put_back(self, seqs: list[int]) -> None:
        """Writing them failed (the database was away): the next write tries again."""
        with self.lock:
            self.unsaved[:0] = seqs

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

    def finish(self, codec: LineCodec, seqs: list[int]) -> list[Finished]:
        """The result rows of finished requests (rendered once: ``render`` reuses them)."""
        rows = []
        for seq in seqs:
            row = self.finished.get(seq) or self._render(codec, seq, ErrorCode.SHARD_FAILED)
            self.finished[seq] = row
            rows.append(row)
        return rows

    def _render(self, codec: LineCodec, seq: int, not_run: ErrorCode) -> Finished:
        result = self.results.get(seq)
        if result is not None and seq in self.copies:
            return self._copy(codec, seq, not_run)
        rendered, ok = codec.line(self.lines[seq], result, not_run)
        if not ok:
            return Finished(seq, False, rendered)
        return Finished(seq, True, rendered, result.prompt_tokens, result.cached_tokens, result.completion_tokens,
                        reasoning_tokens=reasoning_tokens(result))

    def _copy(self, codec: LineCodec, seq: int, not_run: ErrorCode) -> Finished:
        """A copy's row: its first's response body (ids and usage included) under its own
        custom_id, charged nothing, its usage saved, as the result cache answers; or the
        first's error, under its own custom_id."""
        leader = self.copies[seq]
        row = self.finished.get(leader)
        if row is None:  # rendered once: the copies and the first carry the same body
            row = self.finished[leader] = self._render(codec, leader, not_run)
        if not row.succeeded:
            return Finished(seq, False, codec.line(self.lines[seq], self.results[seq], not_run)[0])
        body = json.loads(row.line)["response"]["body"]
        return Finished(seq, True, wire.succeeded(self.lines[seq].custom_id, body),
                        saved=(row.input_tokens, row.cached_tokens, row.output_tokens))

    def render(self, codec: LineCodec) -> Rendered:
        """The output and error lines in input order: earlier attempts' rows, this attempt's
        results, and the reason for the rest."""
        output, errors = [], []
        completed = failed = unrun = input_tokens = cached = output_tokens = reasoning = 0
        saved = {}
        not_run = self.reason or ErrorCode.SHARD_FAILED
        for seq, line in enumerate(self.lines):
            row = self.earlier.get(seq) or self.finished.get(seq)
            if row is None:
                row = self.finished[seq] = self._render(codec, seq, not_run)  # once: its copies carry its body
                never_ran = seq not in self.results and line.error is None and line.body is not None
                unrun += never_ran and self.reason in CUT_OFF
            if not row.succeeded:
                errors.append(row.line)
                failed += 1
                continue
            output.append(row.line)
            if row.saved is not None:
                saved[seq] = row.saved
            if seq in self.results and seq in self.keys and seq not in self.copies:  # run by this attempt: an entry
                body = json.loads(row.line)["response"]["body"]
                self.entries[self.keys[seq]] = result_cache.Entry(
                    json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(), row.input_tokens,
                    row.cached_tokens, row.output_tokens)
            completed += 1
            input_tokens += row.input_tokens
            cached += row.cached_tokens
            output_tokens += row.output_tokens
            reasoning += row.reasoning_tokens
        outcome = Outcome(completed, failed, input_tokens, cached, output_tokens, self.reason, unrun, saved,
                          reasoning_tokens=reasoning)
        return Rendered(b"".join(output), b"".join(errors), outcome)
