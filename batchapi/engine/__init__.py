"""The inference engine: continuous batching over a paged KV cache (see docs/CONTRACTS.md)."""

from batchapi.engine.config import EngineConfig
from batchapi.engine.engine import LLMEngine
from batchapi.engine.front import EngineFront
from batchapi.engine.model.loader import UnsupportedModelError
from batchapi.engine.request import (
    CompletionOutput,
    DuplicateRequestId,
    ErrorCode,
    GenerationRequest,
    GenerationResult,
    TokenLogprob,
)
from batchapi.engine.sampling_params import SamplingParams

__all__ = [
    "CompletionOutput",
    "DuplicateRequestId",
    "EngineConfig",
    "EngineFront",
    "ErrorCode",
    "GenerationRequest",
    "GenerationResult",
    "LLMEngine",
    "SamplingParams",
    "TokenLogprob",
    "UnsupportedModelError",
]
