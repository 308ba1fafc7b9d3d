"""lm-eval through the ``batchapi`` backend against a live embedded service, and through lm-eval's
``hf`` backend on the same model directory: per sample the same choices, the same greedy
generations, the same rolling loglikelihoods."""

from __future__ import annotations

import httpx
import pytest

import batchapi.evals.lm  # noqa: F401  (registers the "batchapi" model)


def evaluate(model: str, model_args: dict, tasks: list[str], task_dir, **options) -> dict[str, list[dict]]:
    """Each task's logged samples, in doc order."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=tasks, batch_size=1, log_samples=True,
                              task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                              **options)
    return {task: sorted(results["samples"][task], key=lambda s: s["doc_id"]) for task in tasks}


def hf_args(model_dir, **extra) -> dict:
    return {"pretrained": str(model_dir), "device": "cpu", "dtype": "float32", **extra}


def batchapi_args(server, model: str, model_dir, **extra) -> dict:
    return {"base_url": server.base_url + "/v1", "model": model, "tokenizer": str(model_dir), "poll_seconds": 0.2,
            **extra}


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat-template"])
def test_greedy_generations_equal_hf(server, served_model, tiny_llama_dir, task_dir, chat):
    options = {"apply_chat_template": chat}
    ours = evaluate("batchapi", batchapi_args(server, served_model, tiny_llama_dir), ["batchapi_gen"], task_dir,
                    **options)["batchapi_gen"]
    theirs = evaluate("hf", hf_args(tiny_llama_dir), ["batchapi_gen"], task_dir, **options)["batchapi_gen"]
    assert [s["arguments"] for s in ours] == [s["arguments"] for s in theirs]  # the same prompts
    assert [s["resps"] for s in ours] == [s["resps"] for s in theirs]
    assert any(s["resps"][0][0] for s in ours), "every generation empty: the comparison shows nothing"


def test_choices_and_rolling_loglikelihoods_equal_hf(server, served_model, tiny_llama_dir, task_dir):
    tasks = ["batchapi_mc", "batchapi_rolling"]
    # a short max_length, so the rolling documents take several windows each
    ours = evaluate("batchapi", batchapi_args(server, served_model, tiny_llama_dir, max_length=24), tasks,
                    task_dir)
    theirs = evaluate("hf", hf_args(tiny_llama_dir, max_length=24), tasks, task_dir)
    assert_same_choices(ours["batchapi_mc"], theirs["batchapi_mc"])
    rolling, hf_rolling = ours["batchapi_rolling"], theirs["batchapi_rolling"]
    for sample, hf_sample in zip(rolling, hf_rolling, strict=True):
        assert sample["resps"][0][0] == pytest.approx(hf_sample["resps"][0][0], rel=1e-6)


def test_choices_under_a_chat_template_equal_hf(server, served_model, tiny_llama_dir, task_dir):
    ours = evaluate("batchapi", batchapi_args(server, served_model, tiny_llama_dir), ["batchapi_mc"], task_dir,
                    apply_chat_template=True)
    theirs = evaluate("hf", hf_args(tiny_llama_dir), ["batchapi_mc"], task_dir, apply_chat_template=True)
    assert "<|im_start|>" in ours["batchapi_mc"][0]["arguments"][0][0]
    assert_same_choices(ours["batchapi_mc"], theirs["batchapi_mc"])


def assert_same_choices(samples: list[dict], hf_samples: list[dict]) -> None:
    """Per sample: the same prompts, the same choice picked, the same is_greedy, logprobs within
    float32 rounding."""
    assert [s["arguments"] for s in samples] == [s["arguments"] for s in hf_samples]
    for sample, hf_sample in zip(samples, hf_samples, strict=True):
        scores = [resp[0] for resp in sample["resps"]]  # (logprob, is_greedy) per choice
        hf_scores = [resp[0] for resp in hf_sample["resps"]]
        assert pick(scores) == pick(hf_scores), (sample["doc"], scores, hf_scores)
        assert [g for _, g in scores] == [g for _, g in hf_scores]
        assert [lp for lp, _ in scores] == pytest.approx([lp for lp, _ in hf_scores], abs=1e-4)
    assert [s["acc"] for s in samples] == [s["acc"] for s in hf_samples]


def pick(scores: list[tuple[float, bool]]) -> int:
    """The chosen answer: the most likely choice."""
    return max(range(len(scores)), key=lambda i: scores[i][0])


def test_stop_strings_cut_generations_as_hf(server, served_model, tiny_llama_dir, task_dir):
    """Stops the random model does write (pieces of its own greedy texts), more of them than the
    four a request may carry: the texts end where hf's do."""
    texts = [s["resps"][0][0] for s in evaluate("hf", hf_args(tiny_llama_dir), ["batchapi_gen"],
                                                 task_dir)["batchapi_gen"]]
    stops = list(dict.fromkeys(text[start:start + 3] for text in texts for start in (6, 10)))
    assert len(stops) > 4, texts
    gen_kwargs = {"until": stops, "max_gen_toks": 12, "do_sample": False}
    ours = evaluate("batchapi", batchapi_args(server, served_model, tiny_llama_dir), ["batchapi_gen"], task_dir,
                    gen_kwargs=gen_kwargs)["batchapi_gen"]
    theirs = evaluate("hf", hf_args(tiny_llama_dir), ["batchapi_gen"], task_dir,
                      gen_kwargs=gen_kwargs)["batchapi_gen"]
    assert [s["resps"] for s in ours] == [s["resps"] for s in theirs]
    cut = [s["resps"][0][0] for s in ours]
    assert all(len(short) < len(text) and text.startswith(short) for short, text in zip(cut, texts, strict=True))


