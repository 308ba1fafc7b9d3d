"""The Usage and Costs reports (OpenAI's shapes) reconcile with the batches' own usage and cost,
to the token and to 1e-8 of the currency unit, and a project's key sees its own project only."""

from __future__ import annotations

import io
import uuid
from collections import defaultdict
from decimal import Decimal

import httpx
import pytest
from openai import OpenAI

from batchapi.batches.billing import cost
from batchapi.db.clock import now
from batchapi.db.models import Batch, Project
from batchapi.db.projects import create_api_key, get_or_create_project
from batchapi.db.session import session_scope
from tests.utils.batch_service import CHAT, embedded_stack, jsonl, request_line
from tests.utils.waiting import wait_for_batch

DAY = 86400
COMPLETIONS = "/v1/organization/usage/completions"
EMBEDDINGS = "/v1/organization/usage/embeddings"
COSTS = "/v1/organization/costs"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    with embedded_stack(tmp_path_factory.mktemp("usage"), tiny_llama_dir, "usage_reports") as server:
        yield server


def key_for(stack, project: str, admin: bool = False) -> str:
    with session_scope(stack.ctx.sessions) as session:
        return create_api_key(session, project, admin=admin)


def project_id(stack, name: str) -> str:
    with stack.ctx.sessions() as session:
        return session.query(Project).filter_by(name=name).one().id


def run_batch(stack, key: str, n: int, max_tokens: int) -> dict:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0)
    model = stack.app.state.model.id
    lines = [request_line(f"q{i}", model, f"Name {i} colors.", max_tokens=max_tokens, temperature=0) for i in range(n)]
    uploaded = client.files.create(file=("b.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    http = httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"})
    return wait_for_batch(http, batch.id, {"completed"}, timeout=300, interval=0.3)


@pytest.fixture(scope="module")
def ran(stack):
    """Two batches of project alpha and one of beta, run for real, and an admin key."""
    keys = {"alpha": key_for(stack, "alpha"), "beta": key_for(stack, "beta"), "admin": key_for(stack, "ops", True)}
    batches = {"alpha": [run_batch(stack, keys["alpha"], 4, 5), run_batch(stack, keys["alpha"], 3, 7)],
               "beta": [run_batch(stack, keys["beta"], 5, 4)]}
    start = min(b["created_at"] for group in batches.values() for b in group) - 60
    return keys, batches, start


def get(stack, key: str, path: str, **params) -> httpx.Response:
    return httpx.get(stack.base_url + path, params=params, headers={"Authorization": f"Bearer {key}"})


def totals(pages: list[dict]) -> dict[str, int]:
    found: dict[str, int] = defaultdict(int)
    for page in pages:
        for bucket in page["data"]:
            for result in bucket["results"]:
                for name in ("input_tokens", "input_cached_tokens", "output_tokens", "num_model_requests"):
                    found[name] += result.get(name, 0)
    return dict(found)


def expected(batches: list[dict]) -> dict[str, int]:
    return {"input_tokens": sum(b["usage"]["input_tokens"] for b in batches),
            "input_cached_tokens": sum(b["usage"]["input_tokens_details"]["cached_tokens"] for b in batches),
            "output_tokens": sum(b["usage"]["output_tokens"] for b in batches),
            "num_model_requests": sum(b["request_counts"]["completed"] for b in batches)}


def spend(page: dict, **match) -> Decimal:
    return sum((Decimal(str(r["amount"]["value"])) for bucket in page["data"] for r in bucket["results"]
                if all(r[k] == v for k, v in match.items())), Decimal(0))


def billed(batches: list[dict]) -> Decimal:
    return sum((Decimal(b["cost"]["amount"]) for b in batches), Decimal(0))


def test_usage_reconciles_with_the_batches_for_the_admin(stack, ran):
    keys, batches, start = ran
    everything = batches["alpha"] + batches["beta"]
    page = get(stack, keys["admin"], COMPLETIONS, start_time=start, bucket_width="1h", limit=2).json()
    assert page["object"] == "page" and page["data"][0]["object"] == "bucket"
    assert totals([page]) == expected(everything)
    result = next(r for bucket in page["data"] for r in bucket["results"])
    assert result["object"] == "organization.usage.completions.result"
    assert result["project_id"] is None and result["model"] is None and result["batch"] is None

    grouped = get(stack, keys["admin"], COMPLETIONS, start_time=start, bucket_width="1h", limit=2,
                  **{"group_by[]": ["project_id", "model", "batch"]}).json()
    by_project: dict[str, list[dict]] = defaultdict(list)
    for bucket in grouped["data"]:
        for r in bucket["results"]:
            assert r["model"] == stack.app.state.model.id and r["batch"] is True
            by_project[r["project_id"]].append({"data": [{"results": [r]}]})
    for name in ("alpha", "beta"):
        assert totals(by_project[project_id(stack, name)]) == expected(batches[name])


def test_costs_reconcile_to_the_last_digit(stack, ran):
    keys, batches, start = ran
    day_start = start // DAY * DAY
    page = get(stack, keys["admin"], COSTS, start_time=day_start, limit=2).json()
    assert spend(page) == billed(batches["alpha"] + batches["beta"]) > 0
    result = page["data"][0]["results"][0] if page["data"][0]["results"] else page["data"][1]["results"][0]
    assert result["object"] == "organization.costs.result" and result["amount"]["currency"] == "usd"

    by_project = get(stack, keys["admin"], COSTS, start_time=day_start, limit=2, group_by="project_id").json()
    by_items = get(stack, keys["admin"], COSTS, start_time=day_start, limit=2,
                   **{"group_by[]": ["project_id", "line_item"]}).json()
    model = stack.app.state.model.id
    for name in ("alpha", "beta"):
        pid = project_id(stack, name)
        assert spend(by_project, project_id=pid) == billed(batches[name])
        assert spend(by_items, project_id=pid) == billed(batches[name])
        assert spend(by_items, project_id=pid, line_item=f"{model}, output") > 0


