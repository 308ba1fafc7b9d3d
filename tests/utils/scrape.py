"""Reading a service's ``/metrics`` in the tests: the samples by name and labels."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    response = httpx.get(f"{base_url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def usage_counters(samples: dict, model: str) -> dict[str, float]:
    """The usage counters of ``model``: input, cached input and output tokens, requests."""
    labels = (("model", model),)
    return {name: samples[(f"batchapi_{name}_total", labels)]
            for name in ("input_tokens", "cached_input_tokens", "output_tokens", "model_requests")}
