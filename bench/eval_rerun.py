"""The same eval twice through lm-evaluation-harness on `batchapi serve`: the second run from the
result cache.

    .venv/bin/python bench/eval_rerun.py [--questions 200] [--generations 32] [--shots 5]
        [--poll-seconds 1.0] [--runs 2]

The embedded default (`batchapi serve` with no configuration but a fresh temporary data dir, on
127.0.0.1 and a free port, no API key), and lm-eval in this process with the ``batchapi`` model
(``batchapi/evals``), on two local tasks written here (task YAML and JSON-lines data; no hub):

- ``rerun_mc``, ``multiple_choice`` (lm-eval's ``loglikelihood``): ``--questions`` arithmetic
  questions of 4 choices each after a shared ``--shots``-shot prefix (``first_n`` few-shot
  sampler): one prefill-only request a choice;
- ``rerun_gen``, ``generate_until``: ``--generations`` greedy continuations of up to 16 tokens.

Run 1 runs every request on the engine (its greedy and prefill-only requests are all
deterministic, so the result cache keeps them); runs 2.. are the same eval again, every request
answered from the result cache. Prints each run's seconds (``simple_evaluate``, the datasets
already loaded), the ratio, that every per-sample response and metric is the same in every run,
and the cost of each run's batches (``cost.cached_requests``, ``cost.amount``) read back from
`GET /v1/batches`. Where a rerun's time went: the backend's calls, timed around the file upload
and batch create, the polling until the batch has ended, and the reading of the output file; the
rest is lm-eval's own work (building requests, tokenising, scoring).

Printed, never asserted: timings are noisy on a shared CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import httpx
from procs import answers, cpu_seconds, free_port, stop_group, wait_until

BIN = Path(sys.executable).parent / "batchapi"
MODEL = "smollm2-135m-instruct"

MC_TASK = """task: rerun_mc
dataset_path: json
dataset_kwargs:
  data_files:
    train: {shots}
    test: {data}
training_split: train
fewshot_split: train
test_split: test
num_fewshot: {num_fewshot}
fewshot_config:
  sampler: first_n
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: rerun_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n", "Q:"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""
OPS = [("plus", lambda a, b: a + b), ("minus", lambda a, b: a - b), ("times", lambda a, b: a * b)]


def mc_docs(n: int, rng: random.Random, lead: str) -> list[dict]:
    docs = []
    for _ in range(n):
        name, op = rng.choice(OPS)
        a, b = rng.randint(2, 99), rng.randint(2, 19)
        right = op(a, b)
        wrong = rng.sample(sorted({right + d for d in (-10, -2, -1, 1, 2, 10, 11)} - {right}), 3)
        answer = rng.randrange(4)
        choices = [str(w) for w in wrong]
        choices.insert(answer, str(right))
        docs.append({"question": f"{lead}: What is {a} {name} {b}?\nAnswer:",
                     "choices": [" " + c for c in choices], "answer": answer})
    return docs


def gen_docs(n: int, rng: random.Random, lead: str) -> list[dict]:
    docs = []
    for _ in range(n):
        name, op = rng.choice(OPS)
        a, b = rng.randint(2, 99), rng.randint(2, 19)
        docs.append({"prompt": f"{lead}: What is {a} {name} {b}? Explain in one sentence.\nA:", "target": f" {op(a, b)}"})
    return docs


