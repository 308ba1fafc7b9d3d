"""How long another project's ``GET /v1/files`` takes while webhook tests wait on a receiver that
never answers: ``--tests`` of them, from ``--projects`` projects at once, against a real
``batchapi serve`` (API only: PostgreSQL, a Redis broker) in a child process.

    .venv/bin/python bench/webhook_test_latency.py [--tests 120] [--projects 30] [--source DIR]

``--source`` serves another checkout of the package (``git archive`` of an older commit), to
measure the code before a change the same way. The peer in the same run is the same GET with no
test waiting. Printed, never asserted (tests/api/test_tenant_attacks.py asserts a bound).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchapi.config import DEFAULT_MODEL, load_settings  # noqa: E402
from batchapi.context import open_context  # noqa: E402
from batchapi.db.projects import create_api_key  # noqa: E402
from batchapi.db.session import session_scope  # noqa: E402
from batchapi.models.store import pull_model  # noqa: E402
from tests.api.test_tenant_attacks import HungReceiver  # noqa: E402
from tests.conftest import MODEL_CACHE  # noqa: E402
from tests.utils.api_process import ApiProcess  # noqa: E402
from tests.utils.services import fresh_database  # noqa: E402


async def run(api: ApiProcess, keys: list[str], bystander: str, tests: int) -> None:
    auth = {"Authorization": f"Bearer {bystander}"}
    with HungReceiver() as receiver:
        async with httpx.AsyncClient(base_url=api.base_url, timeout=120,
                                     limits=httpx.Limits(max_connections=tests + 10)) as client:
            ids = [(await client.post("/v1/webhook_endpoints", headers={"Authorization": f"Bearer {key}"}, json={
                "url": receiver.url, "event_types": ["batch.completed"], "name": "hung"})).json()["id"] for key in keys]
            started = time.monotonic()
            await client.get("/v1/files", headers=auth)
            idle = time.monotonic() - started
            posts = [asyncio.ensure_future(client.post(
                f"/v1/webhook_endpoints/{ids[i % len(keys)]}/test",
                headers={"Authorization": f"Bearer {keys[i % len(keys)]}"}, json={"event_type": "batch.completed"}))
                for i in range(tests)]
            deadline = time.monotonic() + 8.0  # all reach the receiver, or as many as the threads let through
            while len(receiver.held) < tests and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            waiting = len(receiver.held)
            started = time.monotonic()
            await client.get("/v1/files", headers=auth)
            loaded = time.monotonic() - started
            answers = Counter(r.status_code for r in await asyncio.gather(*posts))
    print(f"GET /v1/files idle {idle:.3f} s; with {tests} tests sent ({waiting} waiting at the receiver) "
          f"{loaded:.3f} s; the tests answered {dict(answers)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=120)
    parser.add_argument("--projects", type=int, default=30)
    parser.add_argument("--source", type=Path, default=None)
    args = parser.parse_args()
    model = pull_model(DEFAULT_MODEL, MODEL_CACHE)
    with tempfile.TemporaryDirectory() as tmp, fresh_database("batchapi_bench_hooks") as database_url, \
            ApiProcess(Path(tmp), database_url, model, source=args.source,
                       BATCHAPI_WEBHOOK_ALLOW_PRIVATE="true") as api:
        ctx = open_context(load_settings(database_url=database_url, data_dir=tmp, model=str(model)))
        with session_scope(ctx.sessions) as session:
            keys = [create_api_key(session, f"hooks-{i}") for i in range(args.projects)]
            bystander = create_api_key(session, "bystander")
        ctx.close()
        asyncio.run(run(api, keys, bystander, args.tests))


if __name__ == "__main__":
    main()
