"""The inference engine: continuous batching over a paged KV cache (see docs/CONTRACTS.md).

Names load on first use (PEP 562), so that a process that only talks to an engine core in
another process (``engine.core.EngineProcess``: ``run-batch``, a worker) starts that core before
it imports torch itself: the two imports run side by side."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "EngineConfig": "config",
    "LLMEngine": "engine",
    "EngineFront": "front",
    "UnsupportedModelError": "model.loader",
    "CompletionOutput": "request",
    "DuplicateRequestId": "request",
    "ErrorCode": "request",
    "GenerationRequest": "request",
    "GenerationResult": "request",
    "TokenLogprob": "request",
    "SamplingParams": "sampling_params",
}

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


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
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
