"""The encoder's side of an embeddings line: its encoder request, and its result as an output line.

The embeddings twin of ``workers.codec.Codec``: a ``LineCodec`` as it is, so the shard runner
treats both alike. Text is tokenized with the model's tokenizer, special tokens
added and truncated to the model's ``max_seq_length`` as sentence-transformers does (256 for
all-MiniLM-L6-v2); token-id inputs are taken as the whole model input, cut to the same length.

A model's named prompts (``encoder.Pipeline``): the line's ``prompt_name``, else the model's default
prompt, is prepended to each text input before tokenizing, as sentence-transformers' ``encode``
does; token-id inputs get none. ``dimensions`` other than the model's size must be one of its
Matryoshka sizes.
"""

from __future__ import annotations

from batchapi.encoder import EmbeddingRequest, EmbeddingResult, EncoderError, Pipeline
from batchapi.openai.body import ParsedBody
from batchapi.openai.embeddings import embedding_body
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.lines import InputLine
from batchapi.workers.codec import LineCodec

ENCODER_ERRORS = {EncoderError.ENGINE_FAILURE: ErrorCode.SERVER_ERROR}


class EmbeddingCodec(LineCodec):
    def __init__(self, tokenizer, model_id: str, max_seq_length: int, dimensions: int,
                 pipeline: Pipeline | None = None):
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_seq_length = max_seq_length
        self.dimensions = dimensions
        self.pipeline = pipeline or Pipeline()
        self._prompt_lengths: dict[str, int] = {}

    def token_ids(self, inputs: list[str] | list[list[int]], prompt: str = "") -> list[list[int]]:
        if inputs and isinstance(inputs[0], str):
            texts = [prompt + text for text in inputs]
            if self.pipeline.lowercase:
                texts = [text.lower() for text in texts]
            return self.tokenizer(texts, truncation=True, max_length=self.max_seq_length)["input_ids"]
        return [list(ids[: self.max_seq_length]) for ids in inputs]

    def prompt_length(self, prompt: str) -> int:
        """The prompt's tokens at the start of an input, as sentence-transformers counts them: the
        prompt tokenized alone, less a special token the tokenizer ends it with (EOS, SEP)."""
        if prompt not in self._prompt_lengths:
            ids = self.token_ids([prompt])[0]
            special = set(self.tokenizer.all_special_ids)
            self._prompt_lengths[prompt] = len(ids) - (1 if ids and ids[-1] in special else 0)
        return self._prompt_lengths[prompt]

    def request(self, line: InputLine, request_id: str) -> EmbeddingRequest:
        """Raises RequestError for options the model does not have (``dimensions``, ``prompt_name``)."""
        parsed = line.body
        assert parsed is not None, f"line {line.line} did not parse: {line.error}"
        dimensions = self._dimensions(parsed.dimensions)
        prompt = self._prompt(parsed)
        prompt_length = self.prompt_length(prompt) if prompt else 0
        return EmbeddingRequest(request_id, self.token_ids(parsed.inputs, prompt), prompt_length, dimensions)

    def _dimensions(self, asked: int | None) -> int | None:
        """The size to cut the vectors to; None: the model's own."""
        if asked is None or asked == self.dimensions:
            return None
        sizes = [d for d in self.pipeline.matryoshka_dimensions if d < self.dimensions]
        if asked in sizes:
            return asked
        if sizes:
            raise RequestError(f"the model {self.model_id!r} has {self.dimensions} dimensions and can be shortened "
                               f"to {sizes}; 'dimensions' must be one of {[self.dimensions, *sizes]} or left out",
                               "dimensions")
        raise RequestError(f"the model {self.model_id!r} has {self.dimensions} dimensions and cannot shorten "
                           f"them; 'dimensions' must be {self.dimensions} or left out", "dimensions")

    def _prompt(self, parsed: ParsedBody) -> str:
        """The prompt text for the line's text inputs ("" for none)."""
        name = parsed.prompt_name
        if name is not None:
            if name not in self.pipeline.prompts:
                known = sorted(self.pipeline.prompts)
                raise RequestError(f"the model {self.model_id!r} has no prompt named {name!r}; "
                                   + (f"its prompts are {known}" if known else "it has no named prompts"),
                                   "prompt_name")
            if parsed.inputs and not isinstance(parsed.inputs[0], str):
                raise RequestError("'prompt_name' applies to text inputs; token-id inputs are the whole model "
                                   "input and get no prompt", "prompt_name")
        if parsed.inputs and not isinstance(parsed.inputs[0], str):
            return ""
        return self.pipeline.prompt(name)

    def refusal(self, result: EmbeddingResult) -> RequestError:
        code = ENCODER_ERRORS.get(result.error_code, ErrorCode.INVALID_VALUE)
        return RequestError(result.error, "input", code)

    def body(self, parsed: ParsedBody, result: EmbeddingResult) -> dict:
        return embedding_body(parsed, result, self.model_id)
