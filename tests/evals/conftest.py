"""A live embedded service (SQLite, local storage, the embedded worker on the tiny model) for the
lm-eval backend, the task folder lm-eval reads, and lm-eval kept off the network."""

from __future__ import annotations

import pytest

from tests.evals.tasks import write_tasks
from tests.utils.batch_service import embedded_stack

# float32 as the hf backend runs the tiny model ("auto" is bfloat16 on a CPU with native bf16)
# with the result cache on, as a deployment runs: a repeated run is answered from it
SETTINGS = dict(shard_size=8, max_num_seqs=16, kv_cache_gb=0.05, auth_required=False, dtype="float32",
                result_cache=True)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """lm-eval and the datasets library read the local task files only."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


@pytest.fixture(scope="package")
def server(tmp_path_factory, tiny_llama_dir):
    with embedded_stack(tmp_path_factory.mktemp("evals"), tiny_llama_dir, None, **SETTINGS) as server:
        yield server


@pytest.fixture(scope="package")
def served_model(server) -> str:
    return server.app.state.model.id


@pytest.fixture(scope="package")
def task_dir(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("tasks"))
