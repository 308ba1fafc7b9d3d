"""Read a Hugging Face model directory: config.json into a ModelConfig, safetensors into tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from batchapi.kernels.torch.rope import KINDS, rope_type

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",  # Qwen2's layers with a per-head RMSNorm of q and k before rope, no qkv bias
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3's attention, sparse MoE MLPs (engine.model.moe)
    "MixtralForCausalLM": "mixtral",  # Mistral's attention, a sparse MoE MLP in every layer
}
QK_NORM = {"qwen3", "qwen3_moe"}


class UnsupportedModelError(ValueError):
    """The directory holds a model this engine cannot run."""


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    normalize: bool  # the top-k weights renormalised to sum to 1
    weights_in_dtype: bool  # the routing weights cast to the activations' dtype before scaling
    sparse_layers: frozenset[int]  # the layers whose MLP is the MoE; the rest are dense

    def __post_init__(self):
        assert 0 < self.top_k <= self.num_experts, f"top_k={self.top_k} of {self.num_experts} experts"


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: list[int]
    qk_norm: bool = False  # an RMSNorm over head_dim of each head's q and k, before rope (Qwen3)
    moe: MoEConfig | None = None  # the sparse MLPs of a mixture-of-experts model
    # a sliding attention window narrower than the context: the engine has no windowed attention
    # yet, so its context stops at the window, where full attention and the window's agree exactly
    sliding_window: int | None = None

    @property
    def context_limit(self) -> int:
        """The most positions a sequence may hold here."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
        )


def _rope(raw: dict) -> tuple[float, dict | None]:
    # transformers 5 writes rope_parameters; older configs rope_theta and rope_scaling
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        kind = rope_type(scaling)
        if kind not in KINDS:
            raise UnsupportedModelError(f"rope scaling {kind!r} is not supported ({', '.join(KINDS)} are)")
    return float(theta), scaling


def _window(family: str, raw: dict) -> int | None:
    """The attention window transformers applies: Mistral's and Mixtral's whenever the config sets one,
    Qwen2's and Qwen3's only with ``use_sliding_window``; None where it spans the whole context."""
    window = raw.get("sliding_window")
    applies = family in ("mistral", "mixtral") or bool(raw.get("use_sliding_window"))
    if not applies or not window or window >= raw.get("max_position_embeddings", 4096):
        return None
    return int(window)


def _moe(family: str, raw: dict) -> MoEConfig | None:
    layers = raw["num_hidden_layers"]
    if family == "mixtral":
        return MoEConfig(raw["num_local_experts"], raw["num_experts_per_tok"], raw["intermediate_size"],
                         normalize=True, weights_in_dtype=False, sparse_layers=frozenset(range(layers)))
    if family != "qwen3_moe":
        return None
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    step, dense = raw.get("decoder_sparse_step") or 1, set(raw.get("mlp_only_layers") or [])
    sparse = frozenset(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return MoEConfig(experts, raw["num_experts_per_tok"], raw["moe_intermediate_size"],
                     normalize=bool(raw.get("norm_topk_prob")), weights_in_dtype=True, sparse_layers=sparse)


def _eos_ids(raw: dict, model_dir: Path) -> list[int]:
    eos = raw.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise UnsupportedModelError(f"{model_dir} has no config.json; expected a Hugging Face model directory")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if not archs:  # some converters write only model_type
        arch = next((a for a, kind in SUPPORTED.items() if kind == raw.get("model_type")), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or raw.get('model_type')!r} is not supported; "
            f"this engine runs {sorted(SUPPORTED)}"
        )
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("MLP biases are not supported")
    theta, scaling = _rope(raw)
    heads = raw["num_attention_heads"]
    family = SUPPORTED[arch]
    return ModelConfig(
        architecture=SUPPORTED[arch],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=SUPPORTED[arch] == "qwen2" or bool(raw.get("attention_bias")),
        eos_token_ids=_eos_ids(raw, Path(model_dir)),
        qk_norm=family in QK_NORM,
        moe=_moe(family, raw),
        sliding_window=_window(family, raw),
    )


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's safetensors files, by their Hugging Face names."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{model_dir} has no .safetensors files")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors
