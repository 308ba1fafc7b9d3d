"""`GET /v1/models` shows each served model's architecture, context length and kind, read at start;
a model not pulled on the API's host is listed with those null, and the openai SDK parses both."""

import httpx
import pytest
from openai import NotFoundError, OpenAI

from batchapi.db.migrate import upgrade
from tests.utils.batch_service import live_server, new_key, service_settings


@pytest.fixture(scope="module")
def models_server(tmp_path_factory, model_cache, tiny_qwen3_moe_dir, minilm_dir):
    settings = service_settings(tmp_path_factory.mktemp("api-models"), tiny_qwen3_moe_dir, model_cache=model_cache,
                                models=[str(tiny_qwen3_moe_dir), "all-minilm-l6-v2", "/not/pulled/ghost-model"])
    upgrade(settings)
    with live_server(settings) as server:
        yield server


@pytest.fixture
def key(models_server):
    return new_key(models_server, "project-models")


def test_the_list_carries_the_extension_fields(models_server, key):
    body = httpx.get(models_server.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    created = models_server.app.state.model.created
    common = {"object": "model", "created": created, "owned_by": "batchapi"}
    assert body == {"object": "list", "data": [
        {"id": "tiny-qwen3-moe", **common, "architecture": "Qwen3MoeForCausalLM", "context_length": 512,
         "kind": "chat"},
        {"id": "all-minilm-l6-v2", **common, "architecture": "BertModel", "context_length": 256,
         "kind": "embedding"},
        {"id": "ghost-model", **common, "architecture": None, "context_length": None, "kind": None},
    ]}


def test_the_openai_sdk_parses_the_list_and_one_model(models_server, key):
    client = OpenAI(base_url=models_server.base_url + "/v1", api_key=key, max_retries=0)
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [
        ("tiny-qwen3-moe", "model", "batchapi"), ("all-minilm-l6-v2", "model", "batchapi"),
        ("ghost-model", "model", "batchapi")]
    assert [(m.architecture, m.context_length, m.kind) for m in models] == [
        ("Qwen3MoeForCausalLM", 512, "chat"), ("BertModel", 256, "embedding"), (None, None, None)]
    embedding = client.models.retrieve("sentence-transformers/all-MiniLM-L6-v2")  # an alias of the served model
    assert (embedding.id, embedding.context_length) == ("all-minilm-l6-v2", 256)
    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-4o")
