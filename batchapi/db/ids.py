"""Identifiers in the OpenAI style (``file-…``, ``batch_…``)."""

from __future__ import annotations

import secrets
import time


def new_id(prefix: str) -> str:
    """Time-ordered (microseconds, then random), so listings created in one second keep
    their order when sorted by (created_at, id)."""
    return f"{prefix}{time.time_ns() // 1000:013x}{secrets.token_hex(6)}"


def file_id() -> str:
    return new_id("file-")


def batch_id() -> str:
    return new_id("batch_")


def shard_id(batch: str, index: int) -> str:
    return f"{batch}_{index:05d}"
