"""The encoder's side of an embeddings line: its encoder request, and its result as an output line.

The embeddings twin of ``workers.codec.Codec``: a ``LineCodec`` as it is, so the shard runner
treats both alike. Text is tokenized with the model's tokenizer, special tokens
added and truncated to the model's ``max_seq_length`` as sentence-transformers does (256 for
all-MiniLM-L6-v2); token-id inputs are taken as the whole model input, cut to the same length.
"""

from __future__ import annotations

from batchapi.encoder import EmbeddingRequest, EmbeddingResult, EncoderError
from batchapi.openai.body import ParsedBody
from batchapi.openai.embeddings import embedding_body
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.lines import InputLine
from batchapi.workers.codec import LineCodec

ENCODER_ERRORS = {EncoderError.ENGINE_FAILURE: ErrorCode.SERVER_ERROR}


class EmbeddingCodec(LineCodec):
    def __init__(self, tokenizer, model_id: str, max_seq_length: int, dimensions: int):
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_seq_length = max_seq_length
        self.dimensions = dimensions

    def token_ids(self, inputs: list[str] | list[list[int]]) -> list[list[int]]:
        if inputs and isinstance(inputs[0], str):
            return self.tokenizer(list(inputs), truncation=True, max_length=self.max_seq_length)["input_ids"]
        return [list(ids[: self.max_seq_length]) for ids in inputs]

    def request(self, line: InputLine, request_id: str) -> EmbeddingRequest:
        """Raises RequestError for options the model does not have (``dimensions``)."""
        parsed = line.body
        assert parsed is not None, f"line {line.line} did not parse: {line.error}"
        if parsed.dimensions is not None and parsed.dimensions != self.dimensions:
            raise RequestError(f"the model {self.model_id!r} has {self.dimensions} dimensions and cannot shorten "
                               f"them; 'dimensions' must be {self.dimensions} or left out", "dimensions")
        return EmbeddingRequest(request_id, self.token_ids(parsed.inputs))

    def refusal(self, result: EmbeddingResult) -> RequestError:
        code = ENCODER_ERRORS.get(result.error_code, ErrorCode.INVALID_VALUE)
        return RequestError(result.error, "input", code)

    def body(self, parsed: ParsedBody, result: EmbeddingResult) -> dict:
        return embedding_body(parsed, result, self.model_id)
