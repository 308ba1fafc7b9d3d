"""run_batch and the codec: a JSONL batch file through a real engine on a tiny model."""

from __future__ import annotations

import json
import os
import signal

import pytest
from openai.types.responses import Response

from batchapi.engine import EngineConfig, EngineFront
from batchapi.engine.core import EngineProcess
from batchapi.openai.errors import RequestError
from batchapi.openai.lines import parse_line
from batchapi.workers.codec import Codec
from batchapi.workers.run_batch import run_batch


@pytest.fixture(scope="module")
def front(tiny_llama_dir):
    front = EngineFront(EngineConfig(model_path=tiny_llama_dir, dtype="float32", kv_cache_bytes=4 << 20,
                                     max_num_seqs=4, max_model_len=200)).start()
    yield front
    front.shutdown()


def line(custom_id, url, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}})


def test_run_batch_writes_one_line_per_input_line(tmp_path, front):
    chat = "/v1/chat/completions"
    lines = [
        line("chat-1", chat, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0,
             ignore_eos=True, logprobs=True, top_logprobs=2),
        line("cmpl-1", "/v1/completions", prompt="Once upon a time", max_tokens=3, temperature=0, ignore_eos=True,
             n=2, logprobs=1),
        "this is not json",
        line("bad-temp", chat, messages=[{"role": "user", "content": "x"}], temperature=5),
        line("too-long", "/v1/completions", prompt=" ".join(["word"] * 300), max_tokens=3),
        "",
        *[line(f"many-{i}", chat, messages=[{"role": "user", "content": f"count to {i}"}], max_tokens=4,
               temperature=0, ignore_eos=True) for i in range(12)],
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    counts = run_batch(src, dst, front=front, progress=False, max_in_flight=3)
    assert (counts.total, counts.completed, counts.failed) == (17, 14, 3)
    out = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert len(out) == 17 and None in out

    body = out["chat-1"]["response"]["body"]
    assert out["chat-1"]["response"]["status_code"] == 200 and out["chat-1"]["error"] is None
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and len(content[0]["top_logprobs"]) == 2
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]

    cmpl = out["cmpl-1"]["response"]["body"]
    assert cmpl["object"] == "text_completion" and [c["index"] for c in cmpl["choices"]] == [0, 1]
    assert cmpl["usage"]["completion_tokens"] == 6
    assert len(cmpl["choices"][0]["logprobs"]["tokens"]) == 3

    assert out["bad-temp"]["response"]["status_code"] == 400
    assert out["bad-temp"]["response"]["body"]["error"]["param"] == "temperature"
    assert out["too-long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert out[None]["response"]["body"]["error"]["code"] == "invalid_json_line"  # validation's code
    assert front.num_in_flight() == 0


def test_lines_are_refused_with_the_codes_validation_gives(tmp_path, front):
    chat = "/v1/chat/completions"
    no_method = json.dumps({"custom_id": "no-method", "url": chat, "body": {"model": "m", "messages": []}})
    lines = [no_method, line("bad-url", "/v1/embeddings"), json.dumps({"url": chat}), "[1]"]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    counts = run_batch(src, dst, front=front, progress=False)
    assert (counts.completed, counts.failed) == (0, 4)
    errors = [(r["custom_id"], r["response"]["body"]["error"]["code"], r["response"]["body"]["error"]["param"])
              for r in map(json.loads, dst.read_text().splitlines())]
    assert errors == [("no-method", "invalid_method", "method"), ("bad-url", "invalid_url", "url"),
                      (None, "missing_custom_id", "custom_id"), (None, "invalid_json_line", None)]


def test_chat_template_is_applied(front):
    content = line("c", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}]).encode()
    request = Codec(front.tokenizer, "m").request(parse_line(content, 1, None), "x")
    text = front.tokenizer.decode(request.prompt_token_ids)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert request.params.max_tokens is None and request.params.temperature == 1.0


