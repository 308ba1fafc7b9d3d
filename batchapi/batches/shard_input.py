"""Reading one shard's requests back out of the batch's input file (its byte range only)."""

from __future__ import annotations

from collections.abc import Iterator

from batchapi.batches.leases import Claimed
from batchapi.openai.lines import InputLine, LongLine, is_blank, iter_lines, parse_line
from batchapi.storage import Storage


def shard_contents(storage: Storage, key: str, start_byte: int, end_byte: int, first_line: int,
                   lines: tuple[int, ...] | list[int] | None,
                   max_line_bytes: int | None = None) -> Iterator[tuple[int, bytes | LongLine]]:
    """``(line number, content)`` of each request of a shard: every non-blank line of its byte
    range, or only ``lines`` where the range holds other models' requests too."""
    own = None if lines is None else frozenset(lines)
    chunks = storage.iter_chunks(key, start_byte, end_byte)
    for number, _, _, content in iter_lines(chunks, max_line_bytes):
        line = first_line + number - 1
        if not is_blank(content) and (own is None or line in own):
            yield line, content


def read_shard(storage: Storage, shard: Claimed, max_line_bytes: int | None = None) -> list[InputLine]:
    """The shard's request lines in input order. Validation already checked them, so a line
    that fails here again (a body rule or a limit that changed since) becomes that request's
    error."""
    contents = shard_contents(storage, shard.input_key, shard.start_byte, shard.end_byte, shard.first_line,
                              shard.lines, max_line_bytes)
    out = [parse_line(content, line, shard.endpoint) for line, content in contents]
    assert len(out) == shard.request_count, (
        f"shard {shard.id} holds {len(out)} requests, validation counted {shard.request_count}"
    )
    return out


def read_custom_ids(storage: Storage, shard: Claimed, max_line_bytes: int | None = None) -> list[str | None]:
    """Only the ``custom_id`` of each request (for closing a shard that never ran)."""
    return [line.custom_id for line in read_shard(storage, shard, max_line_bytes)]
