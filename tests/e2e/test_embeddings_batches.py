"""Embeddings batches on the real all-MiniLM-L6-v2, through the official openai SDK against a live
server on PostgreSQL and SeaweedFS whose embedded worker serves the chat model and the embedding
model together: vectors match sentence-transformers' pipeline (mean pooling over the attention mask,
L2-normalised) computed here with plain transformers, usage and cost reconcile with the bodies, a
chat batch still runs beside it, and the file and request problems are refused as OpenAI does."""

from __future__ import annotations

import base64
import io
import json
import struct
from decimal import Decimal

import openai
import pytest
import torch
from openai import OpenAI
from openai.types import CreateEmbeddingResponse
from transformers import AutoModel, AutoTokenizer

from tests.utils.batch_service import embedded_stack, jsonl
from tests.utils.waiting import wait_for_batch

EMBEDDINGS = "/v1/embeddings"
MAX_INPUTS = 40  # the batch's embedding input limit on this server (OpenAI's 50,000 by default)
SETTINGS = dict(shard_size=4, max_num_seqs=8, auth_required=False, max_embedding_inputs=MAX_INPUTS)
TEXTS = ["The cat sits on the mat.", "A quick brown fox jumps over the lazy dog.", "hello world",
         "Batch inference is cheaper than online inference.", "Paris is the capital of France."]
LONG = " ".join(["embedding models cut long inputs"] * 80)  # ~400 tokens: cut to 256 as sentence-transformers


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir, minilm_dir, s3):
    with embedded_stack(tmp_path_factory.mktemp("embeddings"), smollm2_dir, "embeddings", s3,
                        models=[str(smollm2_dir), str(minilm_dir)], **SETTINGS) as server:
        yield server


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """sentence-transformers' encode for this model, in plain transformers: tokenize with truncation
    at max_seq_length 256, BertModel, mean over the attention mask, L2 normalise."""
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir))
    model = AutoModel.from_pretrained(str(minilm_dir), dtype=torch.float32).eval()

    def encode(inputs: list) -> tuple[list[list[float]], int]:
        vectors, tokens = [], 0
        for item in inputs:
            ids = item[:256] if isinstance(item, list) else tokenizer(item, truncation=True, max_length=256)["input_ids"]
            tokens += len(ids)
            with torch.inference_mode():
                hidden = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                                        dtype=torch.long))[0]
            pooled = hidden.mean(dim=1)
            vectors.append(torch.nn.functional.normalize(pooled, dim=1)[0].tolist())
        return vectors, tokens

    encode.tokenizer = tokenizer
    return encode


