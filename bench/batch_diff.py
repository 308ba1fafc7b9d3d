"""Run-to-run diff over large result files: time and peak memory of ``batches.diff`` against a
naive peer (both output files parsed whole into dicts), same files, same run.

    .venv/bin/python bench/batch_diff.py [--requests 20000] [--answer-chars 400]

Two ended chat batches are written straight into a SQLite database and a local storage directory
(a temporary data dir): the same input file, answers of ``--answer-chars`` characters, one answer
in a thousand changed in the second run. Peak memory is Python's (tracemalloc), the storage read
included, measured on a second run of each. Printed, never asserted: timings are noisy.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tempfile
import time
import tracemalloc
import uuid
from decimal import Decimal
from pathlib import Path

from batchapi.batches.diff.compare import diff_batches
from batchapi.batches.diff.outcomes import model_output
from batchapi.batches.files import register_file, upload_file
from batchapi.config import load_settings
from batchapi.context import open_context
from batchapi.db.clock import now
from batchapi.db.migrate import upgrade
from batchapi.db.models import Batch, File
from batchapi.db.projects import get_or_create_project
from batchapi.db.session import session_scope
from batchapi.openai import render

WORDS = "the a batch of answers eval suite nightly run model token output changed same fingerprint".split()


def answer(custom_id: str, text: str) -> bytes:
    return render.succeeded(custom_id, {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": now(), "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": text, "refusal": None}}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 90, "total_tokens": 110}, "system_fingerprint": "fp_1"})


def write_run(ctx, project: str, input_id: str, answers: dict[str, str]) -> str:
    bid, t = f"batch_{uuid.uuid4().hex}", now()
    key = f"bench/{bid}/output.jsonl"
    size = ctx.storage.put_chunks(key, (answer(cid, text) for cid, text in answers.items()))
    with session_scope(ctx.sessions) as session:
        output = register_file(session, project, f"{bid}_output.jsonl", "batch_output", key, size)
        session.add(Batch(id=bid, project_id=project, endpoint="/v1/chat/completions", input_file_id=input_id,
                          completion_window="24h", status="completed", created_at=t, expires_at=t + 86400,
                          output_file_id=output.id, request_total=len(answers), price_input=Decimal(1),
                          price_cached_input=Decimal(1), price_output=Decimal(1), discount_percent=Decimal(50)))
    return bid


def naive(ctx, keys: list[str]) -> int:
    """The peer: both files read whole, every line parsed and kept, then compared."""
    runs = []
    for key in keys:
        text = b"".join(ctx.storage.iter_chunks(key))
        runs.append({r["custom_id"]: r for r in map(json.loads, text.splitlines())})
    first, second = runs
    return sum(model_output(first[c]["response"]["body"]) != model_output(r["response"]["body"])
               for c, r in second.items() if c in first)


def measure(action):
    """The result, the seconds of a plain run, the peak of a second run under tracemalloc (which
    slows allocations)."""
    start = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - start
    tracemalloc.start()
    action()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--answer-chars", type=int, default=400)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        settings = load_settings(data_dir=Path(tmp))
        upgrade(settings)
        ctx = open_context(settings)
        with session_scope(ctx.sessions) as session:
            project = get_or_create_project(session, "bench").id
        ids = [f"request-{i:07d}" for i in range(args.requests)]
        lines = b"".join(json.dumps({"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": "m", "temperature": 0, "messages": [{"role": "user", "content": f"Question {c}?"}]}}).encode()
            + b"\n" for c in ids)
        input_id = upload_file(ctx, project, "in.jsonl", "batch", io.BytesIO(lines)).id
        answers = {c: " ".join(rng.choice(WORDS) for _ in range(args.answer_chars // 5))[: args.answer_chars]
                   for c in ids}
        first = write_run(ctx, project, input_id, answers)
        second = write_run(ctx, project, input_id, {c: t + ("!" if i % 1000 == 0 else "")
                                                    for i, (c, t) in enumerate(answers.items())})
        with ctx.sessions() as session:
            keys = [session.get(File, session.get(Batch, b).output_file_id).storage_key for b in (first, second)]
        size = sum(ctx.storage.size(k) for k in keys)
        found, ours, our_peak = measure(lambda: diff_batches(ctx, project, first, second))
        changed, theirs, their_peak = measure(lambda: naive(ctx, keys))
        assert found.summary.output_changed == changed, (found.summary, changed)
        print(f"{args.requests} requests, two output files of {size / 2e6:.1f} MB each; {changed} changed")
        print(f"batches.diff: {ours:.2f} s, peak {our_peak / 1e6:.1f} MB")
        print(f"naive peer:   {theirs:.2f} s, peak {their_peak / 1e6:.1f} MB")
        print(f"ratio (peer / diff): time {theirs / ours:.2f}x, memory {their_peak / our_peak:.2f}x")
        ctx.close()


if __name__ == "__main__":
    main()
