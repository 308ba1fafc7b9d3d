"""Reading one shard's requests back out of the batch's input file (its byte range only)."""

from __future__ import annotations

from batchapi.batches.leases import Claimed
from batchapi.openai.lines import InputLine, is_blank, iter_lines, parse_line
from batchapi.storage import Storage


def read_shard(storage: Storage, shard: Claimed, max_line_bytes: int | None = None) -> list[InputLine]:
    """The shard's request lines in input order. Validation already checked them, so a line
    that fails here again (a body rule or a limit that changed since) becomes that request's
    error."""
    chunks = storage.iter_chunks(shard.input_key, shard.start_byte, shard.end_byte)
    out = [
        parse_line(content, shard.first_line + number - 1, shard.endpoint)
        for number, _, _, content in iter_lines(chunks, max_line_bytes)
        if not is_blank(content)
    ]
    assert len(out) == shard.request_count, (
        f"shard {shard.id} holds {len(out)} requests, validation counted {shard.request_count}"
    )
    return out


def read_custom_ids(storage: Storage, shard: Claimed, max_line_bytes: int | None = None) -> list[str | None]:
    """Only the ``custom_id`` of each request (for closing a shard that never ran)."""
    return [line.custom_id for line in read_shard(storage, shard, max_line_bytes)]
