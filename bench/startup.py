"""Start-up of `batchapi run-batch` on the default model, caches warm (model converted, C kernels
built, the invariant matmuls probed): seconds from the process's start until the engine core has
loaded the model, until the first token comes back, and until the command has exited.

    .venv/bin/python bench/startup.py [--runs 3] [--thread]

Each run is a fresh process (this file run again with --child), as `batchapi run-batch` is: one
chat line with max_tokens 1 through `run_batch`, its engine core in a child process (with
--thread: on a thread of the same process). Then `batchapi run-batch` itself on the same line,
timed from outside, the interpreter's exit included. The first run warms the caches; the rest
are the figures.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}}


def child(batch: Path, thread: bool) -> None:
    """What `batchapi run-batch` does, with the times of its steps printed as JSON."""
    from batchapi.config import Settings
    from batchapi.engine.core import start_engine
    from batchapi.workers.engine_setup import engine_config_from
    from batchapi.workers.run_batch import run_batch

    imported = time.perf_counter() - START
    front = start_engine(engine_config_from(Settings()), process=not thread)
    ready = time.perf_counter() - START
    first: list[float] = []
    front.on_step = lambda seconds, results: first or (results and first.append(time.perf_counter() - START))
    run_batch(batch, batch.with_suffix(".out"), front=front, progress=False)
    done = time.perf_counter() - START
    front.shutdown()
    print(json.dumps({"imported": imported, "ready": ready, "first_token": first[0] if first else done,
                      "ran": done, "shut_down": time.perf_counter() - START}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--thread", action="store_true", help="the engine on a thread of run-batch's process")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(Path(args.child), args.thread)
        return
    with tempfile.TemporaryDirectory(prefix="startup_") as tmp:
        batch = Path(tmp) / "one.jsonl"
        batch.write_text(json.dumps(LINE) + "\n")
        where = "on a thread" if args.thread else "in a child process"
        rows = []
        for run in range(args.runs + 1):
            out = subprocess.run([sys.executable, __file__, "--child", str(batch), *(["--thread"] if args.thread else [])],
                                 capture_output=True, text=True, check=True)
            times = json.loads(out.stdout.strip().splitlines()[-1])
            if run:  # the first run warms the caches
                rows.append(times)
                print(f"run {run}: imports {times['imported']:.2f} s, engine {where} ready {times['ready']:.2f} s, "
                      f"first token {times['first_token']:.2f} s, shut down {times['shut_down']:.2f} s")
        cli = []
        for _ in range(args.runs):
            env = None if not args.thread else {**__import__("os").environ, "BATCHAPI_ENGINE_PROCESS": "false"}
            started = time.perf_counter()
            subprocess.run([str(Path(sys.executable).parent / "batchapi"), "run-batch", "-i", str(batch), "-o",
                            str(batch.with_suffix(".cli")), "-q"], capture_output=True, check=True, env=env)
            cli.append(time.perf_counter() - started)
    first = [r["first_token"] for r in rows]
    print(f"first token after {statistics.median(first):.2f} s (median of {len(first)}; {min(first):.2f}-"
          f"{max(first):.2f}); `batchapi run-batch` of one line, exit included: "
          f"{statistics.median(cli):.2f} s ({min(cli):.2f}-{max(cli):.2f})")


if __name__ == "__main__":
    main()
