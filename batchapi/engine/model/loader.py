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
    "Gemma2ForCausalLM": "gemma2",  # engine.model.gemma: sandwich norms, soft-capping, local/global layers
    "Gemma3ForCausalLM": "gemma3",  # Gemma 2's layers with q/k norm and a rope base of its own for local layers
}
# the same families' base models, as decoder embedding models are saved (batchapi.encoder runs them)
BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
               "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
QK_NORM = {"qwen3", "qwen3_moe", "gemma3"}
GEMMA = {"gemma2", "gemma3"}


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


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: dict | None  # HF rope_scaling / rope_parameters of a non-default rope_type


@dataclass(frozen=True)
class GemmaConfig:
    """What Gemma 2 and 3 add to the Llama layout (engine.model.gemma)."""

    attn_softcap: float  # attention logits soft-capped: c * tanh(s / c); 0: not (Gemma 3)
    final_softcap: float  # the output logits likewise; 0: not


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
    # each layer's sliding attention window (a token sees itself and the window - 1 before it);
    # 0: the whole context. Empty: 0 for every layer
    layer_windows: tuple[int, ...] = ()
    # each layer's rope: Gemma 3's local layers have a base (and scaling) apart from the global ones
    local_rope: Rope | None = None
    local_layers: frozenset[int] = frozenset()  # the layers on local_rope
    attn_scale: float | None = None  # the query scaling; None: head_dim ** -0.5
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_tanh (Gemma)
    gemma: GemmaConfig | None = None

    @property
    def context_limit(self) -> int:
        """The most positions a sequence may hold here."""
        return self.max_position_embeddings

    @property
    def kv_window(self) -> int | None:
        """The window of every layer, where every layer has one (the widest): the KV blocks before it
        can be released. None where some layer sees the whole context."""
        windows = self.layer_windows or (0,) * self.num_layers
        return max(windows) if all(windows) else None

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
        )
        assert not self.layer_windows or len(self.layer_windows) == self.num_layers, (
            f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")


def _rope(raw: dict, params: dict | None = None, default_theta: float = 10000.0) -> Rope:
    # transformers 5 writes rope_parameters; older configs rope_theta and rope_scaling
    params = params if params is not None else raw.get("rope_parameters") or {}
    theta = params.get("rope_theta") or raw.get("rope_theta") or default_theta
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        kind = rope_type(scaling)
        if kind not in KINDS:
            raise UnsupportedModelError(f"rope scaling {kind!r} is not supported ({', '.join(KINDS)} are)")
    return Rope(float(theta), scaling)


def _gemma_ropes(family: str, raw: dict) -> tuple[Rope, Rope | None]:
    """Gemma 3's global and local ropes (rope_parameters keyed by layer type, or the older
    rope_theta, rope_scaling and rope_local_base_freq); Gemma 2 has one."""
    params = raw.get("rope_parameters") or {}
    if family == "gemma2":
        return _rope(raw), None
    full, local = params.get("full_attention"), params.get("sliding_attention")
    if full is None and local is None:  # the older layout: rope_scaling applies to the global layers
        return (_rope(raw, {}, 1_000_000.0),
                Rope(float(raw.get("rope_local_base_freq") or 10_000.0), None))
    return (_rope({}, full or {}, 1_000_000.0), _rope({}, local or {}, 10_000.0))


def _layer_types(family: str, raw: dict) -> list[str]:
    """Each layer's attention, "sliding_attention" or "full_attention", as transformers' configs
    derive it where config.json has no layer_types."""
    layers = raw["num_hidden_layers"]
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    if family in GEMMA:
        pattern = 2 if family == "gemma2" else raw.get("sliding_window_pattern") or 6
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if family in ("mistral", "mixtral") or (family == "qwen3_moe" and raw.get("use_sliding_window")):
        return ["sliding_attention"] * layers
    if family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        first = raw.get("max_window_layers", layers)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return ["full_attention"] * layers


def _windows(family: str, raw: dict) -> tuple[int, ...]:
    """Each layer's attention window as transformers applies it: Mistral's and Mixtral's whenever the
    config sets one, Qwen's only with ``use_sliding_window``, Gemma's on its sliding layers; 0
    where a layer sees the whole context (a window as wide as the context is none)."""
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window"):
        window = None
    if not window or window >= raw.get("max_position_embeddings", 4096):
        return ()
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in _layer_types(family, raw))


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
    archs = [BASE_MODELS.get(a, a) for a in raw.get("architectures") or []]
    arch = next((a for a in archs if a in SUPPORTED), None)
    if not archs:  # some converters write only model_type (Gemma 3's text model: gemma3_text)
        kind = {"gemma3_text": "gemma3"}.get(raw.get("model_type"), raw.get("model_type"))
        arch = next((a for a, family in SUPPORTED.items() if family == kind), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or raw.get('model_type')!r} is not supported; "
            f"this engine runs {sorted(SUPPORTED)}"
        )
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("MLP biases are not supported")
    heads = raw["num_attention_heads"]
    family = SUPPORTED[arch]
    windows = _windows(family, raw)
    rope, local_rope, gemma = _rope(raw), None, None
    if family in GEMMA:
        if raw.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional attention (an embedding Gemma) is not a causal LM")
        act = raw.get("hidden_activation") or "gelu_pytorch_tanh"  # what transformers' Gemma MLP reads
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(f"Gemma's MLP activation {act!r} is not supported (gelu_pytorch_tanh is)")
        rope, local_rope = _gemma_ropes(family, raw)
        gemma = GemmaConfig(float(raw.get("attn_logit_softcapping") or 0.0),
                            float(raw.get("final_logit_softcapping") or 0.0))
    local = [i for i, kind in enumerate(_layer_types(family, raw)) if kind == "sliding_attention"]
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
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family in GEMMA)),
        qkv_bias=SUPPORTED[arch] == "qwen2" or bool(raw.get("attention_bias")),
        eos_token_ids=_eos_ids(raw, Path(model_dir)),
        qk_norm=family in QK_NORM,
        moe=_moe(family, raw),
        layer_windows=windows,
        local_rope=local_rope if local_rope != rope else None,
        local_layers=frozenset(local) if local_rope is not None and local_rope != rope else frozenset(),
        attn_scale=raw.get("query_pre_attn_scalar", 256) ** -0.5 if family in GEMMA else None,
        hidden_act="gelu_tanh" if family in GEMMA else "silu",
        gemma=gemma,
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