def test_a_line_over_the_limit_is_refused_and_the_rest_run(tmp_path, front):
    chat = "/v1/chat/completions"
    short = line("short", chat, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, ignore_eos=True)
    long = line("long", chat, messages=[{"role": "user", "content": "x" * 5000}], max_tokens=2)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([long, short]) + "\n")
    counts = run_batch(src, dst, front=front, progress=False, max_line_bytes=1024)
    assert (counts.total, counts.completed, counts.failed) == (2, 1, 1)
    out = [json.loads(r) for r in dst.read_text().splitlines()]
    refused = [r for r in out if r["response"]["status_code"] == 400]
    assert [r["response"]["body"]["error"]["code"] for r in refused] == ["line_too_long"]
    assert refused[0]["custom_id"] is None  # the line was never read, so neither was its custom_id


def test_results_come_in_input_order_with_each_custom_id(tmp_path, front):
    chat = "/v1/chat/completions"
    slow = line("slow", chat, messages=[{"role": "user", "content": "Hi"}], max_tokens=40, ignore_eos=True)
    quick = [line(f"quick-{i}", chat, messages=[{"role": "user", "content": f"{i}"}], max_tokens=1, ignore_eos=True)
             for i in range(6)]
    lines = [slow, quick[0], line("bad-url", "/v1/embeddings", input="x"), quick[1],
             line("unknown", chat, messages=[{"role": "user", "content": "x"}], frobnicate=1), *quick[2:],
             line("bad-n", chat, messages=[{"role": "user", "content": "x"}], n=0)]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    counts = run_batch(src, dst, front=front, progress=False, max_in_flight=2)
    assert (counts.total, counts.completed, counts.failed) == (10, 7, 3)
    out = [json.loads(r) for r in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in out] == [json.loads(x)["custom_id"] for x in lines]
    status = {r["custom_id"]: (r["response"]["status_code"], r["response"]["body"].get("error")) for r in out}
    assert status["bad-url"][0] == 400 and status["bad-url"][1]["code"] == "invalid_url"
    assert status["unknown"] == (400, {"message": "unrecognized request argument: 'frobnicate'",
                                       "type": "invalid_request_error", "param": "frobnicate",
                                       "code": "unknown_parameter"})
    assert status["bad-n"][1]["code"] == "invalid_value" and status["bad-n"][1]["param"] == "n"
    assert all(status[f"quick-{i}"] == (200, None) for i in range(6)) and status["slow"] == (200, None)
    assert front.num_in_flight() == 0


def test_a_responses_file_runs_into_response_objects(tmp_path, front):
    url = "/v1/responses"
    weather = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}
    lines = [
        line("plain", url, input="Hello", instructions="Be brief.", max_output_tokens=4, temperature=0),
        line("call", url, input="Weather in Paris?", tools=[weather], max_output_tokens=60, temperature=0,
             tool_choice={"type": "function", "name": "get_weather"}),
        line("web", url, input="News?", tools=[{"type": "web_search"}]),
        line("chat", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    counts = run_batch(src, dst, front=front, progress=False)
    assert (counts.total, counts.completed, counts.failed) == (4, 3, 1)
    out = {r["custom_id"]: r["response"] for r in map(json.loads, dst.read_text().splitlines())}
    bodies = {k: Response.model_validate(out[k]["body"]) for k in ("plain", "call")}
    plain = bodies["plain"]
    assert (plain.status, plain.incomplete_details.reason, plain.usage.output_tokens) == (
        "incomplete", "max_output_tokens", 4)  # the tiny model does not stop within 4 tokens
    assert plain.instructions == "Be brief." and plain.output[0].type == "message"
    [call] = bodies["call"].output
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    assert out["web"]["status_code"] == 400 and out["web"]["body"]["error"]["param"] == "tools[0].type"
    assert out["chat"]["body"]["object"] == "chat.completion"
    responses_usage = [b.usage for b in bodies.values()]
    chat_usage = out["chat"]["body"]["usage"]
    assert counts.prompt_tokens == sum(u.input_tokens for u in responses_usage) + chat_usage["prompt_tokens"]
    assert counts.completion_tokens == sum(u.output_tokens for u in responses_usage) + chat_usage["completion_tokens"]


def test_an_anthropic_request_for_another_model_or_past_the_context_is_refused_alone(front):
    """The worker's side of validation's per-request rule for Message Batches (``Limits.each_request``)."""
    codec = Codec(front.tokenizer, "tiny", names=frozenset({"tiny", "tiny-alias"}), context=front.engine.max_model_len)

    def request(custom_id, **body):
        content = json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/messages", "body": {
            "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **body}}).encode()
        return codec.request(parse_line(content, 1, None), custom_id)

    assert request("ok", model="tiny-alias").prompt_token_ids
    refusals = {}
    for custom_id, body in (("other", dict(model="claude-x")), ("long", dict(model="tiny", max_tokens=500)),
                            ("longer", dict(model="tiny", messages=[{"role": "user", "content": "word " * 400}]))):
        with pytest.raises(RequestError) as err:
            request(custom_id, **body)
        refusals[custom_id] = (err.value.code, err.value.param)
    assert refusals == {"other": ("model_not_found", "model"), "long": ("context_length_exceeded", "max_tokens"),
                        "longer": ("context_length_exceeded", "messages")}
    chat = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "claude-x", "max_tokens": 500, "messages": [{"role": "user", "content": "Hi"}]}}).encode()
    assert codec.request(parse_line(chat, 1, None), "c").prompt_token_ids  # OpenAI's rule: validation's concern


