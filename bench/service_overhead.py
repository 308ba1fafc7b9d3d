"""What the service costs on top of the engine: the same requests both ways, in one run.

1. The whole service: a private redis-server, `batchapi serve` (API) and `batchapi worker`
   (Celery) as subprocesses on one SQLite database and a local storage directory (or
   --database-url / --storage-url); upload, create, validation, sharding, the worker,
   the result objects, finalize. Timed from the upload to `completed`.
2. Straight through the engine: one EngineFront in this process with the same engine
   settings, every request tokenized and submitted, timed until the last result.
Both are warmed up first. Prints output tokens/s of each and the ratio (service / engine), and
the same per CPU-second (the API and worker processes vs this one), which other jobs' load on a
shared machine moves far less than wall-clock time; and the write load of per-request durability
during the service run (request-result rows and their transactions per second, from the worker's
log), which is always on.

    .venv/bin/python bench/service_overhead.py                       # 1,000 requests, default model
    .venv/bin/python bench/service_overhead.py --requests 200 --model /path/to/hf-dir
    .venv/bin/python bench/service_overhead.py --result-flush-rows 1000000 --result-flush-seconds 60  # A/B
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from procs import answers, cpu_seconds, free_port, stop_group, wait_until

BIN = Path(sys.executable).parent / "batchapi"
# the worker's running totals, logged with every finished shard (batchapi/workers/shard_runner.py)
WRITES = re.compile(rb"request results written so far: (\d+) rows in (\d+) writes \(([0-9.]+) s\)")
TOPICS = ["the ocean", "a violin", "tax forms", "volcanoes", "a chess opening", "bread", "satellites", "moss"]




def request_lines(model: str, n: int, max_tokens: int) -> list[dict]:
    return [
        {"custom_id": f"bench-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                  "messages": [{"role": "user", "content": f"Request {i}: write a sentence about {TOPICS[i % 8]}."}]}}
        for i in range(n)
    ]






class Service:
    def __init__(self, workdir: Path, env: dict[str, str]):
        self.workdir, self.env, self.procs, self.names = workdir, env, [], []
        self.base = f"http://127.0.0.1:{env['BATCHAPI_PORT']}"

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        self.names.append(name)
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_group(proc)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each live process, by name (api, worker, redis)."""
        return {name: cpu_seconds(proc.pid) for name, proc in zip(self.names, self.procs, strict=True)
                if proc.poll() is None}

    def run_batch(self, http: httpx.Client, lines: list[dict]) -> tuple[float, dict[str, float], dict]:
        data = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
        cpu = self.cpu()
        start = time.perf_counter()
        file_id = http.post("/v1/files", files={"file": ("bench.jsonl", data)}, data={"purpose": "batch"}).json()["id"]
        batch = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"}).json()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)  # a light poll: the API shares the CPU with the worker here
            batch = http.get(f"/v1/batches/{batch['id']}").json()
        after = self.cpu()
        elapsed, cpu = time.perf_counter() - start, {name: after[name] - cpu.get(name, 0.0) for name in after}
        assert batch["status"] == "completed", batch
        assert batch["request_counts"]["completed"] == len(lines), batch
        return elapsed, cpu, batch


def writer_totals(log: Path) -> tuple[int, int, float]:
    """(rows, writes, seconds spent writing) of the worker's result writer so far."""
    found = WRITES.findall(log.read_bytes())
    return (int(found[-1][0]), int(found[-1][1]), float(found[-1][2])) if found else (0, 0, 0.0)


