"""On the embedded default (SQLite, a local storage directory, the embedded worker): counts move
request by request inside one shard, a cancel mid-shard keeps what finished, ``POST
/v1/batches/{id}/retry`` re-runs exactly the rest and keeps its ``Idempotency-Key`` across a
restart, and ``batchapi batches list | show | cancel | download | retry`` do so over HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

from batchapi.cli import main
from tests.utils.batch_service import embedded_stack, jsonl, request_line, wait_until

SHARD = 24
SETTINGS = dict(shard_size=SHARD, max_num_seqs=2, kv_cache_gb=0.05, auth_required=False, result_flush_rows=2,
                result_flush_seconds=0.2)
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def lines_of(model: str, prefix: str, n: int = SHARD, max_tokens: int = 48) -> list[dict]:
    return [request_line(f"{prefix}-{i}", model, f"Count to {i}.", max_tokens=max_tokens, temperature=0,
                         ignore_eos=True) for i in range(n)]


def create(http: httpx.Client, lines: list[dict]) -> dict:
    file_id = http.post("/v1/files", files={"file": ("in.jsonl", jsonl(lines))}, data={"purpose": "batch"}).json()["id"]
    response = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h", "metadata": {"run": "nightly"}})
    assert response.status_code == 200, response.text
    return response.json()


def get(http: httpx.Client, batch_id: str) -> dict:
    return http.get(f"/v1/batches/{batch_id}").json()


def wait_done(http: httpx.Client, batch_id: str) -> dict:
    return wait_until(lambda: (b := get(http, batch_id))["status"] in TERMINAL and b, timeout=120, interval=0.1)


def failure_lines(capsys) -> list[str]:
    """The CLI's own lines on stderr (the worker in this process logs there too)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("batchapi ")]


def content(http: httpx.Client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in http.get(f"/v1/files/{file_id}/content").text.splitlines()]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("batches-cli")


@pytest.fixture(scope="module")
def server(data_dir, tiny_llama_dir):
    with embedded_stack(data_dir, tiny_llama_dir, None, **SETTINGS) as server:
        assert server.ctx.settings.sqlalchemy_url.startswith("sqlite")
        yield server


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.app.state.model.id


@pytest.fixture(scope="module")
def cancelled(server, model):
    """A one-shard batch cancelled once some of its requests finished, with the counts seen."""
    lines = lines_of(model, "c")
    seen = set()
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        batch = create(http, lines)

        def some_done() -> bool:
            b = get(http, batch["id"])
            seen.add(b["request_counts"]["completed"])
            return b["status"] == "in_progress" and b["request_counts"]["completed"] >= 4

        wait_until(some_done, timeout=120, interval=0.05)
        assert http.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
        batch = wait_done(http, batch["id"])
    assert batch["status"] == "cancelled", batch
    return batch, lines, seen


def test_a_cancel_mid_shard_keeps_what_finished(server, cancelled):
    batch, lines, seen = cancelled
    assert [c for c in seen if 0 < c < SHARD], f"no count between 0 and {SHARD}: {sorted(seen)}"
    with httpx.Client(base_url=server.base_url) as http:
        output, errors = content(http, batch["output_file_id"]), content(http, batch["error_file_id"])
    assert 4 <= len(output) < SHARD
    assert sorted(r["custom_id"] for r in output + errors) == sorted(line["custom_id"] for line in lines)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert batch["request_counts"] == {"total": SHARD, "completed": len(output), "failed": len(errors)}


def test_retry_through_the_cli_runs_exactly_the_rest_and_its_key_survives_a_restart(
        server, cancelled, data_dir, tiny_llama_dir, capsys):
    original, lines, _ = cancelled
    url = server.base_url + "/v1"
    assert main(["batches", "retry", original["id"], "--base-url", url, "--idempotency-key", "k-1", "--wait"]) == 0
    printed = capsys.readouterr().out
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        retries = [b for b in http.get("/v1/batches").json()["data"] if b.get("retry_of") == original["id"]]
        assert len(retries) == 1, retries
        retry = retries[0]
        assert retry["id"] in printed and retry["status"] == "completed"
        assert retry["metadata"] == {"run": "nightly"} and retry["completion_window"] == "24h"
        errors = content(http, original["error_file_id"])
        output = content(http, retry["output_file_id"])
        again = http.post(f"/v1/batches/{original['id']}/retry", headers={"Idempotency-Key": "k-1"})
        assert again.status_code == 200 and again.json()["id"] == retry["id"]
    unfinished = {e["custom_id"] for e in errors}
    assert [r["custom_id"] for r in output] == [line["custom_id"] for line in lines if line["custom_id"] in unfinished]
    assert retry["request_counts"] == {"total": len(unfinished), "completed": len(unfinished), "failed": 0}

    # a second server process on the same database: the key still names the same retry
    with embedded_stack(data_dir, tiny_llama_dir, None, **SETTINGS) as restarted:
        with httpx.Client(base_url=restarted.base_url, timeout=30) as http:
            again = http.post(f"/v1/batches/{original['id']}/retry", headers={"Idempotency-Key": "k-1"})
            assert again.status_code == 200 and again.json()["id"] == retry["id"]
            unknown = http.post("/v1/batches/batch_nope/retry")
            assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "batch_id"


def test_list_show_download_and_cancel(server, cancelled, model, tmp_path, capsys):
    original, _, _ = cancelled
    url = server.base_url + "/v1"
    assert main(["batches", "list", "--base-url", url]) == 0
    listing = capsys.readouterr().out
    assert original["id"] in listing and "cancelled" in listing

    assert main(["batches", "show", original["id"], "--base-url", url]) == 0
    shown = capsys.readouterr().out
    assert original["id"] in shown and "cancelled" in shown and "run=nightly" in shown
    assert f"{SHARD} total" in shown

    assert main(["batches", "download", original["id"], "-o", str(tmp_path / "out"), "--base-url", url]) == 0
    saved = capsys.readouterr().out
    counts = original["request_counts"]
    files = {p.name: len(p.read_bytes().splitlines()) for p in (tmp_path / "out").iterdir()}
    assert files == {f"{original['id']}_output.jsonl": counts["completed"],
                     f"{original['id']}_errors.jsonl": counts["failed"]}, saved

    # cancelling a completed batch is the API's 409, printed as such on stderr
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        completed = wait_done(http, create(http, lines_of(model, "d", n=2, max_tokens=2))["id"])
    assert completed["status"] == "completed"
    assert main(["batches", "cancel", completed["id"], "--base-url", url]) == 1
    [line] = failure_lines(capsys)
    assert line.startswith("batchapi batches cancel: ") and line.endswith(" (409 conflict)"), line

    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        running = create(http, lines_of(model, "w", n=4, max_tokens=64))["id"]
    assert main(["batches", "cancel", running, "--wait", "--base-url", url]) == 0
    followed = capsys.readouterr().out
    assert "cancel" in followed and running in followed
    with httpx.Client(base_url=server.base_url) as http:
        assert get(http, running)["status"] == "cancelled"
    assert main(["batches", "show", "batch_nope", "--base-url", url]) == 1
    assert failure_lines(capsys) == ["batchapi batches show: No batch found with id 'batch_nope' (404 not found); "
                                     "`batchapi batches list` shows the batches"]