def comparable(text: str, cached: bool = True) -> list[dict]:
    """Output lines without what differs between two runs of a request (its ids, the clock), and
    with ``cached`` false without the prompt tokens the prefix cache held (a new core's is empty)."""
    records = []
    for record in map(json.loads, text.splitlines()):
        record.pop("id")
        record["response"].pop("request_id")
        body = record["response"]["body"]
        body.pop("id", None)
        body.pop("created", None)
        if not cached and "usage" in body:
            body["usage"]["prompt_tokens_details"].pop("cached_tokens")
        records.append(record)
    return records


def mixed_config(model_dir) -> EngineConfig:
    return EngineConfig(model_path=model_dir, dtype="float32", kv_cache_bytes=4 << 20, max_num_seqs=4,
                        max_model_len=200)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory, tiny_llama_dir):
    """Chat and completion lines (n, logprobs, stop strings, seeds) and what a new engine on a
    thread writes for them."""
    chat, lines = "/v1/chat/completions", []
    for i in range(16):
        if i % 4 == 3:
            lines.append(line(f"c{i}", "/v1/completions", prompt=f"Once upon a time {i}", max_tokens=12 + i, n=2,
                              logprobs=1, temperature=0.8, seed=i))
        else:
            lines.append(line(f"c{i}", chat, messages=[{"role": "user", "content": f"count to {i}"}],
                              max_tokens=8 + 2 * i, temperature=0, stop=["e"] if i % 2 else None))
    src = tmp_path_factory.mktemp("mixed") / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    run_batch(src, src.with_suffix(".thread"), mixed_config(tiny_llama_dir), progress=False, engine_process=False)
    return src, src.with_suffix(".thread").read_text()


def test_run_batch_through_the_engine_core_process_writes_what_the_thread_writes(mixed_file, tiny_llama_dir):
    src, on_a_thread = mixed_file
    dst = src.with_suffix(".process")
    counts = run_batch(src, dst, mixed_config(tiny_llama_dir), progress=False)  # its own front: the engine core in a child process
    assert (counts.completed, counts.failed) == (16, 0)
    # which prompt blocks a request finds cached depends on what ran in the steps before it, so
    # two runs of either path may count other cached_tokens; everything else is byte for byte
    assert comparable(dst.read_text(), cached=False) == comparable(on_a_thread, cached=False)


def test_run_batch_with_its_engine_core_killed_loses_and_repeats_nothing(mixed_file, tiny_llama_dir):
    src, on_a_thread = mixed_file
    dst, killed = src.with_suffix(".killed"), []
    with EngineProcess(mixed_config(tiny_llama_dir)) as front:
        def kill_after_some_results(seconds, results):
            if results and not killed:
                killed.append(front.num_in_flight())
                os.kill(front.pid, signal.SIGKILL)

        front.on_step = kill_after_some_results
        counts = run_batch(src, dst, front=front, progress=False)
        assert front.restarts == 1
    assert killed and killed[0] > 0, "nothing was in flight at the kill"
    assert (counts.completed, counts.failed) == (16, 0)
    assert comparable(dst.read_text(), cached=False) == comparable(on_a_thread, cached=False)
