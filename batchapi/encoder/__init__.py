"""The encoder path: embedding models (BERT-style encoders and decoder embedders) run without a KV
cache, pooled as their sentence-transformers modules say (see docs/CONTRACTS.md)."""

from batchapi.encoder.front import (
           EmbeddingRequest,
           EmbeddingResult,
           EncoderConfig,
           EncoderError,
           EncoderFront,
)
from batchapi.encoder.model import Encoder
from batchapi.encoder.pipeline import Pipeline, UnsupportedPipeline, read_pipeline
from batchapi.encoder.pooling import mean_pool

__all__ = ["EmbeddingRequest", "EmbeddingResult", "Encoder", "EncoderConfig", "EncoderError", "EncoderFront",
           "Pipeline", "UnsupportedPipeline", "mean_pool", "read_pipeline"]
