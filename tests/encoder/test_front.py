"""The encoder front on the real all-MiniLM-L6-v2: inputs batched by a token budget and sorted by
length give the vectors each input gets alone, a bad request fails alone, and usage counts the
tokens encoded (cut to the model's max_seq_length)."""

from __future__ import annotations

import numpy as np
import pytest

from batchapi.encoder import EmbeddingRequest, EncoderConfig, EncoderError, EncoderFront

TEXTS = ["short", "a somewhat longer sentence about embeddings and batching", "hello world " * 40, "x"]


@pytest.fixture(scope="module")
def front(minilm_dir):
    front = EncoderFront(EncoderConfig(minilm_dir, max_batch_tokens=512)).start()
    yield front
    front.shutdown()


def vectors(result) -> list[np.ndarray]:
    return [np.frombuffer(v, dtype="<f4") for v in result.vectors]


def test_batched_and_sorted_inputs_get_the_vectors_they_get_alone(front):
    ids = [front.tokenizer(t)["input_ids"] for t in TEXTS]
    together = front.submit(EmbeddingRequest("all", ids)).result()
    alone = [front.submit(EmbeddingRequest(f"one-{i}", [x])).result() for i, x in enumerate(ids)]
    assert together.error is None and together.prompt_tokens == sum(len(x) for x in ids)
    for vector, single in zip(vectors(together), alone, strict=True):
        assert vector.shape == (front.dimensions,) == (384,)
        assert abs(float(np.linalg.norm(vector)) - 1) < 1e-5
        assert float(vector @ vectors(single)[0]) >= 0.99999


def test_inputs_past_the_window_are_cut_to_it(front):
    long = list(range(1000, 1600))  # 600 ids
    result = front.submit(EmbeddingRequest("long", [long])).result()
    cut = front.submit(EmbeddingRequest("cut", [long[: front.max_seq_length]])).result()
    assert front.max_seq_length == 256 and result.prompt_tokens == 256
    assert float(vectors(result)[0] @ vectors(cut)[0]) >= 0.99999


def test_a_token_outside_the_vocabulary_fails_its_request_alone(front):
    bad = front.submit(EmbeddingRequest("bad", [[101, 10**6, 102]]))
    good = front.submit(EmbeddingRequest("good", [[101, 7592, 102]]))
    assert (bad.result().error_code, good.result().error) == (EncoderError.INVALID_REQUEST, None)
    assert front.num_waiting() == 0 and front.is_alive() and front.kv_usage() == 0.0
