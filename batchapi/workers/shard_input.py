"""Reading one shard's requests back out of the batch's input file (its byte range only)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from batchapi.jobs.request_body import BodyError, ParsedBody, parse_body
from batchapi.jobs.storage import Storage
from batchapi.jobs.validation import iter_lines
from batchapi.workers.leases import Claimed


@dataclass
class InputLine:
    line: int  # 1-based line number in the input file
    custom_id: str
    parsed: ParsedBody | None  # None when the body failed to parse (``error`` says why)
    error: BodyError | None = None


def read_shard(storage: Storage, shard: Claimed) -> list[InputLine]:
    """The shard's request lines in input order. Validation already checked them, so a line
    that fails here again (a body rule that changed since) becomes that request's error."""
    chunks = storage.iter_chunks(shard.input_key, shard.start_byte, shard.end_byte)
    out = []
    for number, _, _, content in iter_lines(chunks):
        if not content.strip():
            continue
        record = json.loads(content)
        line = InputLine(shard.first_line + number - 1, record["custom_id"], None)
        try:
            line.parsed = parse_body(shard.endpoint, record.get("body"))
        except BodyError as exc:
            line.error = exc
        out.append(line)
    assert len(out) == shard.request_count, (
        f"shard {shard.id} holds {len(out)} requests, validation counted {shard.request_count}"
    )
    return out


def read_custom_ids(storage: Storage, shard: Claimed) -> list[str]:
    """Only the ``custom_id`` of each request (for closing a shard that never ran)."""
    chunks = storage.iter_chunks(shard.input_key, shard.start_byte, shard.end_byte)
    return [json.loads(content)["custom_id"] for _, _, _, content in iter_lines(chunks) if content.strip()]