def test_the_command_line_runs_the_backend(server, served_model, tiny_llama_dir, task_dir, tmp_path):
    """``python -m batchapi.evals`` is lm-eval's command line with the ``batchapi`` model registered."""
    import json
    import os
    import subprocess
    import sys

    args = f"base_url={server.base_url}/v1,model={served_model},tokenizer={tiny_llama_dir},poll_seconds=0.2"
    command = [sys.executable, "-m", "batchapi.evals", "--model", "batchapi", "--model_args", args,
               "--tasks", "batchapi_mc", "--include_path", str(task_dir), "--output_path", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    [written] = list(tmp_path.rglob("results_*.json"))
    results = json.loads(written.read_text())["results"]["batchapi_mc"]
    assert 0.0 <= results["acc,none"] <= 1.0
    assert "batchapi_mc" in done.stdout  # the results table


def test_a_batch_the_service_refuses_fails_the_run(server, tiny_llama_dir, task_dir):
    from batchapi.evals.runner import EvalRequestFailed

    with pytest.raises(EvalRequestFailed) as failed:
        evaluate("batchapi", batchapi_args(server, "no-such-model", tiny_llama_dir), ["batchapi_mc"], task_dir)
    assert failed.value.custom_id is None  # the batch was refused whole: no request ran
    assert failed.value.error.startswith("model_not_found: "), failed.value


def test_a_context_past_the_model_is_cut_as_hf_cuts_it(server, served_model, tiny_llama_dir):
    """Left-truncated to the default max_length, a scored prompt still fits the service's model, and
    scores as hf does at that max_length."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from batchapi.evals.lm import BatchAPILM

    requests = [Instance(request_type="loglikelihood", doc={}, arguments=(" ".join(["word"] * 700), " end"), idx=0)]
    ours = BatchAPILM(**batchapi_args(server, served_model, tiny_llama_dir))
    assert len(ours.tok_encode(requests[0].args[0])) > 512 > ours.max_length
    hf = HFLM(**hf_args(tiny_llama_dir, max_length=ours.max_length), batch_size=1)
    [(logprob, greedy)] = ours.loglikelihood(requests)
    [(hf_logprob, hf_greedy)] = hf.loglikelihood(requests)
    assert logprob == pytest.approx(hf_logprob, abs=1e-4) and greedy == hf_greedy


def test_a_repeated_run_is_served_from_the_result_cache(server, served_model, tiny_llama_dir, task_dir):
    """The eval suite's nightly rerun: the same samples, no engine work, nothing charged."""

    def batches() -> dict[str, dict]:
        listed = httpx.get(f"{server.base_url}/v1/batches", params={"limit": 100}).json()["data"]
        return {b["id"]: b for b in listed}

    args = batchapi_args(server, served_model, tiny_llama_dir)
    first = evaluate("batchapi", args, ["batchapi_mc"], task_dir)["batchapi_mc"]
    before = set(batches())
    again = evaluate("batchapi", args, ["batchapi_mc"], task_dir)["batchapi_mc"]
    assert [s["resps"] for s in again] == [s["resps"] for s in first]
    rerun = [b for batch_id, b in batches().items() if batch_id not in before]
    assert rerun, "the rerun made no batch"
    for batch in rerun:
        total = batch["request_counts"]["total"]
        assert batch["cost"]["cached_requests"] == total and float(batch["cost"]["amount"]) == 0
        assert batch["usage"]["input_tokens"] == 0 and batch["usage"]["output_tokens"] == 0  # no engine work
