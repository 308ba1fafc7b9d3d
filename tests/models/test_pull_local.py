"""`batchapi models pull` of a local Hugging Face directory or GGUF file: linked or converted once
into the cache, served by its name after; an architecture not served is refused in one line."""

import json
import shutil
from pathlib import Path

import pytest

from batchapi.cli import main
from batchapi.config import load_settings
from batchapi.models.registry import ModelInfo, model_info, pull, served_infos, served_model
from batchapi.models.store import (
    CHAT,
    READY_MARKER,
    ModelNotFound,
    UnsupportedModel,
    list_models,
    resolve_model,
)

GEMMA_GGUF = ("gemma2", "gemma3")


def write_tiny_gguf(path: Path, tokenizer_dir: Path, architecture: str = "llama", **metadata: int) -> Path:
    """A 2-layer random Llama-style GGUF (float32) with the first 1,024 tokens of ``tokenizer_dir``'s
    BPE vocabulary; ``metadata``: extra ``<architecture>.<key>`` integers (``expert_count=8``). A Gemma
    one has its head size and window, its sandwich norms (and Gemma 3's q/k norms), each norm stored
    as llama.cpp stores Gemma's: 1 + w."""
    import gguf
    import numpy as np

    model = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
    tokens = sorted((t for t in model["vocab"] if model["vocab"][t] < 1024), key=model["vocab"].get)
    kept = set(tokens)
    pairs = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    merges = [" ".join(p) for p in pairs if "".join(p) in kept and set(p) <= kept]
    hidden, ffn, heads, kv_heads, layers = 64, 128, 4, 2, 2
    gemma = architecture in GEMMA_GGUF
    if gemma:
        metadata = {"attention.key_length": 16, "attention.value_length": 16, "attention.sliding_window": 8,
                    **metadata}
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    for key, value in dict(context_length=512, embedding_length=hidden, block_count=layers,
                           feed_forward_length=ffn, **{"attention.head_count": heads},
                           **{"attention.head_count_kv": kv_heads}, **metadata).items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    kv = hidden * kv_heads // heads
    shapes = {"token_embd": (len(tokens), hidden), "output_norm": (hidden,)}
    for b in range(layers):
        shapes |= {f"blk.{b}.attn_norm": (hidden,), f"blk.{b}.ffn_norm": (hidden,), f"blk.{b}.attn_q": (hidden, hidden),
                   f"blk.{b}.attn_k": (kv, hidden), f"blk.{b}.attn_v": (kv, hidden),
                   f"blk.{b}.attn_output": (hidden, hidden), f"blk.{b}.ffn_gate": (ffn, hidden),
                   f"blk.{b}.ffn_up": (ffn, hidden), f"blk.{b}.ffn_down": (hidden, ffn)}
        if gemma:
            shapes |= {f"blk.{b}.post_attention_norm": (hidden,), f"blk.{b}.post_ffw_norm": (hidden,)}
        if architecture == "gemma3":
            shapes |= {f"blk.{b}.attn_q_norm": (16,), f"blk.{b}.attn_k_norm": (16,)}
    for name, shape in shapes.items():
        norm = rng.uniform(0.5, 1.5, shape) if gemma else np.ones(shape)  # Gemma's stored 1 + w: w not 0
        weight = norm if len(shape) == 1 else rng.normal(0.0, 0.08, shape)
        writer.add_tensor(f"{name}.weight", weight.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def copy_of(model_dir: Path, out_dir: Path, **config) -> Path:
    """``model_dir`` with its files linked and its config.json copied, ``config`` set in it."""
    out_dir.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (out_dir / item.name).symlink_to(item)
    raw = json.loads((model_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps(raw | config))
    return out_dir


@pytest.fixture
def cli(capfd, monkeypatch, tmp_path):
    """``batchapi`` in-process on a fresh model cache: (exit status, stdout, stderr lines)."""
    monkeypatch.setenv("BATCHAPI_MODEL_CACHE", str(tmp_path / "cache"))

    def cli(*argv: str) -> tuple[int, str, list[str]]:
        capfd.readouterr()
        code = main(list(argv))
        out, err = capfd.readouterr()
        assert "Traceback" not in out + err, out + err
        return code, out, err.splitlines()

    return cli


def test_a_local_directory_is_linked_under_its_name_and_served_by_it(tmp_path, tiny_qwen3_dir):
    cache = tmp_path / "cache"
    target = pull(str(tiny_qwen3_dir), cache)
    assert target == cache / "models" / "tiny-qwen3" and target.is_symlink()
    assert target.resolve() == tiny_qwen3_dir.resolve()
    assert not (tiny_qwen3_dir / READY_MARKER).exists()  # nothing written into the user's directory
    assert pull(str(tiny_qwen3_dir), cache) == target  # again: no work
    assert resolve_model("tiny-qwen3", cache) == target
    assert [(name, path) for name, path, _ in list_models(cache)] == [("tiny-qwen3", target)]

    settings = load_settings(data_dir=tmp_path, model="tiny-qwen3", model_cache=cache)
    assert (served_model(settings).id, served_model(settings).path) == ("tiny-qwen3", target)
    assert served_infos(settings) == {"tiny-qwen3": ModelInfo("Qwen3ForCausalLM", 512, CHAT)}


def test_the_engine_loads_a_pulled_directory_by_name(tmp_path, tiny_mixtral_dir):
    from batchapi.engine.model.loader import load_config

    cache = tmp_path / "cache"
    pull(str(tiny_mixtral_dir), cache)
    assert load_config(resolve_model("tiny-mixtral", cache)).architecture == "mixtral"


def test_a_moved_directory_is_reported_not_loaded(tmp_path, tiny_llama_dir):
    cache = tmp_path / "cache"
    moved = copy_of(tiny_llama_dir, tmp_path / "src" / "mine")
    pull(str(moved), cache)
    shutil.rmtree(moved)
    with pytest.raises(ModelNotFound, match="links to .*mine, which is no model directory any more"):
        resolve_model("mine", cache)
    assert list_models(cache) == []


def test_an_unsupported_directory_is_refused_in_one_line(cli, tmp_path, tiny_llama_dir):
    gpt2 = copy_of(tiny_llama_dir, tmp_path / "tiny-gpt2", architectures=["GPT2LMHeadModel"])
    code, out, err = cli("models", "pull", str(gpt2))
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("batchapi models pull: tiny-gpt2: architecture 'GPT2LMHeadModel' is not supported; "
                             "served: LlamaForCausalLM, MistralForCausalLM, ")
    assert not (tmp_path / "cache" / "models" / "tiny-gpt2").exists()


def test_the_cli_pulls_a_directory_and_lists_it(cli, tmp_path, tiny_llama_dir):
    code, out, _ = cli("models", "pull", str(tiny_llama_dir))
    assert code == 0
    target = tmp_path / "cache" / "models" / "tiny-llama"
    assert out.splitlines() == [f"tiny-llama: {target} (LlamaForCausalLM, chat, context 512); "
                                "serve it as BATCHAPI_MODEL=tiny-llama"]
    code, out, _ = cli("models", "list")
    assert code == 0 and "tiny-llama" in out and "LlamaForCausalLM" in out


def test_a_catalog_alias_is_not_taken_by_a_local_directory(tmp_path, tiny_llama_dir):
    clash = copy_of(tiny_llama_dir, tmp_path / "src" / "smollm2-135m-instruct")
    with pytest.raises(ModelNotFound, match="a catalog model's alias; rename it"):
        pull(str(clash), tmp_path / "cache")


def test_a_gguf_file_is_converted_once_and_served_by_its_name(tmp_path, smollm2_dir):
    from batchapi.engine.model.loader import load_config

    cache = tmp_path / "cache"
    gguf_file = write_tiny_gguf(tmp_path / "tiny-gguf-llama.gguf", smollm2_dir)
    target = pull(str(gguf_file), cache)
    assert target == cache / "models" / "tiny-gguf-llama" and not target.is_symlink()
    assert json.loads((target / READY_MARKER).read_text()) == {"source": str(gguf_file)}
    assert model_info(target) == ModelInfo("llama", 512, CHAT)  # a GGUF has no architectures: the model_type
    config = load_config(resolve_model("tiny-gguf-llama", cache))
    assert (config.architecture, config.num_layers, config.vocab_size) == ("llama", 2, 1024)
    before = (target / "model.safetensors").stat().st_mtime_ns
    assert pull(str(gguf_file), cache) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == before  # converted once
    other = tmp_path / "elsewhere" / "tiny-gguf-llama.gguf"
    other.parent.mkdir()
    shutil.copy(gguf_file, other)
    with pytest.raises(ModelNotFound, match="already holds 'tiny-gguf-llama', converted from .*/tiny-gguf-llama.gguf"):
        pull(str(other), cache)


@pytest.mark.parametrize("architecture", GEMMA_GGUF)
def test_a_gemma_gguf_is_converted_and_the_engine_answers_as_transformers(tmp_path, smollm2_dir, architecture):
    """transformers' GGUF reader takes llama.cpp's 1 + w norms back to w; the engine folds them in
    again, and its greedy tokens are those of transformers on the converted directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from batchapi.engine import EngineConfig, GenerationRequest, LLMEngine, SamplingParams

    target = pull(str(write_tiny_gguf(tmp_path / f"tiny-{architecture}.gguf", smollm2_dir, architecture)),
                  tmp_path / "cache")
    model_type = {"gemma2": "gemma2", "gemma3": "gemma3_text"}[architecture]  # a GGUF has no architectures
    assert model_info(target) == ModelInfo(model_type, 512, CHAT)
    prompt = list(range(5, 25))  # past the 8-token window of the local layer
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager")
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    engine = LLMEngine(EngineConfig(model_path=target, dtype="float32", kv_cache_bytes=4 << 20))
    engine.add_request(GenerationRequest("g", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    results = [r for _ in range(40) if engine.has_unfinished() for r in engine.step()]
    assert results[0].outputs[0].token_ids == expected


@pytest.mark.parametrize(("architecture", "metadata", "named"), [
    ("phi3", {}, "'phi3'"),
    ("llama", {"expert_count": 8}, "'llama with 8 experts (Mixtral)'"),
])
def test_a_gguf_of_an_unsupported_architecture_is_refused_in_one_line(cli, tmp_path, smollm2_dir, architecture,
                                                                      metadata, named):
    gguf_file = write_tiny_gguf(tmp_path / "other.gguf", smollm2_dir, architecture, **metadata)
    code, _, err = cli("models", "pull", str(gguf_file))
    assert code == 1 and len(err) == 1, err
    assert err[0] == (f"batchapi models pull: other.gguf: GGUF architecture {named} is not supported; GGUF files "
                      "of llama, qwen2, qwen3, qwen3moe, gemma2, gemma3 are (Mistral's included; a Mixtral: pull its Hugging Face "
                      "directory)")
    assert not (tmp_path / "cache" / "models" / "other").exists()


def test_a_file_that_is_no_gguf_is_refused(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelNotFound, match="fake.gguf is not a GGUF file"):
        pull(str(fake), tmp_path / "cache")


def test_supported_and_unsupported_raise_one_type(tmp_path, tiny_llama_dir):
    gpt2 = copy_of(tiny_llama_dir, tmp_path / "tiny-gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModel):
        pull(str(gpt2), tmp_path / "cache")
