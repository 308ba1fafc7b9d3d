"""The key cache: a lookup is reused for BATCHAPI_AUTH_CACHE_SECONDS, and no longer."""

from __future__ import annotations

from batchapi.db.projects import KeyCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_key_is_remembered_until_its_seconds_pass():
    clock = Clock()
    cache = KeyCache(2.0, clock=clock)
    assert cache.get("sk-batch-a") is None
    cache.put("sk-batch-a", "proj_a")
    clock.now += 1.9
    assert cache.get("sk-batch-a") == "proj_a"
    assert cache.get("sk-batch-b") is None
    clock.now += 0.1
    assert cache.get("sk-batch-a") is None


def test_zero_seconds_remembers_nothing():
    cache = KeyCache(0.0)
    cache.put("sk-batch-a", "proj_a")
    assert cache.get("sk-batch-a") is None


def test_the_cache_holds_hashes_not_keys():
    cache = KeyCache(60.0)
    cache.put("sk-batch-secret", "proj_a")
    assert "sk-batch-secret" not in repr(vars(cache))


def test_a_full_cache_starts_over():
    cache = KeyCache(60.0)
    for i in range(KeyCache.MAX_ENTRIES):
        cache.put(f"sk-batch-{i}", "proj_a")
    cache.put("sk-batch-new", "proj_b")
    assert cache.get("sk-batch-new") == "proj_b"
    assert cache.get("sk-batch-0") is None