def write_tasks(folder: Path, questions: int, generations: int, shots: int, seed: int, lead: str = "Question"
                ) -> Path:
    """The two tasks in ``folder``; ``lead`` starts every question (another one: other requests)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    def jsonl(name: str, docs: list[dict]) -> Path:
        path = folder / name
        path.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        return path

    (folder / "mc.yaml").write_text(MC_TASK.format(
        shots=jsonl("mc_shots.jsonl", mc_docs(max(shots, 1), rng, lead)),
        data=jsonl("mc.jsonl", mc_docs(questions, rng, lead)),
        num_fewshot=shots))
    (folder / "gen.yaml").write_text(GEN_TASK.format(data=jsonl("gen.jsonl", gen_docs(generations, rng, lead))))
    return folder


@contextmanager
def embedded_serve(workdir: Path):
    """`batchapi serve` with no configuration but a fresh data dir, a free port and no API key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
    port = free_port()
    env.update({"BATCHAPI_DATA_DIR": str(workdir / "data"), "BATCHAPI_HOST": "127.0.0.1",
                "BATCHAPI_PORT": str(port), "BATCHAPI_AUTH_REQUIRED": "false"})
    log = open(workdir / "serve.log", "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen([str(BIN), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is None and answers(base + "/health"), 600, "batchapi serve")
        yield base, proc
    finally:
        stop_group(proc)
        log.close()


def py_spy(pid: int, output: str) -> subprocess.Popen:
    """py-spy sampling the service's processes (the API and its engine core) until SIGINT."""
    binary = shutil.which("py-spy") or str(BIN.parent / "py-spy")
    return subprocess.Popen([binary, "record", "--pid", str(pid), "--subprocesses", "--format", "raw", "--rate", "200",
                             "--output", output], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds so far of ``pid`` and its live descendants (the API, its worker, the engine core)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]),
                                    []).append(int(entry))
            except OSError:
                continue
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_seconds(current)
        except OSError:
            continue
        todo += children.get(current, [])
    return total


class Phases:
    """Seconds spent in the backend's calls to the service, summed per phase, per run."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, cls, method: str, phase: str) -> None:
        original = getattr(cls, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(cls, method, timed)


def evaluate(base: str, model: str, tokenizer: Path, task_dir: Path, poll_seconds: float) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import batchapi.evals.lm  # noqa: F401  (registers the "batchapi" model)

    args = {"base_url": base + "/v1", "model": model, "tokenizer": str(tokenizer), "poll_seconds": poll_seconds}
    return simple_evaluate(model="batchapi", model_args=args, tasks=["rerun_mc", "rerun_gen"], batch_size=1,
                           log_samples=True, task_manager=TaskManager(include_path=str(task_dir),
                                                                      include_defaults=False))


def per_sample(results: dict) -> dict[str, list]:
    """Each task's samples in doc order: the prompt, every response, the metrics."""
    out = {}
    for task, samples in results["samples"].items():
        out[task] = [(s["doc_id"], s["arguments"], s["resps"], s["filtered_resps"],
                      {k: s[k] for k in ("acc", "exact_match") if k in s})
                     for s in sorted(samples, key=lambda s: s["doc_id"])]
    return out


