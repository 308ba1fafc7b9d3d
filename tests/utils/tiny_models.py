"""Tiny randomly initialised Llama-family models, saved like real HF checkpoints.

They carry the default model's real tokenizer and chat template, so everything that
tokenizes behaves as in production while a forward pass costs microseconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def copy_tokenizer(source_dir: Path, out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source_dir / name).exists():
            shutil.copy(source_dir / name, out_dir / name)


# Gemma's own layout: head_dim apart from hidden/heads, query_pre_attn_scalar its own, a window
# narrower than the test prompts (so windowed layers see less than global ones)
GEMMA = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=12, tie_word_embeddings=True)


def build_tiny_model(out_dir: Path, tokenizer_dir: Path, arch: str = "llama", seed: int = 0,
                     save_dtype: str = "float32", **overrides) -> Path:
    """Save a 2-layer random model of ``arch`` ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral",
    "gemma2", "gemma3") in ``out_dir``, its tensors in ``save_dtype`` ("bfloat16": as most real
    checkpoints are, which the engine in float32 keeps in bf16)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tie_word_embeddings=arch == "llama",
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "mistral":  # its window on every layer (sliding_window in overrides)
        model = MistralForCausalLM(MistralConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":  # head_dim apart from hidden/heads, as Qwen3's own configs have it
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 32, **common}))
    elif arch == "qwen3_moe":  # layer 0 sparse, layer 1 dense (mlp_only_layers), 8 experts of 32, top 2
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2,
                                                      "moe_intermediate_size": 32, "norm_topk_prob": True,
                                                      "mlp_only_layers": [1], **common}))
    elif arch == "mixtral":  # every layer sparse: 4 experts, top 2
        model = MixtralForCausalLM(MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, **common}))
    elif arch == "gemma2":  # a local layer then a global one; both soft-caps low enough to bite
        model = Gemma2ForCausalLM(Gemma2Config(**{**GEMMA, "attn_logit_softcapping": 4.0,
                                                  "final_logit_softcapping": 6.0, **common}))
    elif arch == "gemma3":  # local layers on their own rope base, the global one's rope scaled
        layers = {} if "num_hidden_layers" in overrides else {  # two local layers, then a global one
            "num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}
        model = Gemma3ForCausalLM(Gemma3TextConfig(**{
            **GEMMA, "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}},
            **common, **layers}))
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    # random init gives near-uniform logits; a wider spread makes greedy decoding well separated
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # not all ones, so a skipped norm shows
                param.uniform_(0.5, 1.5)
            if arch.startswith("gemma") and name.endswith("norm.weight"):  # Gemma scales by 1 + w: w not 0
                param.uniform_(-0.5, 0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, save_dtype)).save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


# A template that thinks as Qwen3's does: `enable_thinking` false closes an empty block after the
# generation prompt; an assistant turn's `reasoning_content` is shown again only in the last turn.
THINKING_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == 'assistant' and message.reasoning_content is defined and message.reasoning_content \
and loop.last %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{%- endif %}"""


def build_thinking_model(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 model that can think: SmolLM2's tokenizer with ``<think>`` and ``</think>``
    added (as Qwen3 has them: added, not special) and ``THINKING_TEMPLATE``."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False),
                          AddedToken("</think>", special=False, normalized=False)])
    tokenizer.chat_template = THINKING_TEMPLATE
    source = out_dir.parent / (out_dir.name + "-tokenizer")
    source.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(source)
    # a context long enough for Anthropic's least thinking budget (1,024) and an answer after it
    return build_tiny_model(out_dir, source, "qwen3", seed, max_position_embeddings=2048)
