"""The encoder path: embedding models (BERT-style) run without a KV cache (see docs/CONTRACTS.md)."""

from batchapi.encoder.front import (
           EmbeddingRequest,
           EmbeddingResult,
           EncoderConfig,
           EncoderError,
           EncoderFront,
)
from batchapi.encoder.model import Encoder, mean_pool

__all__ = ["EmbeddingRequest", "EmbeddingResult", "Encoder", "EncoderConfig", "EncoderError", "EncoderFront",
           "mean_pool"]
