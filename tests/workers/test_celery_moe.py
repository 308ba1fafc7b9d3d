"""A Celery worker serves a mixture-of-experts model end to end on the real services (PostgreSQL,
Redis, S3): every request answered once, usage adding up, and the answers transformers gives."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.utils.waiting import wait_for_batch
from tests.workers.conftest import WORKER_SETTINGS, running_cluster
from tests.workers.helpers import assert_each_once, assert_usage_matches, lines_for, results, submit


@pytest.fixture(scope="module")
def moe_cluster(tmp_path_factory, s3, tiny_qwen3_moe_dir):
    with running_cluster(tmp_path_factory.mktemp("moe-cluster"), s3, tiny_qwen3_moe_dir, "batchapi_moe",
                         WORKER_SETTINGS) as cluster:
        yield cluster


def hf_answer(model_dir, line: dict) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    body = line["body"]
    ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=body["max_tokens"], do_sample=False,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_a_celery_worker_runs_a_moe_batch(moe_cluster, tiny_qwen3_moe_dir):
    worker = moe_cluster.start_worker()
    moe_cluster.wait_ready(worker)
    model = moe_cluster.server.app.state.model.id
    lines = lines_for(model, 24, prefix="moe", max_tokens=6)
    with moe_cluster.http() as http:
        batch = wait_for_batch(http, submit(http, lines), timeout=240)
        assert batch["status"] == "completed", batch
        output, errors = results(http, batch)
    assert errors == [] and batch["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
    assert_each_once(lines, output, errors)
    assert_usage_matches(batch, output)
    by_id = {line["custom_id"]: line["response"]["body"] for line in output}
    for line in lines[:2]:
        body = by_id[line["custom_id"]]
        assert body["model"] == model
        assert body["choices"][0]["message"]["content"] == hf_answer(tiny_qwen3_moe_dir, line)