def through_service(args, model_id: str, lines: list[dict], warmup: list[dict]
                    ) -> tuple[float, dict[str, float], int, tuple[int, int, float]]:
    workdir = Path(tempfile.mkdtemp(prefix="batchapi-bench-"))
    redis_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
    env.update({
        "BATCHAPI_DATA_DIR": str(workdir / "data"), "BATCHAPI_PORT": str(free_port()),
        "BATCHAPI_BROKER_URL": f"redis://127.0.0.1:{redis_port}/0", "BATCHAPI_MODEL": args.model,
        "BATCHAPI_AUTH_REQUIRED": "false", "BATCHAPI_DATABASE_URL": args.database_url,
        "BATCHAPI_STORAGE_URL": args.storage_url, "BATCHAPI_RESULT_FLUSH_ROWS": str(args.result_flush_rows),
        "BATCHAPI_RESULT_FLUSH_SECONDS": str(args.result_flush_seconds),
    })
    service = Service(workdir, env)
    try:
        service.spawn("redis", "redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "",
                      "--appendonly", "no", "--dir", str(workdir))
        subprocess.run([str(BIN), "db", "upgrade"], env=env, check=True, capture_output=True)
        service.spawn("api", str(BIN), "serve")
        service.spawn("worker", str(BIN), "worker", "-n", "bench@%h")
        wait_until(lambda: b" ready." in (workdir / "worker.log").read_bytes(), 600, "the worker")
        with httpx.Client(base_url=service.base, timeout=60) as http:
            wait_until(lambda: answers(service.base + "/health"), 120, "the API")
            service.run_batch(http, warmup)
            before = writer_totals(workdir / "worker.log")
            elapsed, cpu, batch = service.run_batch(http, lines)
            after = writer_totals(workdir / "worker.log")
        return elapsed, cpu, batch["usage"]["output_tokens"], tuple(a - b for a, b in zip(after, before, strict=True))
    finally:
        service.stop()
        shutil.rmtree(workdir, ignore_errors=True)




def through_engine(args, lines: list[dict], warmup: list[dict]) -> tuple[float, float, int]:
    from batchapi.config import load_settings
    from batchapi.engine import EngineFront
    from batchapi.openai.lines import parse_line
    from batchapi.workers.codec import Codec
    from batchapi.workers.engine_setup import engine_config_from

    settings = load_settings(model=args.model)
    with EngineFront(engine_config_from(settings)) as front:
        codec = Codec(front.tokenizer, args.model)

        def run(batch: list[dict]) -> tuple[float, float, int]:
            cpu, start = time.process_time(), time.perf_counter()
            futures = [
                front.submit(codec.request(parse_line(json.dumps(line).encode(), 1, None),
                                           f"{line['custom_id']}-{start}"))
                for line in batch
            ]
            tokens = sum(f.result().completion_tokens for f in futures)
            return time.perf_counter() - start, time.process_time() - cpu, tokens

        run(warmup)
        return run(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or HF directory")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--database-url", default="", help="default: SQLite in a temp dir")
    parser.add_argument("--storage-url", default="", help="default: a local directory in the temp dir")
    parser.add_argument("--result-flush-rows", type=int, default=64,
                        help="BATCHAPI_RESULT_FLUSH_ROWS of the service (its default: 64)")
    parser.add_argument("--result-flush-seconds", type=float, default=1.0,
                        help="BATCHAPI_RESULT_FLUSH_SECONDS of the service (its default: 1; 60 writes almost "
                             "nothing before a shard ends, as before per-request durability)")
    args = parser.parse_args()

    from batchapi.models.registry import model_id

    served = model_id(args.model)
    lines = request_lines(served, args.requests, args.max_tokens)
    warmup = request_lines(served, 16, 4)
    for line in warmup:
        line["custom_id"] = "warm-" + line["custom_id"]

    service_s, service_cpus, service_tokens, (rows, writes, write_s) = through_service(args, served, lines, warmup)
    service_cpu = sum(service_cpus.values())
    engine_s, engine_cpu, engine_tokens = through_engine(args, lines, warmup)
    service_rate, engine_rate = service_tokens / service_s, engine_tokens / engine_s
    print(f"{args.requests} requests x {args.max_tokens} tokens, model {served}")
    print(f"engine : {engine_tokens} output tokens in {engine_s:.2f}s = {engine_rate:.1f} tok/s "
          f"({engine_cpu:.1f} CPU s)")
    print(f"service: {service_tokens} output tokens in {service_s:.2f}s = {service_rate:.1f} tok/s "
          f"({service_cpu:.1f} CPU s: " + ", ".join(f"{name} {t:.1f}" for name, t in service_cpus.items())
          + "; upload to completed, Celery worker)")
    print(f"ratio service/engine: {service_rate / engine_rate:.3f} (tokens per wall second), "
          f"{(service_tokens / service_cpu) / (engine_tokens / engine_cpu):.3f} (tokens per CPU second)")
    print(f"durability: {rows} request-result rows in {writes} transactions = {rows / service_s:.1f} rows/s, "
          f"{writes / service_s:.2f} transactions/s at {service_rate:.1f} tok/s, {write_s:.2f} s inside them "
          f"({args.requests - rows} results finished within a write interval of their shard's end went straight "
          "into its objects)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
