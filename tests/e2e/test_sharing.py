"""Sharing one deployment, through the unmodified SDKs against a live server on PostgreSQL with the
embedded worker and the tiny model: quotas refused in OpenAI's shape (the batch failed) and in
Anthropic's (a 429 at create, or every request errored), the scheduling fields of a batch, a
spend cap that stops a batch with its finished work kept, and `batchapi projects`."""

from __future__ import annotations

import json
import logging

import anthropic
import httpx
import pytest
from openai import OpenAI

from batchapi import cli
from batchapi.batches.sharing import quotas
from batchapi.db.models import ApiKey, Batch
from batchapi.db.projects import hash_key
from batchapi.db.session import session_scope
from tests.utils.batch_service import embedded_stack, jsonl, new_key, request_line
from tests.utils.runs import held_batch
from tests.utils.waiting import wait_for_batch, wait_for_message_batch

SETTINGS = dict(shard_size=4, max_num_seqs=2, max_shards_in_flight=1, auth_required=True, result_flush_rows=1,
                price_input_per_mtok=1_000_000, price_cached_input_per_mtok=1_000_000,
                price_output_per_mtok=1_000_000)  # one currency unit a token: a cap is reached at once


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    with embedded_stack(tmp_path_factory.mktemp("sharing"), tiny_llama_dir, "sharing", **SETTINGS) as server:
        yield server


@pytest.fixture
def key(server, request) -> str:
    return new_key(server, f"project-{request.node.name}")


@pytest.fixture
def client(server, key) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def project_of(server, key: str) -> str:
    with server.ctx.sessions() as session:
        return session.query(ApiKey).filter_by(key_hash=hash_key(key)).one().project_id


def limit(server, key: str, **limits) -> None:
    with session_scope(server.ctx.sessions) as session:
        quotas.set_limits(session, project_of(server, key), quotas.EVERY_MODEL,
                          **{"enqueued_tokens": None, "unfinished_batches": None, **limits})


def create(client: OpenAI, model: str, n: int, **extra):
    lines = [request_line(f"r{i}", model, f"Count to {i}.", max_tokens=8) for i in range(n)]
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                                 extra_body=extra or None)


def test_over_the_enqueued_token_limit_the_batch_fails_as_openai_fails_it(server, client, key, model):
    limit(server, key, enqueued_tokens=20)  # two requests of max_tokens 8 and their prompts are more
    batch = wait_for_batch(client, create(client, model, 2).id)
    assert batch.status == "failed"
    [error] = batch.errors.data
    assert error.code == "token_limit_exceeded" and "Limit: 20 enqueued tokens" in error.message


def test_over_the_unfinished_batch_limit_a_batch_fails_and_runs_once_there_is_room(server, client, key, model):
    limit(server, key, unfinished_batches=1)
    file = client.files.create(file=("one.jsonl", jsonl([request_line("x", model)])), purpose="batch")
    held = held_batch(server, key, file.id, model)
    batch = wait_for_batch(client, create(client, model, 1).id)
    assert batch.status == "failed" and batch.errors.data[0].code == "batch_limit_exceeded"
    with session_scope(server.ctx.sessions) as session:  # the held batch ends: room for one again
        session.query(Batch).filter_by(id=held).update({"status": "completed"})
    assert wait_for_batch(client, create(client, model, 1).id).status == "completed"


def test_message_batches_are_refused_with_a_429_while_the_project_is_at_its_limit(server, client, key, model):
    limit(server, key, unfinished_batches=1)
    file = client.files.create(file=("one.jsonl", jsonl([request_line("x", model)])), purpose="batch")
    held_batch(server, key, file.id, model)
    answer = httpx.post(f"{server.base_url}/v1/messages/batches", headers={"x-api-key": key}, json={"requests": [
        {"custom_id": "a", "params": {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}}
    ]})
    assert answer.status_code == 429
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert "unfinished batches" in body["error"]["message"]


def test_a_message_batch_over_the_token_limit_ends_with_every_request_errored(server, key, model):
    limit(server, key, enqueued_tokens=10)
    client = anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)
    requests = [{"custom_id": f"m{i}", "params": {"model": model, "max_tokens": 8,
                                                  "messages": [{"role": "user", "content": f"Count to {i}."}]}}
                for i in range(3)]
    batch = wait_for_message_batch(client, client.messages.batches.create(requests=requests).id)
    assert batch.request_counts.errored == 3
    for item in client.messages.batches.results(batch.id):
        assert item.result.type == "errored" and "Enqueued token limit" in item.result.error.error.message


def test_a_batch_shows_its_scheduling_and_reaches_its_estimated_completion(server, client, model):
    batch = create(client, model, 8, priority=7)
    assert batch.model_extra["priority"] == 7 and batch.model_extra["max_cost"] is None
    done = wait_for_batch(client, batch.id)
    assert done.status == "completed" and done.model_extra["estimated_completion_at"] is None  # ended: none


def test_the_spend_cap_stops_the_batch_and_keeps_what_finished(server, client, model):
    batch = create(client, model, 24, max_cost="40")  # a request costs about 20 (prompt and 8 tokens, halved)
    assert batch.model_extra["max_cost"] == "40.00"
    batch = wait_for_batch(client, batch.id)
    assert batch.status == "cancelled"
    [error] = batch.errors.data
    assert error.code == "max_cost_reached" and "max_cost of 40.00" in error.message
    done = batch.request_counts.completed
    assert 1 <= done < 24 and batch.request_counts.failed == 24 - done
    assert float(batch.model_extra["cost"]["amount"]) >= 40
    outputs = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert len(outputs) == done and len(errors) == 24 - done
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert sorted(r["custom_id"] for r in outputs + errors) == sorted(f"r{i}" for i in range(24))


