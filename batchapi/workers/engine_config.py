"""The engine's configuration from the service's settings (light: no torch, so that ``run-batch``
starts its engine core before this process imports torch)."""

from __future__ import annotations

from batchapi.config import Settings
from batchapi.engine.config import EngineConfig
from batchapi.models.store import resolve_model


def engine_config_from(settings: Settings, model: str | None = None) -> EngineConfig:
    """EngineConfig from settings: the one place a worker or the CLI builds it."""
    path = resolve_model(model or settings.model, settings.model_cache)
    return EngineConfig(
        model_path=str(path),
        device=settings.device,  # auto: the engine resolves it, in the process it runs in
        dtype=settings.dtype,
        kernels=settings.kernels,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_bytes=int(settings.kv_cache_gb * 2**30),
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enable_prefix_caching=settings.enable_prefix_caching,
        batch_invariant=settings.batch_invariant,
        cuda_graphs=settings.cuda_graphs,
    )
