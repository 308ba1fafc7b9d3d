"""``bench/engine_throughput.py``'s step breakdown times each part of a step by wrapping the engine's
ops and projections on the instances, then puts them back. The engine must run as before it after: a
projection's ``forward`` left on its instance (even the class's own, bound) reads as a profiler's to
``CausalLM``, which then runs every later step through the Python loop instead of the one C call,
and the bench's later baselines (the end-to-end section's bare engine) ran 17% slow."""

from __future__ import annotations

import sys
from pathlib import Path

from batchapi.engine import EngineConfig, LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import engine_throughput  # noqa: E402


def test_the_step_breakdown_leaves_the_engine_running_as_before(tiny_llama_dir):
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model_path=tiny_llama_dir, dtype=dtype, kv_cache_bytes=4 << 20,
                                        max_num_seqs=4, max_num_batched_tokens=64))
        model = engine.runner.model
        in_c = model._decoder_layers() is not None
        projections = [m for m in model.modules() if isinstance(m, engine_throughput.LINEARS)]
        assert projections
        parts = engine_throughput.step_breakdown(
            engine, None, None, run=lambda e=engine: engine_throughput.step_times(e, (2,), steps=3))
        assert "linear layers" in parts and parts.endswith(" s")
        assert not [m for m in projections if "forward" in m.__dict__ or "argmax" in m.__dict__], dtype
        assert (model._decoder_layers() is not None) == in_c, dtype  # the one C call where it ran before
        assert model.layers_in_c
        engine.close()
