"""The engine's two doors, EngineFront (a thread) and EngineProcess (a child process): submit from
many threads, futures and callbacks, abort, capacity readings, the same for both."""

from __future__ import annotations

import threading

import pytest

from batchapi.engine import (
    DuplicateRequestId,
    EngineConfig,
    EngineFront,
    ErrorCode,
    GenerationRequest,
    SamplingParams,
)
from batchapi.engine.core import EngineProcess


@pytest.fixture(scope="module", params=["thread", "process"])
def front(request, tiny_llama_dir):
    config = EngineConfig(model_path=tiny_llama_dir, dtype="float32", kv_cache_bytes=4 << 20, max_num_seqs=4)
    front = (EngineFront if request.param == "thread" else EngineProcess)(config).start()
    yield front
    front.shutdown()


def request(request_id: str, max_tokens: int = 6, text: str = "Hello there") -> GenerationRequest:
    return GenerationRequest(request_id, [1, 2, 3, len(request_id) + 10],
                             SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_submit_from_threads_resolves_every_future_and_callback(front):
    seen, lock = [], threading.Lock()

    def on_done(result):
        with lock:
            seen.append(result.request_id)

    futures = {}

    def submit(prefix):
        for i in range(5):
            rid = f"{prefix}-{i}"
            futures[rid] = front.submit(request(rid), callback=on_done)

    threads = [threading.Thread(target=submit, args=(p,)) for p in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = {rid: f.result(timeout=60) for rid, f in futures.items()}
    assert all(r.request_id == rid and r.completion_tokens == 6 for rid, r in results.items())
    assert sorted(seen) == sorted(futures)
    assert front.num_waiting() == 0 and front.num_running() == 0 and front.kv_usage() == 0.0


def test_duplicate_in_flight_id_is_refused(front):
    first = front.submit(request("dup", max_tokens=40))
    with pytest.raises(DuplicateRequestId, match="already in flight"):
        front.submit(request("dup"))
    first.result(timeout=60)


def test_abort_resolves_the_future_with_an_error(front):
    blocker = front.submit(request("long", max_tokens=400))
    front.abort("long")
    result = blocker.result(timeout=60)
    assert result.error == "aborted" and result.outputs[0].finish_reason == "error"
    assert result.error_code is ErrorCode.ABORTED
    assert front.submit(request("after")).result(timeout=60).error is None


def test_a_malformed_request_fails_alone_and_the_engine_keeps_serving(front):
    broken = GenerationRequest("broken", None, SamplingParams(max_tokens=4, temperature=0.0))
    failed = front.submit(broken)
    with pytest.raises(TypeError):
        failed.result(timeout=60)
    assert front.is_alive()
    after = front.submit(request("after-broken", max_tokens=3)).result(timeout=60)
    assert after.completion_tokens == 3 and after.error is None



def test_submit_many_resolves_each_future(front):
    futures = front.submit_many([request(f"many-{i}", max_tokens=3) for i in range(5)])
    assert [f.result(timeout=60).completion_tokens for f in futures] == [3] * 5
