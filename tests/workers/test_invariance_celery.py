"""Batch invariance through the production path: the same file run by one Celery worker and by two
(other shards in each engine, other steps, other rows) gives every request the same answer."""

from __future__ import annotations

import pytest

from tests.utils.batch_service import request_line
from tests.utils.waiting import wait_for_batch
from tests.workers.helpers import results, submit

pytestmark = pytest.mark.slow


def lines(model: str) -> list[dict]:
    out = []
    for i in range(36):
        sampling = dict(temperature=0, logprobs=True, top_logprobs=2) if i % 2 else dict(temperature=1.0, seed=500 + i)
        out.append(request_line(f"r{i}", model, f"Item {i}: " + "tell me more. " * (i % 7), max_tokens=3 + i % 9,
                                **sampling))
    return out


def answers(cluster, workers: int, model: str) -> dict[str, tuple]:
    names = [cluster.start_worker() for _ in range(workers)]
    for name in names:
        cluster.wait_ready(name)
    try:
        with cluster.http() as http:
            batch = wait_for_batch(http, submit(http, lines(model)), timeout=240)
            assert batch["status"] == "completed", batch
            output, errors = results(http, batch)
    finally:
        cluster.stop_workers()
    assert errors == [] and len(output) == 36
    out = {}
    for line in output:
        body = line["response"]["body"]
        choice = body["choices"][0]
        out[line["custom_id"]] = (choice["message"]["content"], repr(choice.get("logprobs")),
                                  body["usage"]["completion_tokens"], body["system_fingerprint"])
    return out


def test_one_worker_and_two_give_every_request_the_same_answer(cluster):
    model = cluster.server.app.state.model.id
    one = answers(cluster, 1, model)
    two = answers(cluster, 2, model)
    assert one == two
    assert len({fingerprint for *_, fingerprint in one.values()}) == 1
