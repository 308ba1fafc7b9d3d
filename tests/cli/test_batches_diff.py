"""Run-to-run diff on PostgreSQL and S3, with the tiny model on the embedded worker: a rerun of the
same file is reproducible (exit 0); one answer changed under the same fingerprint is exactly one
reproducibility break (exit 3); a second run with a changed request, a fixed one, one dropped and
one added lists each as such; Message Batches compare by their own ids; a batch still running, or
another project's, cannot be compared (exit 4, the API's 409 and 404)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.utils.batch_service import embedded_stack, new_key, request_line
from tests.utils.runs import change_result, held_batch, run_file, upload
from tests.utils.waiting import wait_until

SETTINGS = dict(shard_size=8, max_num_seqs=4, kv_cache_gb=0.05, result_flush_rows=4, result_flush_seconds=0.2)


def lines(model: str, second: bool = False) -> list[dict]:
    """The first run's requests, or the second run's: r2 dropped, r3 asked for more tokens, the
    refused request fixed, r5 added."""
    ask = dict(max_tokens=4, temperature=0, ignore_eos=True)
    out = [request_line(f"r{i}", model, f"Say {i}.", **ask) for i in range(4) if not (second and i == 2)]
    if second:
        out[2] = request_line("r3", model, "Say 3.", **{**ask, "max_tokens": 8})
        out += [request_line("bad", model, "Say bad.", **ask), request_line("r5", model, "Say 5.", **ask)]
    else:
        out.append(request_line("bad", model, "Say bad.", frobnicate=1, **ask))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir, s3):
    """PostgreSQL and S3, as in production (the dashboard's test runs on the embedded default)."""
    with embedded_stack(tmp_path_factory.mktemp("diff-cli"), tiny_llama_dir, "diff_cli", s3, **SETTINGS) as server:
        yield server


@pytest.fixture(scope="module")
def runs(server):
    """A project's key and its batches: ``first``, ``rerun`` (the same file again), ``broken``
    (the same file again, r1's answer then changed in storage) and ``second`` (other requests)."""
    key = new_key(server, "diff-runs")
    model = server.app.state.model.id
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        file_id = upload(http, lines(model))
        first, rerun, broken = (run_file(http, file_id) for _ in range(3))
        second = run_file(http, upload(http, lines(model, second=True)))
    for batch in (first, rerun, broken, second):
        assert batch["status"] == "completed", batch
    change_result(server, broken["output_file_id"], "r1", "<b>not what it said</b>")
    return key, file_id, {"first": first["id"], "rerun": rerun["id"], "broken": broken["id"], "second": second["id"]}


def diff(server, key: str, a: str, b: str, **params) -> httpx.Response:
    return httpx.get(f"{server.base_url}/v1/batches/{a}/diff", params={"against": b, **params},
                     headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_a_rerun_is_reproducible(server, runs, cli):
    key, _, ids = runs
    found = diff(server, key, ids["first"], ids["rerun"]).json()
    assert found["reproducible"] and found["inputs_compared"] and found["data"] == []
    assert found["summary"]["identical"] == 5
    assert found["summary"]["compared"] == 5 and found["summary"]["prompt_tokens_delta"] == 0
    [fingerprint] = found["system_fingerprints"]["batch"]
    assert found["system_fingerprints"]["against"] == [fingerprint]

    ran = cli("batches", "diff", ids["first"], ids["rerun"], "--base-url", server.base_url, "--api-key", key)
    assert ran.code == 0, ran
    assert "reproducible: no output changed" in ran.out


def test_one_changed_answer_is_exactly_one_reproducibility_break(server, runs, cli):
    key, _, ids = runs
    found = diff(server, key, ids["first"], ids["broken"]).json()
    assert not found["reproducible"]
    summary = found["summary"]
    assert (summary["compared"], summary["identical"], summary["output_changed"], summary["reproducibility_breaks"]) \
        == (5, 4, 1, 1)
    assert summary["status_changed"] + summary["only_in_batch"] + summary["only_in_against"] == 0
    [entry] = found["data"]
    assert entry["custom_id"] == "r1" and entry["change"] == "output_changed" and entry["reproducibility_break"]
    assert (entry["same_fingerprint"], entry["same_request"], entry["deterministic"]) == (True, True, True)
    assert entry["against"]["output"] == "<b>not what it said</b>" and entry["batch"]["output"] != entry["against"]["output"]
    assert entry["prompt_tokens_delta"] == 0 and entry["completion_tokens_delta"] == 0

    ran = cli("batches", "diff", ids["first"], ids["broken"], "--base-url", server.base_url, "--api-key", key)
    assert ran.code == 3, ran
    assert "reproducibility break" in ran.out and "r1" in ran.out and "BREAK" in ran.out
    ran = cli("batches", "diff", ids["first"], ids["broken"], "--json", "--base-url", server.base_url,
              "--api-key", key)
    assert ran.code == 3 and json.loads(ran.out)["data"][0]["custom_id"] == "r1"


def test_changed_requests_one_side_only_and_failed_against_succeeded(server, runs, cli):
    key, _, ids = runs
    found = diff(server, key, ids["first"], ids["second"]).json()
    by_id = {d["custom_id"]: d for d in found["data"]}
    assert {d: by_id[d]["change"] for d in by_id} == {"r3": "output_changed", "bad": "status_changed",
                                                       "r2": "only_in_batch", "r5": "only_in_against"}
    r3 = by_id["r3"]
    # a changed request is no break, even under the same fingerprint
    assert r3["same_request"] is False and r3["same_fingerprint"] is True and not r3["reproducibility_break"]
    assert (r3["prompt_tokens_delta"], r3["completion_tokens_delta"]) == (0, 4)
    bad = by_id["bad"]
    assert bad["batch"]["status"] == "failed" and bad["batch"]["error_code"] == "unknown_parameter"
    assert bad["against"]["status"] == "succeeded" and bad["prompt_tokens_delta"] is None
    assert by_id["r2"]["against"] is None and by_id["r2"]["batch"]["status"] == "succeeded"
    assert by_id["r5"]["batch"] is None and by_id["r5"]["against"]["completion_tokens"] == 4
    summary = found["summary"]
    assert (summary["batch_requests"], summary["against_requests"], summary["compared"], summary["identical"]) \
        == (5, 5, 4, 2)
    assert summary["completion_tokens_delta"] == 4 and summary["reproducibility_breaks"] == 0
    assert found["reproducible"] and not found["has_more"]

    limited = diff(server, key, ids["first"], ids["second"], limit=2).json()
    assert [d["custom_id"] for d in limited["data"]] == ["r3", "bad"] and limited["has_more"]

    ran = cli("batches", "diff", ids["first"], ids["second"], "--base-url", server.base_url, "--api-key", key)
    assert ran.code == 0, ran
    assert all(name in ran.out for name in ("only_in_batch", "only_in_against", "status_changed", "r5"))


def test_a_running_batch_or_another_projects_cannot_be_compared(server, runs, cli):
    key, file_id, ids = runs
    running = held_batch(server, key, file_id, server.app.state.model.id)
    answer = diff(server, key, ids["first"], running)
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "invalid_state"
    assert answer.json()["error"]["param"] == "against"
    ran = cli("batches", "diff", running, ids["first"], "--base-url", server.base_url, "--api-key", key)
    assert ran.code == 4, ran
    assert ran.err == [f"batchapi batches diff: Batch {running} is in_progress: only a batch that has ended "
                       "(completed, failed, expired or cancelled) can be compared (409 conflict)"]

    other = new_key(server, "diff-other")
    theirs = held_batch(server, other, file_id, server.app.state.model.id)
    for a, b, param in ((ids["first"], ids["rerun"], "batch_id"), (ids["first"], theirs, "against")):
        answer = diff(server, other if param == "batch_id" else key, a, b)
        assert answer.status_code == 404 and answer.json()["error"]["param"] == param, answer.text
    ran = cli("batches", "diff", ids["first"], ids["rerun"], "--base-url", server.base_url, "--api-key", other)
    assert ran.code == 4 and "404 not found" in ran.err[0], ran
    assert diff(server, key, ids["first"], ids["rerun"], limit=0).status_code == 400
    ran = cli("batches", "diff", ids["first"], ids["rerun"], "--base-url", "http://127.0.0.1:1", "--api-key", key)
    assert ran.code == 4 and "cannot reach http://127.0.0.1:1/v1" in ran.err[0], ran


def test_message_batches_compare_by_their_own_ids(server, runs):
    key, _, _ = runs
    model = server.app.state.model.id
    headers = {"x-api-key": key}

    def run(tokens: int) -> str:
        params = [{"model": model, "max_tokens": n, "temperature": 0,
                   "messages": [{"role": "user", "content": f"Say {i}."}]} for i, n in ((1, 4), (2, tokens))]
        created = httpx.post(f"{server.base_url}/v1/messages/batches", headers=headers, json={
            "requests": [{"custom_id": f"m{i}", "params": p} for i, p in enumerate(params, start=1)]})
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        wait_until(lambda: httpx.get(f"{server.base_url}/v1/messages/batches/{batch_id}",
                                     headers=headers).json()["processing_status"] == "ended", timeout=300, interval=0.1)
        return batch_id

    first, second = run(4), run(8)
    assert first.startswith("msgbatch_")
    found = diff(server, key, first, second).json()
    [entry] = found["data"]
    assert entry["custom_id"] == "m2" and entry["change"] == "output_changed" and entry["same_request"] is False
    assert entry["same_fingerprint"] is None and not entry["reproducibility_break"]  # a Message has no fingerprint
    assert entry["completion_tokens_delta"] > 0 and found["summary"]["identical"] == 1 and found["reproducible"]
    assert diff(server, key, first, first).json()["summary"]["identical"] == 2
