"""What the registry reads of a model directory, and its list of the architectures the engine runs."""

import json

import pytest

from batchapi.config import load_settings
from batchapi.models.registry import (
    CHAT_ARCHITECTURES,
    GGUF_ARCHITECTURES,
    ModelInfo,
    model_info,
    require_supported,
    served_infos,
)
from batchapi.models.store import CHAT, EMBEDDING, UnsupportedModel


def test_the_registry_lists_the_architectures_the_engine_runs():
    from batchapi.engine.model.loader import SUPPORTED

    assert CHAT_ARCHITECTURES == SUPPORTED


def test_gguf_architectures_are_those_both_transformers_and_the_engine_read():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    families = {CHAT_ARCHITECTURES[architecture] for architecture in GGUF_ARCHITECTURES.values()}
    assert families == {"llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3"}
    assert families <= set(GGUF_SUPPORTED_ARCHITECTURES)
    assert "mixtral" not in GGUF_SUPPORTED_ARCHITECTURES  # a Mixtral GGUF reads as a dense llama


@pytest.mark.parametrize(("fixture", "architecture"), [
    ("tiny_llama_dir", "LlamaForCausalLM"),
    ("tiny_qwen3_dir", "Qwen3ForCausalLM"),
    ("tiny_qwen3_moe_dir", "Qwen3MoeForCausalLM"),
    ("tiny_mixtral_dir", "MixtralForCausalLM"),
    ("tiny_gemma2_dir", "Gemma2ForCausalLM"),
    ("tiny_gemma3_dir", "Gemma3ForCausalLM"),
])
def test_a_chat_model_shows_its_architecture_and_window(request, fixture, architecture):
    directory = request.getfixturevalue(fixture)
    assert model_info(directory) == ModelInfo(architecture, 512, CHAT)
    assert require_supported(directory) == model_info(directory)


def test_an_embedding_model_shows_its_sentence_transformers_length(minilm_dir, smollm2_dir):
    assert json.loads((minilm_dir / "config.json").read_text())["max_position_embeddings"] == 512
    assert model_info(minilm_dir) == ModelInfo("BertModel", 256, EMBEDDING)
    assert model_info(smollm2_dir) == ModelInfo("llama", 8192, CHAT)  # converted from GGUF: no architectures


def test_a_config_without_architectures_shows_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 32768}))
    assert model_info(tmp_path) == ModelInfo("qwen2", 32768, CHAT)


def test_an_unsupported_directory_is_refused_naming_what_is(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModel) as caught:
        require_supported(tmp_path)
    assert str(caught.value).startswith(
        f"{tmp_path.name}: architecture 'GPT2LMHeadModel' is not supported; served: LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, "
        "Gemma2ForCausalLM, Gemma3ForCausalLM (chat), "
        "bert, ")
    assert str(caught.value).endswith(" encoders (embedding)")


def test_served_models_not_pulled_here_are_listed_without_details(tmp_path, tiny_qwen3_moe_dir):
    settings = load_settings(data_dir=tmp_path, model_cache=tmp_path / "empty-cache",
                             models=[str(tiny_qwen3_moe_dir), "all-minilm-l6-v2", "/not/here/ghost"])
    assert served_infos(settings) == {
        "tiny-qwen3-moe": ModelInfo("Qwen3MoeForCausalLM", 512, CHAT),
        "all-minilm-l6-v2": ModelInfo(kind=EMBEDDING),  # the catalog knows its kind
        "ghost": ModelInfo(),
    }


def test_the_served_context_is_the_engines_and_no_window_bounds_it(tmp_path, tiny_llama_dir):
    """The service's context (validation, the worker, GET /v1/models) and the engine's agree; a sliding
    window does not bound either (the engine attends within it)."""
    import json

    from batchapi.engine.model.loader import load_config
    from batchapi.models.registry import context_length

    config = json.loads((tiny_llama_dir / "config.json").read_text())
    cases = [{"use_sliding_window": True, "sliding_window": 64}, {"use_sliding_window": False, "sliding_window": 64},
             {"sliding_window": 1024, "use_sliding_window": True}, {},
             {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64},
             {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "sliding_window": None,
              "num_local_experts": 4, "num_experts_per_tok": 2},
             {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "sliding_window": 64},
             {"architectures": [], "model_type": "gemma3_text", "sliding_window": 64, "max_position_embeddings": 4096}]
    seen = set()
    for change in cases:
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        assert context_length(tmp_path) == load_config(tmp_path).context_limit, change
        seen.add(context_length(tmp_path))
    assert seen == {512, 4096}
