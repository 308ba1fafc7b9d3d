"""An embedding model's encoder in ``EngineStats``, on the real all-MiniLM-L6-v2: its requests as
running and waiting sequences while a forward is held, one step per forward, input tokens and
vectors counted when its requests finish, no KV cache and nothing generated."""

from __future__ import annotations

import threading

import pytest

from batchapi import metrics
from batchapi.encoder import EmbeddingRequest, EncoderConfig, EncoderFront
from tests.utils.waiting import wait_until

MODEL = (("model", "all-minilm-l6-v2"),)


@pytest.fixture
def held():
    """The compute turn the encoder takes around each forward; the test holds it to catch a round."""
    return threading.Lock()


@pytest.fixture
def stats(minilm_dir, held):
    front = EncoderFront(EncoderConfig(minilm_dir, max_batch_tokens=512), compute_turn=held).start()
    stats = metrics.EngineStats()
    stats.attach("all-minilm-l6-v2", front)
    yield stats, front
    stats.detach(front)
    front.shutdown()


def samples(stats: metrics.EngineStats) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in stats.registry.collect() for s in family.samples}


def test_the_encoder_reports_its_requests_forwards_tokens_and_vectors(stats, held):
    stats, front = stats
    ids = [front.tokenizer(text)["input_ids"] for text in ("hello world", "a longer sentence about batching")]
    with held:
        first = front.submit(EmbeddingRequest("first", ids))
        wait_until(lambda: front.num_running() == 1)  # its round began and waits for the compute turn
        second = front.submit(EmbeddingRequest("second", [ids[0], ids[0], ids[1]]))
        during = samples(stats)
    assert during[("batchapi_engine_running_sequences", MODEL)] == 1
    assert during[("batchapi_engine_waiting_sequences", MODEL)] == 1
    assert ("batchapi_engine_step_seconds_count", MODEL) not in during

    results = [first.result(timeout=60), second.result(timeout=60)]
    assert all(result.error is None for result in results)
    wait_until(lambda: front.num_running() == 0)  # the round ends just after it delivers its last result
    after = samples(stats)
    assert after[("batchapi_engine_step_seconds_count", MODEL)] == 2  # one forward per round: each fits 512 tokens
    assert after[("batchapi_engine_step_seconds_sum", MODEL)] > 0
    assert after[("batchapi_engine_prompt_tokens_total", MODEL)] == sum(r.prompt_tokens for r in results) \
        == 3 * len(ids[0]) + 2 * len(ids[1])
    assert after[("batchapi_engine_embeddings_total", MODEL)] == 5
    assert after[("batchapi_engine_generation_tokens_total", MODEL)] == 0
    assert after[("batchapi_engine_running_sequences", MODEL)] == 0
    assert after[("batchapi_engine_waiting_sequences", MODEL)] == 0
    assert after[("batchapi_engine_kv_cache_usage_ratio", MODEL)] == 0
    assert after[("batchapi_engine_generation_tokens_per_second", MODEL)] == 0


def test_a_refused_request_is_not_counted(stats):
    stats, front = stats
    bad = front.submit(EmbeddingRequest("bad", [[101, 10**6, 102]])).result(timeout=60)
    assert bad.error is not None
    wait_until(lambda: front.num_running() == 0)
    after = samples(stats)
    assert ("batchapi_engine_embeddings_total", MODEL) not in after
    assert after[("batchapi_engine_running_sequences", MODEL)] == 0
