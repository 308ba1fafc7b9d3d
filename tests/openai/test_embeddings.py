"""Embeddings bodies: the inputs and options a line may hold, and the body a result renders to
(it parses as the openai SDK's ``CreateEmbeddingResponse``)."""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass, field

import pytest
from openai.types import CreateEmbeddingResponse

from batchapi.openai.body import parse_body
from batchapi.openai.embeddings import EMBEDDINGS, MAX_INPUTS, embedding_body
from batchapi.openai.errors import ErrorCode, RequestError


def parse(**body):
    return parse_body(EMBEDDINGS, {"model": "m", **body})


@pytest.mark.parametrize(("value", "inputs"), [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([101, 7592, 102], [[101, 7592, 102]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_every_input_shape_becomes_a_list_of_inputs(value, inputs):
    parsed = parse(input=value)
    assert (parsed.inputs, parsed.encoding_format, parsed.dimensions) == (inputs, "float", None)
    assert parsed.endpoint == EMBEDDINGS and parsed.messages is None and parsed.prompt is None


@pytest.mark.parametrize(("body", "code", "param"), [
    ({}, ErrorCode.MISSING_REQUIRED_PARAMETER, "input"),
    ({"input": []}, ErrorCode.INVALID_TYPE, "input"),
    ({"input": ["a", 1]}, ErrorCode.INVALID_TYPE, "input"),
    ({"input": [[1], []]}, ErrorCode.INVALID_TYPE, "input"),
    ({"input": [-1]}, ErrorCode.INVALID_TYPE, "input"),
    ({"input": [True]}, ErrorCode.INVALID_TYPE, "input"),
    ({"input": ""}, ErrorCode.INVALID_VALUE, "input"),
    ({"input": ["a", ""]}, ErrorCode.INVALID_VALUE, "input[1]"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, ErrorCode.INVALID_VALUE, "input"),
    ({"input": "a", "encoding_format": "int8"}, ErrorCode.INVALID_VALUE, "encoding_format"),
    ({"input": "a", "dimensions": 0}, ErrorCode.INVALID_TYPE, "dimensions"),
    ({"input": "a", "dimensions": "384"}, ErrorCode.INVALID_TYPE, "dimensions"),
    ({"input": "a", "temperature": 0}, ErrorCode.UNKNOWN_PARAMETER, "temperature"),
])
def test_bad_bodies_are_refused_naming_the_field(body, code, param):
    with pytest.raises(RequestError) as caught:
        parse(**body)
    assert (caught.value.code, caught.value.param) == (code, param)


def test_the_limit_of_inputs_per_request_is_openais():
    assert len(parse(input=["a"] * MAX_INPUTS).inputs) == MAX_INPUTS == 2048


def test_options_and_user_are_read():
    parsed = parse(input="a", encoding_format="base64", dimensions=384, user="someone")
    assert (parsed.encoding_format, parsed.dimensions) == ("base64", 384)


@dataclass
class Result:
    request_id: str = "r"
    prompt_tokens: int = 7
    vectors: list = field(default_factory=list)
    error: str | None = None


VECTORS = [[0.5, -0.25, 1.0], [0.0, 2.0, -3.5]]


def as_bytes(vector):
    return struct.pack(f"<{len(vector)}f", *vector)


def decode(value):
    if not isinstance(value, str):
        return value
    raw = base64.b64decode(value)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_a_result_renders_as_a_create_embedding_response(encoding):
    parsed = parse(input=["x", "y"], encoding_format=encoding)
    body = embedding_body(parsed, Result(vectors=[as_bytes(v) for v in VECTORS]), "all-minilm-l6-v2")
    decoded = {**body, "data": [{**d, "embedding": decode(d["embedding"])} for d in body["data"]]}
    # the SDK's type holds floats; it decodes base64 itself (as the openai client does for its own calls)
    response = CreateEmbeddingResponse.model_validate(decoded if encoding == "base64" else body)
    assert (response.object, response.model) == ("list", "all-minilm-l6-v2")
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (7, 7)
    assert [d.index for d in response.data] == [0, 1] and {d.object for d in response.data} == {"embedding"}
    for item, vector in zip(body["data"], VECTORS, strict=True):
        if encoding == "base64":  # little-endian float32, as OpenAI
            raw = base64.b64decode(item["embedding"])
            assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == vector
        else:
            assert item["embedding"] == vector