def batches_since(http: httpx.Client, seen: set[str]) -> list[dict]:
    """The batches created since ``seen`` was taken (every batch is on the first pages here)."""
    found, after = [], None
    while True:
        page = http.get("/v1/batches", params={"limit": 100, **({"after": after} if after else {})}).json()
        found += [b for b in page["data"] if b["id"] not in seen]
        if not page["has_more"]:
            return found
        after = page["last_id"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=200, help="multiple-choice questions (4 requests each)")
    ap.add_argument("--generations", type=int, default=32, help="generate_until requests")
    ap.add_argument("--shots", type=int, default=5, help="the shared few-shot prefix of the questions")
    ap.add_argument("--poll-seconds", type=float, default=1.0, help="the backend's poll_seconds")
    ap.add_argument("--runs", type=int, default=2, help="the first and then this many less one reruns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary dir (the service's log)")
    ap.add_argument("--profile", default=None, help="cProfile the last run (this process: lm-eval) into this file")
    ap.add_argument("--py-spy", default=None, help="py-spy (pip install py-spy) raw stacks of the service during the "
                                                   "last run into this file")
    args = ap.parse_args()
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"

    from lm_eval import tasks as lm_tasks

    from batchapi.config import Settings
    from batchapi.evals import runner
    from batchapi.models.registry import model_id
    from batchapi.models.store import resolve_model

    tokenizer = resolve_model(MODEL, Settings().model_cache)
    served = model_id(MODEL)
    phases = Phases()
    phases.wrap(runner.BatchRunner, "_create", "upload + create")
    phases.wrap(runner.BatchRunner, "_follow", "poll until ended (+ read output)")
    phases.wrap(runner.BatchRunner, "_collect", "read output")

    workdir = Path(tempfile.mkdtemp(prefix="batchapi-eval-rerun-"))
    try:
        task_dir = write_tasks(workdir / "tasks", args.questions, args.generations, args.shots, args.seed)
        # a warm-up eval of other questions (the bench's imports, the tokenizer, the engine's first
        # steps) and the datasets built, so that the first timed run pays for neither
        warm_dir = write_tasks(workdir / "warm-up", 2, 2, args.shots, args.seed + 1, lead="Warm-up question")
        lm_tasks.TaskManager(include_path=str(task_dir), include_defaults=False).load(["rerun_mc", "rerun_gen"])
        with embedded_serve(workdir) as (base, proc), httpx.Client(base_url=base, timeout=60) as http:
            print(f"batchapi serve (embedded default, fresh data dir) on {base}; model {served}; "
                  f"rerun_mc {args.questions} questions x 4 choices ({args.shots}-shot), "
                  f"rerun_gen {args.generations} generations (max 16 tokens); poll_seconds {args.poll_seconds}")
            evaluate(base, served, tokenizer, warm_dir, args.poll_seconds)
            runs = []
            for run in range(args.runs):
                seen = {b["id"] for b in batches_since(http, set())}
                phases.seconds.clear()
                cpu, own_cpu = tree_cpu_seconds(proc.pid), time.process_time()
                last = run == args.runs - 1
                profiler = cProfile.Profile() if args.profile and last else None
                spy = py_spy(proc.pid, args.py_spy) if args.py_spy and last else None
                start = time.perf_counter()
                if profiler:
                    profiler.enable()
                results = evaluate(base, served, tokenizer, task_dir, args.poll_seconds)
                elapsed = time.perf_counter() - start
                if profiler:
                    profiler.disable()
                    profiler.dump_stats(args.profile)
                if spy:
                    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                    spy.wait(timeout=60)
                service_cpu, own_cpu = tree_cpu_seconds(proc.pid) - cpu, time.process_time() - own_cpu
                batches = batches_since(http, seen)
                runs.append((elapsed, per_sample(results), results["results"], batches, service_cpu + own_cpu))
                total = sum(b["request_counts"]["total"] for b in batches)
                cached = sum((b.get("cost") or {}).get("cached_requests", 0) for b in batches)
                amount = sum(float((b.get("cost") or {}).get("amount", 0)) for b in batches)
                saved = sum(float((b.get("cost") or {}).get("cached_amount", 0)) for b in batches)
                usage = sum((b.get("usage") or {}).get("total_tokens", 0) for b in batches)
                print(f"run {run + 1}: {elapsed:7.2f} s  {len(batches)} batches, {total} requests, "
                      f"{cached} cached, cost ${amount:.7f} (cached, not charged: ${saved:.7f}), usage {usage} "
                      f"tokens; CPU: service {service_cpu:.2f} s, lm-eval and the backend (this process) {own_cpu:.2f} s")
                backend = sum(v for k, v in phases.seconds.items() if k != "read output")
                print("       " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.seconds.items())
                      + f"; lm-eval's own work {elapsed - backend:.2f} s")
                for b in batches:
                    print(f"       {b['id']}: {b['status']}, counts {b['request_counts']}, cost {b.get('cost')}")
        first = runs[0]
        for i, (elapsed, samples, metrics, _, cpu) in enumerate(runs[1:], start=2):
            same = samples == first[1]
            print(f"run {i} vs run 1: {first[0] / elapsed:.1f}x faster ({first[0]:.2f} s -> {elapsed:.2f} s; "
                  f"{first[4] / cpu:.1f}x by CPU seconds, {first[4]:.1f} -> {cpu:.1f}); "
                  f"per-sample results {'identical' if same else 'DIFFERENT'} "
                  f"({sum(map(len, samples.values()))} samples), metrics "
                  f"{'identical' if metrics == first[2] else 'DIFFERENT'}")
        print("metrics: " + json.dumps({t: {k: v for k, v in m.items() if k != "alias"} for t, m in first[2].items()}))
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
