"""A shard's copies of one deterministic request (``ShardWork.coalesce``): the first runs, each copy
is answered with its result when it comes, in the same group of rows, charged nothing with the
usage it had counted as saved; an error of the first is each copy's error; a sampled request
without a seed and a request the cache may not key run as they are."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from batchapi.batches.leases import Claimed
from batchapi.engine import CompletionOutput, GenerationResult
from batchapi.engine import ErrorCode as EngineError
from batchapi.openai.errors import ErrorCode
from batchapi.openai.lines import parse_line
from batchapi.workers.codec import Codec
from batchapi.workers.shard_work import ShardWork

CHAT = "/v1/chat/completions"


def line(custom_id: str, content: str, **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                                **body}}).encode()


def shard_of(*lines: bytes) -> ShardWork:
    claimed = Claimed("shard_1", "batch_1", 0, 1, 0, 0, len(lines), 1, "in", CHAT, 2**40, model="m")
    return ShardWork(claimed, [parse_line(content, n + 1, CHAT) for n, content in enumerate(lines)])


def result(work: ShardWork, seq: int, error: bool = False) -> GenerationResult:
    if error:
        return GenerationResult(work.request_id(seq), 0, 0, [], error="the grammar was refused",
                                error_code=EngineError.INVALID_GRAMMAR)
    return GenerationResult(work.request_id(seq), 7, 0, [CompletionOutput(0, "Hi", [5, 6], "stop")])


def test_copies_run_once_and_are_answered_with_the_first(tiny_llama_dir):
    codec = Codec(AutoTokenizer.from_pretrained(tiny_llama_dir), "m", system_fingerprint="fp_test")
    work = shard_of(line("a-1", "Hi", temperature=0), line("s-1", "Tell", temperature=1.0),
                          line("a-2", "Hi", temperature=0), line("s-2", "Tell", temperature=1.0),
                     line("a-3", "Hi", temperature=0))
    to_run = work.coalesce(work.requests(codec, "fp_test"))
    assert [work.seq_of(r.request_id) for r in to_run] == [0, 1, 3]  # sampled copies without a seed both run
    assert work.copies == {2: 0, 4: 0}
    work.expect([r.request_id for r in to_run])
    assert work.take_unsaved() == []  # the copies are not refused while they wait

    assert not work.add(result(work, 0))
    assert work.take_unsaved() == [0, 2, 4]  # the first and its copies: one group of rows
    rows = {row.seq: row for row in work.finish(codec, [0, 2, 4])}
    first = json.loads(rows[0].line)
    assert rows[0].saved is None and rows[0].input_tokens == 7 and rows[0].output_tokens == 2
    for seq, custom_id in ((2, "a-2"), (4, "a-3")):
        copy = json.loads(rows[seq].line)
        assert copy["custom_id"] == custom_id and copy["response"]["body"] == first["response"]["body"]
        assert copy["id"] != first["id"]
        assert rows[seq].succeeded and rows[seq].input_tokens == rows[seq].output_tokens == 0  # charged nothing
        assert rows[seq].saved == (7, 0, 2)

    work.add(result(work, 1))
    assert work.add(result(work, 3))  # the last awaited
    rendered = work.render(codec)
    assert rendered.outcome.completed == 5 and rendered.outcome.input_tokens == 3 * 7
    assert rendered.outcome.saved == {2: (7, 0, 2), 4: (7, 0, 2)}
    output = [json.loads(x) for x in rendered.output.splitlines()]
    assert [x["custom_id"] for x in output] == ["a-1", "s-1", "a-2", "s-2", "a-3"]
    assert output[2]["response"]["body"] == output[0]["response"]["body"]  # the rows written, as written
    assert len(work.entries) == 1 and next(iter(work.entries.values())).output_tokens == 2  # the first's usage


def test_an_error_of_the_first_is_each_copys_error(tiny_llama_dir):
    codec = Codec(AutoTokenizer.from_pretrained(tiny_llama_dir), "m", system_fingerprint="fp_test")
    work = shard_of(line("j-1", "Hi", seed=3), line("j-2", "Hi", seed=3))
    to_run = work.coalesce(work.requests(codec, "fp_test"))
    work.expect([r.request_id for r in to_run])
    assert work.add(result(work, 0, error=True))
    rendered = work.render(codec)
    errors = [json.loads(x) for x in rendered.errors.splitlines()]
    assert [e["custom_id"] for e in errors] == ["j-1", "j-2"]
    assert errors[0]["response"]["body"] == errors[1]["response"]["body"]
    assert rendered.outcome.failed == 2 and rendered.outcome.saved == {}


def test_without_a_fingerprint_nothing_is_a_copy(tiny_llama_dir):
    codec = Codec(AutoTokenizer.from_pretrained(tiny_llama_dir), "m")
    work = shard_of(line("a-1", "Hi", temperature=0), line("a-2", "Hi", temperature=0))
    to_run = work.coalesce(work.requests(codec, None))  # the result cache off: every request runs
    assert len(to_run) == 2 and work.copies == {}


def test_a_copy_whose_first_never_finished_is_reported_with_the_reason(tiny_llama_dir):
    codec = Codec(AutoTokenizer.from_pretrained(tiny_llama_dir), "m", system_fingerprint="fp_test")
    work = shard_of(line("a-1", "Hi", temperature=0), line("a-2", "Hi", temperature=0))
    to_run = work.coalesce(work.requests(codec, "fp_test"))
    work.expect([r.request_id for r in to_run])
    assert work.close(ErrorCode.BATCH_CANCELLED) == [to_run[0].request_id]
    rendered = work.render(codec)
    assert rendered.outcome.failed == 2 and rendered.outcome.unrun == 2
    codes = [json.loads(x)["error"]["code"] for x in rendered.errors.splitlines()]
    assert codes == ["batch_cancelled", "batch_cancelled"]