def test_a_project_key_sees_its_own_project_only(stack, ran):
    keys, batches, start = ran
    beta_id = project_id(stack, "beta")
    for name in ("alpha", "beta"):
        page = get(stack, keys[name], COMPLETIONS, start_time=start, bucket_width="1h", limit=2,
                   group_by="project_id").json()
        assert totals([page]) == expected(batches[name])
        assert {r["project_id"] for b in page["data"] for r in b["results"]} == {project_id(stack, name)}
        assert spend(get(stack, keys[name], COSTS, start_time=start // DAY * DAY, limit=2).json()) == billed(batches[name])
    # asking for the other project by id finds nothing
    asked = get(stack, keys["alpha"], COMPLETIONS, start_time=start, bucket_width="1h", limit=2,
                project_ids=beta_id).json()
    assert totals([asked]) == {}
    assert get(stack, "sk-batch-wrong", COMPLETIONS, start_time=start).status_code == 401


def add_ended_batch(stack, project: str, ended: int, endpoint: str = CHAT, tokens=(100, 20, 30)) -> Decimal:
    """A finished batch row at a chosen time (the reports only read rows); its own cost."""
    with session_scope(stack.ctx.sessions) as session:
        pid = get_or_create_project(session, project).id
        batch = Batch(id=f"batch_{uuid.uuid4().hex}", project_id=pid, endpoint=endpoint,
                          model="all-minilm-l6-v2" if endpoint == "/v1/embeddings" else "crafted-model",
                          input_file_id="file-x", completion_window="24h", status="completed",
                          created_at=ended - 10, expires_at=ended + DAY, completed_at=ended, request_total=2,
                          request_completed=2, input_tokens=tokens[0], cached_tokens=tokens[1],
                          output_tokens=tokens[2], price_input=Decimal("0.123456"),
                          price_cached_input=Decimal("0.05"), price_output=Decimal("0.333333"),
                          discount_percent=Decimal(50))
        session.add(batch)
        return cost(batch).amount


def test_buckets_pages_and_embeddings(stack):
    base = (now() // DAY - 40) * DAY  # long before the real batches
    key = key_for(stack, "gamma")
    chat = [add_ended_batch(stack, "gamma", base + day * DAY + 3600) for day in (0, 1, 1, 3, 4)]
    embedding = add_ended_batch(stack, "gamma", base + 2 * DAY + 60, endpoint="/v1/embeddings", tokens=(77, 0, 0))
    params = dict(start_time=base, end_time=base + 5 * DAY, limit=2)
    pages = [get(stack, key, COMPLETIONS, **params).json()]
    while pages[-1]["has_more"]:
        pages.append(get(stack, key, COMPLETIONS, **params, page=pages[-1]["next_page"]).json())
    assert [len(p["data"]) for p in pages] == [2, 2, 1]
    assert [b["start_time"] for p in pages for b in p["data"]] == [base + d * DAY for d in range(5)]
    per_day = [sum(r["num_model_requests"] for r in b["results"]) for p in pages for b in p["data"]]
    assert per_day == [2, 4, 0, 2, 2]  # every bucket listed, the empty one too
    assert totals(pages) == {"input_tokens": 500, "input_cached_tokens": 100, "output_tokens": 150,
                             "num_model_requests": 10}
    assert pages[-1]["next_page"] is None

    embeddings = get(stack, key, EMBEDDINGS, start_time=base, end_time=base + 5 * DAY, limit=5,
                     group_by="model").json()
    [result] = [r for b in embeddings["data"] for r in b["results"]]
    assert result == {"object": "organization.usage.embeddings.result", "input_tokens": 77, "num_model_requests": 2,
                      "project_id": None, "user_id": None, "api_key_id": None, "model": "all-minilm-l6-v2"}
    not_batch = get(stack, key, COMPLETIONS, start_time=base, end_time=base + 5 * DAY, limit=5, batch="false").json()
    assert totals([not_batch]) == {}

    # each crafted batch: (100-20)*0.123456 + 20*0.05 + 30*0.333333 per 1M at list price: 0.00002087647,
    # which its bill rounds to 0.00002088, then half off: 0.00001044; the line items round apart
    assert chat == [Decimal("0.00001044")] * 5
    costs = get(stack, key, COSTS, start_time=base, end_time=base + 5 * DAY, limit=5, group_by="line_item").json()
    assert spend(costs) == sum(chat) + embedding
    lines = {name: spend(costs, line_item=f"crafted-model, {name}") for name in ("input", "cached input", "output")}
    assert sum(lines.values()) == sum(chat) and all(value > 0 for value in lines.values())
    assert spend(costs, line_item="all-minilm-l6-v2, input") == embedding


@pytest.mark.parametrize("params,param", [
    ({}, "start_time"),
    ({"start_time": 100, "bucket_width": "2h"}, "bucket_width"),
    ({"start_time": 100, "group_by": "user_id"}, "group_by"),
    ({"start_time": 100, "end_time": 50}, "end_time"),
    ({"start_time": 100, "bucket_width": "1d", "limit": 32}, "limit"),
    ({"start_time": 100, "page": "page_bm9wZQ"}, "page"),
])
def test_bad_parameters_are_400s_that_name_them(stack, params, param):
    response = get(stack, key_for(stack, "delta"), COMPLETIONS, **params)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
