"""The default model converts from its GGUF into a loadable HF directory, once."""

import json

import pytest

from batchapi.models.registry import accepted_names, model_id
from batchapi.models.store import ModelNotFound, list_models, pull_model, resolve_model


def test_converted_default_model_keeps_chat_template_and_vocabulary(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    assert len(tokenizer) == config.vocab_size == 49152
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(tokenizer.encode("Paris is the capital of France.")) == (
        "Paris is the capital of France."
    )


def test_converted_default_model_loads_as_plain_llama_and_answers(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


def test_pull_twice_does_no_work(smollm2_dir, model_cache):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert pull_model("smollm2-135m-instruct", model_cache) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
    assert ("smollm2-135m-instruct", smollm2_dir) in [(a, d) for a, d, _ in list_models(model_cache)]


def test_names_resolve_to_directories(smollm2_dir, model_cache, tiny_llama_dir, tmp_path):
    assert resolve_model("smollm2-135m-instruct", model_cache) == smollm2_dir
    assert resolve_model(str(tiny_llama_dir), model_cache) == tiny_llama_dir.resolve()
    assert model_id(str(tiny_llama_dir)) == "tiny-llama"
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in accepted_names("smollm2-135m-instruct")
    with pytest.raises(ModelNotFound, match="neither a known model"):
        resolve_model(str(tmp_path / "missing"), model_cache)
    with pytest.raises(ModelNotFound, match="unknown model"):
        pull_model("gpt-17", model_cache)
    with pytest.raises(ModelNotFound, match="not pulled yet"):
        resolve_model("smollm2-135m-instruct", tmp_path)


def test_the_embedding_model_is_pulled_as_its_hf_directory(minilm_dir, smollm2_dir, tiny_llama_dir):
    from batchapi.models.registry import model_kind
    from batchapi.models.store import CHAT, EMBEDDING

    assert minilm_dir.name == "all-minilm-l6-v2"
    assert {"config.json", "model.safetensors", "tokenizer.json", "sentence_bert_config.json"} <= {
        p.name for p in minilm_dir.iterdir()}
    assert (minilm_dir / "1_Pooling" / "config.json").is_file()
    assert [model_kind(d) for d in (minilm_dir, smollm2_dir, tiny_llama_dir)] == [EMBEDDING, CHAT, CHAT]


def test_served_names_resolve_without_reading_disk(tmp_path):
    from batchapi.config import load_settings
    from batchapi.models.registry import served_id_for, served_ids

    settings = load_settings(data_dir=tmp_path, models=["smollm2-135m-instruct", "/m/all-minilm-l6-v2"])
    assert served_ids(settings) == ["smollm2-135m-instruct", "all-minilm-l6-v2"]
    assert served_id_for(settings, "HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert served_id_for(settings, "/m/all-minilm-l6-v2") == "all-minilm-l6-v2"
    assert served_id_for(settings, "text-embedding-3-small") is None


def test_served_names_of_one_kind_as_far_as_it_is_known(tmp_path, minilm_dir, tiny_llama_dir):
    from batchapi.config import load_settings
    from batchapi.models.registry import served_id_for
    from batchapi.models.store import CHAT, EMBEDDING

    settings = load_settings(data_dir=tmp_path, models=["all-minilm-l6-v2", str(minilm_dir), str(tiny_llama_dir),
                                                        "/not/here/model"])
    assert served_id_for(settings, "all-minilm-l6-v2") == "all-minilm-l6-v2"
    assert served_id_for(settings, "all-minilm-l6-v2", CHAT) is None  # a packaged model: the catalog's kind
    assert served_id_for(settings, str(minilm_dir), CHAT) is None  # a directory here: its config's
    assert served_id_for(settings, str(minilm_dir), EMBEDDING) == minilm_dir.name
    assert served_id_for(settings, str(tiny_llama_dir), CHAT) == tiny_llama_dir.name
    assert served_id_for(settings, "/not/here/model", CHAT) == "model"  # not on this machine: not ruled out


def test_require_served_names_the_model_or_refuses_with_one_code(tmp_path):
    from batchapi.config import load_settings
    from batchapi.errors import InvalidRequest, ModelNotServed
    from batchapi.models.registry import require_served

    settings = load_settings(data_dir=tmp_path, models=["smollm2-135m-instruct", "/m/all-minilm-l6-v2"])
    assert require_served(settings, "HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    with pytest.raises(ModelNotServed) as caught:
        require_served(settings, "SmolLM2-135M-Instruct", "input_file_id", "of the file's first request")
    assert isinstance(caught.value, InvalidRequest)
    assert (caught.value.code, caught.value.param) == ("model_not_found", "input_file_id")
    assert caught.value.message == ("the model 'SmolLM2-135M-Instruct' of the file's first request is not served "
                                    "here; served: smollm2-135m-instruct, all-minilm-l6-v2")
