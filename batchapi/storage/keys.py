"""Every object key, built here and nowhere else.

Keys are fixed per object: a retried writer overwrites its own object, never appends to it.
"""

from __future__ import annotations


def file_key(file_id: str) -> str:
    """An uploaded file's content."""
    return f"files/{file_id}"


def shard_output_key(batch_id: str, index: int) -> str:
    return f"batches/{batch_id}/shards/{index:05d}.output.jsonl"


def shard_error_key(batch_id: str, index: int) -> str:
    return f"batches/{batch_id}/shards/{index:05d}.error.jsonl"


def batch_output_key(batch_id: str) -> str:
    """The merged output file of a finished batch."""
    return f"batches/{batch_id}/output.jsonl"


def batch_error_key(batch_id: str) -> str:
    """The merged error file of a finished batch."""
    return f"batches/{batch_id}/errors.jsonl"


def upload_part_key(upload_id: str, part_id: str) -> str:
    """One part of an Upload, until the Upload is completed (into ``file_key``) or given up."""
    return f"uploads/{upload_id}/{part_id}"
