"""Tiny random embedding models saved by sentence-transformers itself, so their modules.json,
1_Pooling/config.json and config_sentence_transformers.json are what it writes."""

from __future__ import annotations

from pathlib import Path

from tests.utils.tiny_models import copy_tokenizer

EOS = "<|endoftext|>"


def eos_tokenizer(smollm2_dir: Path, out_dir: Path) -> Path:
    """SmolLM2's tokenizer made to end every text with its EOS, as Qwen3-Embedding's tokenizer does
    (a post-processor appending ``<|endoftext|>``), padding on the left as Qwen3-Embedding's."""
    import json

    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    out_dir.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(smollm2_dir, out_dir)
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS)
    tokenizer.post_processor = TemplateProcessing(single=f"$A:0 {EOS}:0", pair=f"$A:0 {EOS}:0 $B:1 {EOS}:1",
                                                  special_tokens=[(EOS, eos_id)])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)  # text, not chat messages (sentence-transformers
    # renders inputs through a chat template where the tokenizer has one)
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config.update(padding_side="left", pad_token=EOS, eos_token=EOS)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return out_dir


def build_bert(out_dir: Path, minilm_dir: Path, pooling: str | list[str] = "cls", normalize: bool = True,
               include_prompt: bool = True, prompts: dict[str, str] | None = None,
               default_prompt_name: str | None = None, seed: int = 0, max_seq_length: int = 128,
               **overrides) -> Path:
    """A 2-layer random BertModel (hidden 64; ``overrides`` of BertConfig for other shapes) with
    all-MiniLM-L6-v2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**{"vocab_size": len(tokenizer), "hidden_size": 64, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "intermediate_size": 128,
                                    "max_position_embeddings": 512, **overrides}),
                      add_pooling_layer=False)
    return _save_st(out_dir, model, minilm_dir, pooling, normalize, include_prompt, prompts, default_prompt_name,
                    max_seq_length=max_seq_length)


def build_qwen3(out_dir: Path, tokenizer_dir: Path, pooling: str | list[str] = "lasttoken", normalize: bool = True,
                include_prompt: bool = True, prompts: dict[str, str] | None = None,
                default_prompt_name: str | None = None, seed: int = 0, max_seq_length: int = 256,
                **overrides) -> Path:
    """A 2-layer random Qwen3Model (hidden 64, GQA 4/2, head_dim 32; ``overrides`` of Qwen3Config for
    other shapes) with ``tokenizer_dir``'s tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = Qwen3Config(**{"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
                            "pad_token_id": tokenizer.pad_token_id, **overrides})
    model = Qwen3Model(config)
    with torch.no_grad():  # random init is near zero: spread it, and q/k norms not all ones
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return _save_st(out_dir, model, tokenizer_dir, pooling, normalize, include_prompt, prompts, default_prompt_name,
                    max_seq_length=max_seq_length)


def _save_st(out_dir, model, tokenizer_dir, pooling, normalize, include_prompt, prompts, default_prompt_name,
             max_seq_length: int) -> Path:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    raw = out_dir.parent / (out_dir.name + "-hf")
    model.to(torch.float32).save_pretrained(raw, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, raw)
    transformer = Transformer(str(raw), max_seq_length=max_seq_length)
    modules = [transformer, Pooling(model.config.hidden_size, pooling_mode=pooling, include_prompt=include_prompt)]
    if normalize:
        modules.append(Normalize())
    st = SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default_prompt_name,
                             device="cpu")
    st.save(str(out_dir))
    return out_dir
