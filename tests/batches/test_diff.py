"""The diff without an engine, on ended batches written straight into the database and storage:
each kind of change, the listing's order and limit, what an input file that is gone or a sampled
request changes about a break, and what cannot be compared (the runs through the service:
tests/cli/test_batches_diff.py)."""

from __future__ import annotations

import io
import uuid
from decimal import Decimal

import pytest

from batchapi.batches.diff.compare import diff_batches
from batchapi.batches.files import delete_file, register_file, upload_file
from batchapi.db.clock import now
from batchapi.db.models import Batch
from batchapi.db.projects import get_or_create_project
from batchapi.db.session import session_scope
from batchapi.errors import Conflict, InvalidRequest, NotFound
from batchapi.openai import render
from batchapi.openai.embeddings import EMBEDDINGS
from batchapi.openai.errors import ErrorCode, RequestError
from tests.utils.batch_service import CHAT, jsonl, request_line


@pytest.fixture
def project(sqlite_jobs, request) -> str:
    with session_scope(sqlite_jobs.sessions) as session:
        return get_or_create_project(session, f"diff-{request.node.name}").id


def answer(custom_id: str, text: str, prompt: int = 10, completion: int = 3, fp: str = "fp_1") -> bytes:
    return render.succeeded(custom_id, {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": now(), "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": text, "refusal": None}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        "system_fingerprint": fp})


def refused(custom_id: str | None, param: str = "top_p") -> bytes:
    return render.rejected(custom_id, RequestError(f"bad {param}", param))


def ended(ctx, project: str, inputs: list[dict], results: list[bytes], endpoint: str = CHAT,
          status: str = "completed") -> str:
    """A batch ended in ``status`` over ``inputs``, its results split into output and error files."""
    bid, t = f"batch_{uuid.uuid4().hex}", now()
    input_id = upload_file(ctx, project, "in.jsonl", "batch", io.BytesIO(jsonl(inputs))).id
    files = {}
    with session_scope(ctx.sessions) as session:
        for name, lines in (("output", [r for r in results if b'"status_code":200' in r]),
                            ("errors", [r for r in results if b'"status_code":200' not in r])):
            if lines:
                key = f"test/{bid}/{name}.jsonl"
                size = ctx.storage.put_chunks(key, lines)
                files[name] = register_file(session, project, f"{bid}_{name}.jsonl", "batch_output", key, size).id
        session.add(Batch(id=bid, project_id=project, endpoint=endpoint, input_file_id=input_id,
                          completion_window="24h", status=status, created_at=t, expires_at=t + 3600,
                          output_file_id=files.get("output"), error_file_id=files.get("errors"),
                          request_total=len(inputs), price_input=Decimal(1), price_cached_input=Decimal(1),
                          price_output=Decimal(1), discount_percent=Decimal(50)))
    return bid


def greedy(custom_id: str, **body) -> dict:
    return request_line(custom_id, "m", f"Say {custom_id}.", **{"temperature": 0, **body})


def test_every_kind_of_change_in_the_listing_order(sqlite_jobs, project):
    inputs = [greedy(f"a{i}") for i in range(1, 8)]
    first = ended(sqlite_jobs, project, inputs, [
        answer("a1", "x"), answer("a2", "y", completion=3), refused("a3"), refused("a4"), answer("a5", "z"),
        answer("a6", "only here")])
    second = ended(sqlite_jobs, project, inputs, [
        answer("a1", "x"), answer("a2", "y", completion=5), render.never_ran("a3", ErrorCode.BATCH_EXPIRED),
        answer("a4", "now it runs"), answer("a5", "zz", prompt=12), answer("a7", "new"),
        render.never_ran(None, ErrorCode.SHARD_FAILED)])
    found = diff_batches(sqlite_jobs, project, first, second)
    assert [(d.custom_id, d.change.value, d.reproducibility_break) for d in found.data] == [
        ("a5", "output_changed", True), ("a4", "status_changed", False), ("a3", "error_changed", False),
        ("a6", "only_in_batch", False), ("a7", "only_in_against", False), ("a2", "usage_changed", False)]
    s = found.summary
    assert (s.batch_requests, s.against_requests, s.compared, s.identical, s.unnamed) == (6, 6, 5, 1, 1)
    assert (s.prompt_tokens_delta, s.completion_tokens_delta) == (2, 2)  # a1, a2 and a5: on both sides succeeded
    assert not found.reproducible and found.inputs_compared and not found.has_more
    a3 = found.data[2]
    assert (a3.batch.error_code, a3.against.error_code) == ("invalid_value", "batch_expired")
    assert a3.against.output == "batch_expired: The batch expired before this request finished."

    limited = diff_batches(sqlite_jobs, project, first, second, limit=2)
    assert [d.custom_id for d in limited.data] == ["a5", "a4"] and limited.has_more
    assert limited.summary == found.summary


def test_a_break_needs_the_same_fingerprint_request_and_a_fixed_draw(sqlite_jobs, project):
    inputs = [greedy("g"), request_line("s", "m", "Say s."), greedy("f"), greedy("q", max_tokens=5)]
    first = ended(sqlite_jobs, project, inputs, [answer("g", "1"), answer("s", "1"), answer("f", "1"),
                                                 answer("q", "1")])
    changed = [greedy("g"), request_line("s", "m", "Say s."), greedy("f"), greedy("q", max_tokens=6)]
    second = ended(sqlite_jobs, project, changed, [answer("g", "2"), answer("s", "2"), answer("f", "2", fp="fp_2"),
                                                   answer("q", "2")])
    by_id = {d.custom_id: d for d in diff_batches(sqlite_jobs, project, first, second).data}
    assert {k: d.reproducibility_break for k, d in by_id.items()} == {"g": True, "s": False, "f": False, "q": False}
    assert by_id["s"].deterministic is False  # sampled without a seed
    assert by_id["f"].same_fingerprint is False and by_id["q"].same_request is False

    # the first run's input file gone: requests are no longer known to be the same
    with sqlite_jobs.sessions() as session:
        input_id = session.get(Batch, first).input_file_id
    delete_file(sqlite_jobs, project, input_id)
    found = diff_batches(sqlite_jobs, project, first, second)
    assert not found.inputs_compared
    by_id = {d.custom_id: d for d in found.data}
    assert {k: d.reproducibility_break for k, d in by_id.items()} == {"g": True, "s": False, "f": False, "q": True}
    assert by_id["q"].same_request is None and by_id["q"].deterministic is True


def test_what_cannot_be_compared(sqlite_jobs, project):
    inputs = [greedy("a")]
    done = ended(sqlite_jobs, project, inputs, [answer("a", "x")])
    vectors = ended(sqlite_jobs, project, [request_line("a", "e", url=EMBEDDINGS)], [answer("a", "x")],
                    endpoint=EMBEDDINGS)
    with pytest.raises(InvalidRequest) as refused_endpoint:
        diff_batches(sqlite_jobs, project, done, vectors)
    assert refused_endpoint.value.param == "against"

    never_ran = ended(sqlite_jobs, project, inputs, [], status="failed")
    with pytest.raises(Conflict) as nothing:
        diff_batches(sqlite_jobs, project, never_ran, done)
    assert nothing.value.code == "invalid_state" and "ran no request" in nothing.value.message
    running = ended(sqlite_jobs, project, inputs, [], status="in_progress")
    with pytest.raises(Conflict):
        diff_batches(sqlite_jobs, project, done, running)

    with session_scope(sqlite_jobs.sessions) as session:
        other = get_or_create_project(session, "diff-someone-else").id
    theirs = ended(sqlite_jobs, other, inputs, [answer("a", "x")])
    with pytest.raises(NotFound) as not_ours:
        diff_batches(sqlite_jobs, project, done, theirs)
    assert not_ours.value.param == "against"

    gone = ended(sqlite_jobs, project, inputs, [answer("a", "x")])
    with sqlite_jobs.sessions() as session:
        output_id = session.get(Batch, gone).output_file_id
    delete_file(sqlite_jobs, project, output_id)
    with pytest.raises(NotFound) as deleted:
        diff_batches(sqlite_jobs, project, gone, done)
    assert deleted.value.param == "batch_id" and f"output file {output_id}" in deleted.value.message