def line(custom_id: str, model: str, value, url: str = EMBEDDINGS, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": model, "input": value, **body}}


def submit(openai_client: OpenAI, lines: list, endpoint: str = EMBEDDINGS):
    uploaded = openai_client.files.create(file=("batch.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    return wait_for_batch(openai_client, batch.id, {"completed", "failed"}, timeout=600, interval=0.3)


def records(openai_client: OpenAI, file_id: str | None) -> dict:
    if file_id is None:
        return {}
    return {r["custom_id"]: r for r in map(json.loads, openai_client.files.content(file_id).text.splitlines())}


def floats(value) -> list[float]:
    if isinstance(value, list):
        return value
    raw = base64.b64decode(value)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def cosine(a: list[float], b: list[float]) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor([a]), torch.tensor([b]))[0])


def test_both_models_are_listed(openai_client):
    assert {m.id for m in openai_client.models.list().data} == {"smollm2-135m-instruct", "all-minilm-l6-v2"}
    assert openai_client.models.retrieve("all-minilm-l6-v2").id == "all-minilm-l6-v2"


def test_an_embeddings_batch_matches_sentence_transformers_and_reconciles(openai_client, reference):
    model = "all-minilm-l6-v2"
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    inputs = {
        "one": TEXTS[0], "many": TEXTS, "tokens": ids[0], "token-lists": ids, "long": [LONG, TEXTS[2]],
        "b64": TEXTS[1:4], "dims": TEXTS[3],
    }
    options = {"b64": {"encoding_format": "base64"}, "dims": {"dimensions": 384, "user": "u-1"}}
    lines = [line(cid, model, value, **options.get(cid, {})) for cid, value in inputs.items()]
    lines += [line("bad-format", model, "x", encoding_format="int8"), line("bad-dims", model, "x", dimensions=128)]
    batch = submit(openai_client, lines)
    assert batch.status == "completed", batch.errors
    output, errors = records(openai_client, batch.output_file_id), records(openai_client, batch.error_file_id)
    assert sorted(output) == sorted(inputs) and sorted(errors) == ["bad-dims", "bad-format"]
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(inputs), 2)

    prompt_tokens = 0
    for cid, value in inputs.items():
        body = output[cid]["response"]["body"]
        assert output[cid]["response"]["status_code"] == 200
        vectors = [floats(d["embedding"]) for d in body["data"]]
        assert isinstance(body["data"][0]["embedding"], str) == (cid == "b64")
        response = CreateEmbeddingResponse.model_validate(
            {**body, "data": [{**d, "embedding": v} for d, v in zip(body["data"], vectors, strict=True)]})
        assert response.model == model and [d.index for d in response.data] == list(range(len(vectors)))
        expected, tokens = reference(value if isinstance(value, list) and not isinstance(value[0], int) else [value])
        assert len(vectors) == len(expected) and all(len(v) == 384 for v in vectors)
        assert min(cosine(v, e) for v, e in zip(vectors, expected, strict=True)) >= 0.9999, cid
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens, cid
        prompt_tokens += tokens
    assert cosine(floats(output["tokens"]["response"]["body"]["data"][0]["embedding"]),
                  floats(output["one"]["response"]["body"]["data"][0]["embedding"])) >= 0.9999

    for cid, param in (("bad-format", "encoding_format"), ("bad-dims", "dimensions")):
        response = errors[cid]["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["param"] == param

    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt_tokens, 0)
    assert batch.model == model
    cost = batch.model_extra["cost"]
    expected_list = Decimal(prompt_tokens) * Decimal("0.01") / Decimal(1_000_000)
    assert Decimal(cost["list_amount"]) == expected_list.quantize(Decimal("0.00000001"))
    assert Decimal(cost["amount"]) == (expected_list / 2).quantize(Decimal("0.00000001"))


def test_a_chat_batch_runs_on_the_same_server(openai_client):
    lines = [{"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hi."}],
                       "max_tokens": 4, "temperature": 0}}]
    batch = submit(openai_client, lines, "/v1/chat/completions")
    assert batch.status == "completed" and batch.request_counts.completed == 1
    body = records(openai_client, batch.output_file_id)["c1"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] >= 1


def test_a_batch_for_a_model_nobody_serves_is_refused_at_create(openai_client):
    uploaded = openai_client.files.create(file=("b.jsonl", io.BytesIO(jsonl([line("a", "text-embedding-3-small", "x")]))),
                                   purpose="batch")
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.batches.create(input_file_id=uploaded.id, endpoint=EMBEDDINGS, completion_window="24h")
    assert caught.value.code == "model_not_found" and "text-embedding-3-small" in caught.value.message


def test_a_model_of_the_wrong_kind_fails_the_file(openai_client):
    batch = submit(openai_client, [line("a", "smollm2-135m-instruct", "x")])
    assert batch.status == "failed"
    assert [(e.code, e.param) for e in batch.errors.data] == [("model_not_found", "body.model")]
    assert "embedding" in batch.errors.data[0].message


def test_lines_of_two_models_are_a_mismatch(openai_client):
    lines = [line("a", "all-minilm-l6-v2", "x"), line("b", "all-minilm-l6-v2", "y"),
             {"custom_id": "c", "method": "POST", "url": EMBEDDINGS,
              "body": {"model": "smollm2-135m-instruct", "input": "z"}}]
    batch = submit(openai_client, lines)
    assert batch.status == "failed"
    assert [(e.code, e.line) for e in batch.errors.data] == [("mismatched_model", 3)]


def test_the_batch_input_limit_is_a_file_problem_at_the_line_that_crosses_it(openai_client):
    per_line = MAX_INPUTS // 3 + 1  # the third line crosses the limit
    lines = [line(f"l{i}", "all-minilm-l6-v2", [f"text {i}-{j}" for j in range(per_line)]) for i in range(4)]
    batch = submit(openai_client, lines)
    assert batch.status == "failed"
    assert [(e.code, e.line, e.param) for e in batch.errors.data] == [("too_many_inputs", 3, "body.input")]
