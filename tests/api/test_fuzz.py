"""Property-based fuzz of the HTTP API from its own OpenAPI document (schemathesis): requests made
of valid and invalid values for every route, sent to the live server with a real key, never get a
5xx, and every 4xx is in the OpenAI error shape (Anthropic's on its routes). Bounded: a few dozen cases per route."""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation.modes import GenerationMode

from tests.api.test_openapi_doc import EXPECTED
from tests.utils.batch_service import new_key

CASES_PER_ROUTE = 30  # per route and mode
RAW_BODIES = {"/v1/files/{file_id}/content", "/v1/batches/{batch_id}/partial_results", "/health"}
ANTHROPIC_ERROR = {"type", "message"}  # the Message Batches routes answer in Anthropic's error shape


@pytest.fixture(scope="module")
def api_schema(pg_server):
    # schemathesis' own pytest loader (from_fixture) needs pytest internals that pytest 9 no longer has
    return schemathesis.openapi.from_url(pg_server.base_url + "/openapi.json")


@pytest.fixture(scope="module")
def fuzz_headers(pg_server):
    return {"Authorization": f"Bearer {new_key(pg_server, 'fuzz')}"}


# routes whose schema constrains something, so that invalid values can be generated for them
CONSTRAINED = {("post", "/v1/files"), ("post", "/v1/batches"), ("get", "/v1/files"), ("get", "/v1/batches"),
               ("get", "/v1/batches/{batch_id}/partial_results")}
ROUTES = [(m, p, GenerationMode.POSITIVE) for m, p in sorted(EXPECTED)]
ROUTES += [(m, p, GenerationMode.NEGATIVE) for m, p in sorted(CONSTRAINED)]


@pytest.mark.parametrize("method,path,mode", ROUTES, ids=[f"{m} {p} {mode}" for m, p, mode in ROUTES])
def test_no_request_gets_a_5xx(api_schema, pg_server, fuzz_headers, method, path, mode):
    operation = api_schema[path][method.upper()]
    statuses = Counter()

    @given(operation.as_strategy(mode))
    @settings(max_examples=CASES_PER_ROUTE, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call(base_url=pg_server.base_url, headers=fuzz_headers, timeout=30)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (response.status_code, response.text[:500], case.as_curl_command())
        if response.status_code >= 400 and path not in RAW_BODIES:
            shape = ANTHROPIC_ERROR if path.startswith("/v1/messages/") else {"message", "type", "param", "code",
                                                                             "request_id"}
            assert set(response.json()["error"]) == shape, response.text[:500]

    check()
    print(f"{mode} {method.upper()} {path}: {dict(sorted(statuses.items()))}")
