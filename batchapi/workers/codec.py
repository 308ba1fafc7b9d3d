"""Input lines to engine requests and engine results to OpenAI bodies, for one served model
(a thin binding of ``openai_io`` to the worker's tokenizer and model id)."""

from __future__ import annotations

from batchapi.engine import GenerationRequest, GenerationResult
from batchapi.workers import openai_io
from batchapi.workers.shard_input import InputLine


class Codec:
    def __init__(self, tokenizer, model_id: str):
        self.tokenizer = tokenizer
        self.model_id = model_id

    def request(self, line: InputLine, request_id: str) -> GenerationRequest:
        return openai_io.to_request(line.parsed, self.tokenizer, request_id)

    def body(self, line: InputLine, result: GenerationResult) -> dict:
        return openai_io.to_body(line.parsed, result, self.model_id, self.tokenizer)

    def error(self, result: GenerationResult) -> dict:
        """The ``error`` object of a request the engine refused."""
        return openai_io.error_body(result)["error"]
