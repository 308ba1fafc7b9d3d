"""``/v1/embeddings`` bodies (pure Python): the request's inputs and options, and the
``CreateEmbeddingResponse`` body of a result.

``input`` is a string, an array of strings, an array of token ids, or an array of such arrays
(at most ``MAX_INPUTS``, none empty, as OpenAI). Token ids are the model's own vocabulary and are
the whole model input: no ``[CLS]``/``[SEP]`` is added to them, while text gets them from the
tokenizer. ``encoding_format`` is ``float`` (the default) or ``base64`` (the little-endian float32
bytes of each vector, base64-encoded, as OpenAI). ``dimensions`` is checked against the model by
the worker, which knows it (``workers.embedding_codec``). ``user`` is accepted and ignored.
``prompt_name`` (an extension) names one of the model's sentence-transformers prompts (``query``,
``document``...), prepended to each text input; the worker checks it against the model's.
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Any

from batchapi.openai.errors import ErrorCode, RequestError

EMBEDDINGS = "/v1/embeddings"
FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "prompt_name"}
ENCODING_FORMATS = ("float", "base64")
MAX_INPUTS = 2048  # per request, as OpenAI
MAX_BATCH_INPUTS = 50_000  # across all the lines of a batch, as OpenAI


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def parse_inputs(value: Any) -> list[str] | list[list[int]]:
    """The inputs of a body's ``input``, as a list of strings or a list of token-id lists."""
    if value is None:
        raise RequestError("'input' is required", "input", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if isinstance(value, str):
        inputs: list = [value]
    elif _is_tokens(value):
        inputs = [list(value)]
    elif isinstance(value, list) and value and (all(isinstance(v, str) for v in value)
                                                or all(_is_tokens(v) for v in value)):
        inputs = [v if isinstance(v, str) else list(v) for v in value]
    else:
        raise RequestError("'input' must be a non-empty string, an array of strings, an array of token ids, "
                           "or an array of arrays of token ids", "input", ErrorCode.INVALID_TYPE)
    if len(inputs) > MAX_INPUTS:
        raise RequestError(f"'input' holds {len(inputs)} inputs; at most {MAX_INPUTS} are allowed per request",
                           "input")
    for i, item in enumerate(inputs):
        if item == "":
            raise RequestError("an input must not be an empty string", f"input[{i}]" if len(inputs) > 1 else "input")
    return inputs


def parse_embeddings(body: dict, parsed) -> None:
    """Fill ``parsed`` (a ``body.ParsedBody``) from an embeddings body whose fields were checked."""
    parsed.inputs = parse_inputs(body.get("input"))
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise RequestError(f"invalid value {encoding!r}; expected one of {list(ENCODING_FORMATS)}", "encoding_format")
    parsed.encoding_format = encoding
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1):
        raise RequestError("'dimensions' must be a positive integer", "dimensions", ErrorCode.INVALID_TYPE)
    parsed.dimensions = dimensions
    prompt_name = body.get("prompt_name")
    if prompt_name is not None and (not isinstance(prompt_name, str) or not prompt_name):
        raise RequestError("'prompt_name' must be a non-empty string", "prompt_name", ErrorCode.INVALID_TYPE)
    parsed.prompt_name = prompt_name


def _floats(vector: bytes) -> list[float]:
    values = array("f")
    values.frombytes(vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def encode_vector(vector: bytes, encoding_format: str) -> list[float] | str:
    """One vector (little-endian float32 bytes) as the wire carries it."""
    if encoding_format == "base64":
        return base64.b64encode(vector).decode("ascii")
    return _floats(vector)


def embedding_body(parsed, result, model: str) -> dict:
    """The ``CreateEmbeddingResponse`` of a finished request (``result.vectors``: float32 bytes each)."""
    assert result.error is None, f"request {result.request_id} failed ({result.error}); render it rejected"
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, parsed.encoding_format)}
            for i, v in enumerate(result.vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}