def test_bad_scheduling_fields_are_refused_with_their_param(server, client, model):
    file = client.files.create(file=("one.jsonl", jsonl([request_line("x", model)])), purpose="batch")
    for extra, param in (({"priority": 5000}, "priority"), ({"max_cost": "-1"}, "max_cost"),
                         ({"max_cost": "NaN"}, "max_cost")):
        answer = httpx.post(f"{server.base_url}/v1/batches", headers={"Authorization": f"Bearer {client.api_key}"},
                            json={"input_file_id": file.id, "endpoint": "/v1/chat/completions",
                                  "completion_window": "24h", **extra})
        assert answer.status_code == 400, (extra, answer.text)
        assert answer.json()["error"]["param"] == param


def dry_run(server, key: str, file_id: str, **extra) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/batches/dry_run", headers={"Authorization": f"Bearer {key}"},
                      json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", **extra}, timeout=60)


def test_a_dry_run_tells_exact_prompt_tokens_cost_completion_and_quota_and_runs_nothing(server, client, key, model):
    lines = [request_line(f"r{i}", model, f"Count to {i}, slowly.", max_tokens=8) for i in range(6)]
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    ran = wait_for_batch(client, client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                       completion_window="24h").id)
    assert ran.status == "completed"  # and the fleet has a measured rate now
    before = len(client.batches.list().data)
    answer = dry_run(server, key, file.id)
    assert answer.status_code == 200, answer.text
    run = answer.json()
    assert run["object"] == "batch.dry_run" and run["valid"] and run["errors"] is None
    assert run["request_counts"]["total"] == 6 and run["model"] == model
    assert run["prompt_tokens"] == ran.usage.input_tokens  # exact: what the engine was fed
    assert run["max_output_tokens"] == 6 * 8
    assert run["estimated_cost"]["amount"] == f"{(run['prompt_tokens'] + 48) / 2:.2f}"  # 1 a token, halved
    assert run["estimated_completion_at"] is not None and run["fleet_tokens_per_second"] > 0
    assert run["quota"] is None
    assert len(client.batches.list().data) == before  # nothing created
    limit(server, key, enqueued_tokens=10)
    assert dry_run(server, key, file.id).json()["quota"]["code"] == "token_limit_exceeded"


def test_a_dry_runs_quota_counts_what_the_start_counts(server, client, key, model):
    lines = [request_line(f"r{i}", model, "Say hello, twice.") for i in range(2)]  # no max_tokens: the context
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    run = dry_run(server, key, file.id).json()
    exact = run["prompt_tokens"] + run["max_output_tokens"]
    assert run["quota"] is None and run["enqueued_tokens"] > exact  # validation bounds prompts by their bytes
    limit(server, key, enqueued_tokens=exact)  # the exact counts fit, what the start counts does not
    run = dry_run(server, key, file.id).json()
    assert run["quota"]["code"] == "token_limit_exceeded"
    assert f"this batch: {run['enqueued_tokens']:,}" in run["quota"]["message"]
    batch = wait_for_batch(client, client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                         completion_window="24h").id)
    assert batch.status == "failed" and batch.errors.data[0].message == run["quota"]["message"]


def test_a_dry_run_of_a_bad_file_names_its_lines(server, client, key, model):
    good = json.dumps(request_line("a", model)).encode()
    file = client.files.create(file=("bad.jsonl", good + b"\n{not json\n"), purpose="batch")
    run = dry_run(server, key, file.id).json()
    assert run["valid"] is False
    assert run["errors"]["data"][0]["line"] == 2 and run["errors"]["data"][0]["code"] == "invalid_json_line"
    other = new_key(server, "someone-else")
    assert dry_run(server, other, file.id).status_code == 404  # another project's file


@pytest.fixture
def root_logger():
    """The CLI gives the root logger a handler on the test's captured stderr: put back what was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_submit_dry_run_and_projects_from_the_command_line(server, client, key, model, tmp_path, monkeypatch,
                                                            capsys, root_logger):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([request_line(f"r{i}", model, max_tokens=8) for i in range(3)]))
    monkeypatch.setenv("OPENAI_API_KEY", key)
    monkeypatch.setenv("BATCHAPI_DATABASE_URL", server.ctx.settings.database_url)
    assert cli.main(["submit", str(path), "--dry-run", "--base-url", server.base_url]) == 0
    out = capsys.readouterr().out
    assert "3 requests on" in out and "prompt tokens (exact)" in out and "estimated cost" in out
    project = f"project-{test_submit_dry_run_and_projects_from_the_command_line.__name__}"
    assert cli.main(["projects", "set", project, "--weight", "3"]) == 0
    assert cli.main(["projects", "quota", project, "--enqueued-tokens", "5"]) == 0
    capsys.readouterr()
    assert cli.main(["projects", "list", "--project", project, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["weight"] == 3 and row["quotas"][0]["model"] == "*"
    assert row["quotas"][0]["enqueued_tokens_limit"] == 5
    assert cli.main(["submit", str(path), "--dry-run", "--base-url", server.base_url]) == 1  # over its quota now
    assert "token_limit_exceeded" in capsys.readouterr().out
    assert cli.main(["projects", "quota", project, "--clear"]) == 0
    assert cli.main(["projects", "set", "nobody-here", "--weight", "2"]) == 1
