"""The engine core in a child process: the same results as on a thread, a core killed with
``kill -9`` restarted with every request in flight delivered once, a core that keeps dying
given up on, a model the core cannot load refused in the parent."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest

from batchapi.engine import DuplicateRequestId, EngineConfig, EngineFront, GenerationRequest, SamplingParams
from batchapi.engine.core import CoreDied, EngineProcess
from batchapi.engine.model.loader import UnsupportedModelError
from tests.utils.waiting import wait_until


def config(model_dir) -> EngineConfig:
    return EngineConfig(model_path=model_dir, dtype="float32", kv_cache_bytes=4 << 20, max_num_seqs=4)


def requests(count: int) -> list[GenerationRequest]:
    """Greedy and seeded requests of growing length, some cut by a stop string."""
    out = []
    for i in range(count):
        params = SamplingParams(max_tokens=16 + 8 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True,
                                stop=["e"] if i % 3 == 0 else [])
        out.append(GenerationRequest(f"r{i}", [1, 2 + i, 3, 4 + 2 * i, 5], params))
    return out


def run_all(front, batch: list[GenerationRequest], on_first=None) -> tuple[dict, list[str]]:
    delivered, lock, first = [], threading.Lock(), threading.Event()

    def callback(result):
        with lock:
            delivered.append(result.request_id)
        first.set()

    futures = {r.request_id: front.submit(r, callback) for r in batch}
    if on_first is not None:
        assert first.wait(60), "no result came"
        on_first()
    return {rid: f.result(timeout=120) for rid, f in futures.items()}, delivered


def uncached(results: dict) -> dict:
    return {rid: dataclasses.replace(r, cached_tokens=0) for rid, r in results.items()}


@pytest.fixture(scope="module")
def on_a_thread(tiny_llama_dir) -> dict:
    with EngineFront(config(tiny_llama_dir)) as front:
        results, _ = run_all(front, requests(12))
    return results


def test_the_core_gives_the_results_the_thread_gives(tiny_llama_dir, on_a_thread):
    with EngineProcess(config(tiny_llama_dir)) as front:
        results, delivered = run_all(front, requests(12))
        assert front.pid != os.getpid() and front.restarts == 0
    # cached_tokens counts a prompt's tokens copied from a sequence running beside it: which ran
    # beside it depends on when each request arrived, in either door
    assert uncached(results) == uncached(on_a_thread)
    assert sorted(delivered) == sorted(on_a_thread)


def test_a_killed_core_is_restarted_and_every_request_is_delivered_once(tiny_llama_dir, on_a_thread):
    with EngineProcess(config(tiny_llama_dir)) as front:
        first_pid, unfinished = front.pid, []

        def kill():
            unfinished.append(front.num_in_flight())
            os.kill(first_pid, signal.SIGKILL)

        results, delivered = run_all(front, requests(12), on_first=kill)
        assert front.restarts == 1 and front.pid != first_pid and front.is_alive()
    assert unfinished[0] > 0, "every request finished before the kill: the test proved nothing"
    # the rerun requests give the same tokens and text (the new core's prefix cache starts empty)
    assert uncached(results) == uncached(on_a_thread)
    assert sorted(delivered) == sorted(on_a_thread)  # each callback once


def test_submit_many_queues_all_or_none(tiny_llama_dir):
    with EngineProcess(config(tiny_llama_dir)) as front:
        with pytest.raises(DuplicateRequestId, match="'twice'"):
            front.submit_many(requests(2) + [GenerationRequest("twice", [1, 2]), GenerationRequest("twice", [3])])
        assert front.num_in_flight() == 0
        results = [f.result(timeout=60) for f in front.submit_many(requests(3))]
    assert [r.request_id for r in results] == ["r0", "r1", "r2"]


def test_a_core_that_keeps_dying_is_given_up_and_its_requests_fail(tiny_llama_dir):
    with EngineProcess(config(tiny_llama_dir), max_restarts=1) as front:
        slow = [GenerationRequest(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=4000, ignore_eos=True,
                                                                     temperature=0.0)) for i in range(2)]
        futures = [front.submit(r) for r in slow]
        os.kill(front.pid, signal.SIGKILL)
        wait_until(lambda: front.restarts == 1, 120, 0.1, "the first restart")
        os.kill(front.pid, signal.SIGKILL)
        for future in futures:
            with pytest.raises(CoreDied, match="was not restarted"):
                future.result(timeout=120)
        assert not front.is_alive()
        with pytest.raises(RuntimeError, match="shut down"):
            front.submit(GenerationRequest("late", [1, 2], SamplingParams(max_tokens=2)))


def test_a_model_the_core_cannot_load_is_refused_in_the_parent(tmp_path, tiny_llama_dir):
    model = tmp_path / "odd"
    model.mkdir()
    for path in tiny_llama_dir.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    text = (model / "config.json").read_text().replace('"LlamaForCausalLM"', '"OddForCausalLM"')
    (model / "config.json").write_text(text)
    with pytest.raises(UnsupportedModelError, match="OddForCausalLM"):
        EngineProcess(config(model))
