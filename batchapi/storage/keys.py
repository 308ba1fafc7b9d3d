"""Every object key, built here and nowhere else.

Keys are fixed per object: a retried writer overwrites its own object, never appends to it; a
shard's objects are fixed per attempt, so no two attempts share one.
"""

from __future__ import annotations


def file_key(file_id: str) -> str:
    """An uploaded file's content."""
    return f"files/{file_id}"


def shard_output_key(batch_id: str, index: int, attempt: int, closing: bool = False) -> str:
    """A shard's output lines as one attempt wrote them. Each attempt writes its own objects and
    ``leases.complete`` records the keys of the one that completed the shard, so a stalled writer
    of an earlier attempt cannot replace them; ``closing``: the sweeper's (it starts no attempt).
    Shards completed before keys carried the attempt keep their recorded ``{index}.output.jsonl``."""
    return f"batches/{batch_id}/shards/{index:05d}.{_writer(attempt, closing)}.output.jsonl"


def shard_error_key(batch_id: str, index: int, attempt: int, closing: bool = False) -> str:
    """A shard's error lines as one attempt wrote them (see ``shard_output_key``)."""
    return f"batches/{batch_id}/shards/{index:05d}.{_writer(attempt, closing)}.error.jsonl"


def superseded_shard_keys(batch_id: str, index: int, attempt: int, closing: bool = False) -> list[str]:
    """The objects other writers of a shard may have left once ``attempt`` (the sweeper's if
    ``closing``) has completed it: every earlier attempt's, run or closed (a worker that died
    after writing, a closer that lost its lease), and for a closer the attempt it took over.
    Nothing reads them: the shard names the completed writer's keys."""
    writers = [(n, c) for n in range(1, attempt) for c in (False, True)] + ([(attempt, False)] if closing else [])
    return [make(batch_id, index, n, c) for n, c in writers for make in (shard_output_key, shard_error_key)]


def _writer(attempt: int, closing: bool) -> str:
    return f"a{attempt}" + ("-closed" if closing else "")


def batch_output_key(batch_id: str) -> str:
    """The merged output file of a finished batch."""
    return f"batches/{batch_id}/output.jsonl"


def batch_error_key(batch_id: str) -> str:
    """The merged error file of a finished batch."""
    return f"batches/{batch_id}/errors.jsonl"


def upload_part_key(upload_id: str, part_id: str) -> str:
    """One part of an Upload, until the Upload is completed (into ``file_key``) or given up."""
    return f"uploads/{upload_id}/{part_id}"
