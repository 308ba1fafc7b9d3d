"""Which requests the result cache may answer, and under which key (``batches.result_cache.key``)."""

from __future__ import annotations

from batchapi.batches.result_cache import key
from batchapi.openai.body import ParsedBody

MESSAGES = [{"role": "user", "content": "Say hello."}]


def body(**fields) -> ParsedBody:
    return ParsedBody(**{"model": "m", "messages": MESSAGES, "max_tokens": 5, **fields})


def test_greedy_and_seeded_requests_have_a_key_sampled_ones_none():
    assert key("m", "fp", body(temperature=0)) is not None
    assert key("m", "fp", body(temperature=1.0, seed=7)) is not None
    assert key("m", "fp", body(temperature=1.0)) is None
    assert key("m", None, body(temperature=0)) is None  # no fingerprint: nothing ties it to an engine


def test_the_key_follows_model_fingerprint_and_every_body_field():
    greedy = key("m", "fp", body(temperature=0))
    assert greedy == key("m", "fp", body(temperature=0))
    assert len({greedy, key("other", "fp", body(temperature=0)), key("m", "fp2", body(temperature=0)),
                key("m", "fp", body(temperature=0, max_tokens=6)), key("m", "fp", body(temperature=0, logprobs=True)),
                key("m", "fp", body(temperature=1.0, seed=7)), key("m", "fp", body(temperature=1.0, seed=8))}) == 7
