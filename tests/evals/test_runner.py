"""The backend's batches: lines packed into files within the file limits, results mapped back by
``custom_id``, and a request without a result failing the run with its ``custom_id`` and error."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from openai import OpenAI

from batchapi.evals.runner import BatchRunner, EvalRequestFailed, Limits, encode_line, error_text, split_files


def lines_of(files: list[bytes]) -> list[list[str]]:
    return [[json.loads(raw)["custom_id"] for raw in data.splitlines()] for data in files]


def test_files_keep_within_lines_and_bytes_in_order():
    lines = [encode_line(f"r{i}", {"model": "m", "prompt": [1] * (i + 1)}) for i in range(7)]
    by_three = [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    assert lines_of(list(split_files(lines, Limits(max_lines=3)))) == by_three
    limit = len(lines[0]) + len(lines[1])  # the first two fit together, the third does not
    files = list(split_files(lines, Limits(max_bytes=limit + len(lines[2]) - 1)))
    assert lines_of(files)[0] == ["r0", "r1"]
    assert all(len(data) <= limit + len(lines[2]) - 1 for data in files)
    assert b"".join(files) == b"".join(lines)


def test_a_line_over_the_byte_limit_is_refused_before_anything_is_sent():
    line = encode_line("big", {"model": "m", "prompt": "x" * 100})
    with pytest.raises(ValueError, match="over the file limit"):
        list(split_files([line], Limits(max_bytes=50)))


def test_error_lines_say_what_failed():
    refused = {"custom_id": "a", "response": {"status_code": 400, "body": {"error": {
        "message": "prompt too long", "type": "invalid_request_error", "param": "prompt",
        "code": "context_length_exceeded"}}},
        "error": None}
    expired = {"custom_id": "b", "response": None,
               "error": {"code": "batch_expired", "message": "The batch expired before this request finished."}}
    assert error_text(refused) == "context_length_exceeded: prompt too long"
    assert error_text(expired) == "batch_expired: The batch expired before this request finished."


@pytest.fixture
def runner(server):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    return BatchRunner(client, Limits(max_lines=2), poll_seconds=0.2)


def test_a_call_split_into_batches_maps_every_result_back(runner, served_model):
    before = len(runner.client.batches.list(limit=100).data)
    bodies = {f"g{i}": {"model": served_model, "prompt": [100 + i, 200, 300], "max_tokens": 2 + i % 3,
                        "temperature": 0} for i in range(5)}
    results = runner.run(bodies, desc="test")
    assert len(runner.client.batches.list(limit=100).data) - before == 3  # 2 + 2 + 1 lines
    assert sorted(results) == sorted(bodies)
    for custom_id, body in bodies.items():
        assert results[custom_id]["usage"]["prompt_tokens"] == 3
        assert results[custom_id]["usage"]["completion_tokens"] <= body["max_tokens"]


# the first refused when the file is validated (a batch that fails, naming the line), the second
# when its request is read (a 400 line in the error file, the rest of the batch runs)
@pytest.mark.parametrize(("prompt", "code"),
                         [([100] * 600, "context_length_exceeded"), ([10**7, 5], "invalid_value")],
                         ids=["too-long", "unknown-token"])
def test_a_refused_request_fails_the_run_with_its_custom_id(runner, served_model, prompt, code):
    bodies = {"fine": {"model": served_model, "prompt": [100, 200], "max_tokens": 2, "temperature": 0},
              "refused": {"model": served_model, "prompt": prompt, "max_tokens": 2, "temperature": 0}}
    with pytest.raises(EvalRequestFailed) as failed:
        runner.run(bodies, desc="test")
    assert failed.value.custom_id == "refused"
    assert failed.value.error.startswith(f"{code}: ")
    assert str(failed.value).startswith("request refused failed: ")


def test_a_failed_run_cancels_the_batches_it_left_running(server, served_model):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    runner = BatchRunner(client, Limits(max_lines=1), poll_seconds=0.1)  # a batch per request
    long = {"model": served_model, "prompt": [100, 200], "max_tokens": 480, "ignore_eos": True, "temperature": 0}
    bodies = {"refused": {"model": served_model, "prompt": [100] * 600, "max_tokens": 2}}
    bodies.update({f"long-{i}": dict(long, seed=i) for i in range(4)})
    with pytest.raises(EvalRequestFailed, match="request refused failed"):
        runner.run(bodies, desc="test")
    statuses = [b.status for b in client.batches.list(limit=5).data][:4]  # newest first: the four long ones
    assert "cancelling" in statuses or "cancelled" in statuses, statuses
    assert set(statuses) <= {"cancelling", "cancelled", "completed"}, statuses


def test_polls_start_short_and_double_up_to_poll_seconds(server, served_model, monkeypatch):
    from batchapi.evals import runner as runner_module

    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        time.sleep(seconds)

    # the runner's own module name only: the live server's threads keep the real ``time.sleep``
    monkeypatch.setattr(runner_module, "time", SimpleNamespace(sleep=sleep))
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    runner = BatchRunner(client, poll_seconds=0.2)
    # sampled without a seed (never from the result cache), long enough to be polled several times
    body = {"model": served_model, "prompt": [100, 200], "max_tokens": 400, "ignore_eos": True, "temperature": 0.7}
    results = runner.run({"one": body}, desc="test")
    assert results["one"]["usage"]["completion_tokens"] == 400
    first = runner_module.FIRST_POLL_SECONDS
    assert len(waits) >= 4, waits  # 0.05, 0.1, 0.2, 0.2, ...
    assert waits == [min(first * 2**i, 0.2) for i in range(len(waits))]
