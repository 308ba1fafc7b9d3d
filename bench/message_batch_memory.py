"""How much one ``POST /v1/messages/batches`` grows the API process: its peak resident memory
(VmHWM, reset before each request) over its resident memory just before, for a body of one
oversized request and for a large valid body, of each size given.

    .venv/bin/python bench/message_batch_memory.py [--mib 32 64] [--source DIR]

A fresh ``batchapi serve`` (API only: PostgreSQL, a Redis broker, local storage) runs as a child
process for each body; ``--source`` runs it on another checkout of the package (``git archive`` of an older
commit, say), to measure the code before a change in the same way. The peer in the same run is
the body's own size. Printed, never asserted (tests/api/test_tenant_attacks.py asserts a bound).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchapi.config import DEFAULT_MODEL  # noqa: E402
from batchapi.models.store import pull_model  # noqa: E402
from tests.conftest import MODEL_CACHE  # noqa: E402
from tests.utils.api_process import ApiProcess, oversized_body, valid_body  # noqa: E402
from tests.utils.services import fresh_database  # noqa: E402

MIB = 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--source", type=Path, default=None, help="a checkout whose batchapi package to serve")
    args = parser.parse_args()
    model = pull_model(DEFAULT_MODEL, MODEL_CACHE)  # the API reads its config only
    print(f"{'body':<24} {'MiB':>5} {'status':>6} {'growth MiB':>11} {'x body':>7} {'seconds':>8}")
    for mib in args.mib:
        for name, body in (("one oversized request", oversized_body(mib * MIB)),
                           ("valid requests", valid_body(mib * MIB // 2048, "m", 2048))):
            with tempfile.TemporaryDirectory() as tmp, fresh_database("batchapi_bench_memory") as database_url, \
                    ApiProcess(Path(tmp), database_url, model, source=args.source) as api:
                for _ in range(3):  # lazy imports, pools, the first validation's tokenizer: not measured
                    api.post_messages(valid_body(8, "m"))
                started = time.monotonic()
                answer, growth = api.measure(body)
                took = time.monotonic() - started
            print(f"{name:<24} {len(body) / MIB:>5.0f} {answer.status_code:>6} {growth / MIB:>11.1f} "
                  f"{growth / len(body):>7.2f} {took:>8.1f}")
            del body

if __name__ == "__main__":
    main()
