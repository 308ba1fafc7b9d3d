"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2; with sparse MoE MLPs, Qwen3-MoE
and Mixtral; with Gemma's layers, engine.model.gemma, Gemma 2 and 3) over a paged KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from batchapi.engine.model.gemma import NORMS, GemmaDecoderLayer, norm_weight, soft_cap
from batchapi.engine.model.layers import MLP, Attention, AttentionMetadata, RMSNorm, input_norm
from batchapi.engine.model.linears import AmxBf16Linear, Avx512Bf16Linear, Bf16StoredLinear
from batchapi.engine.model.loader import ModelConfig
from batchapi.engine.model.moe import SparseMoE
from batchapi.kernels.cpu import attention as cpu_attention
from batchapi.kernels.cpu import decoder as cpu_decoder
from batchapi.kernels.cpu import elementwise as cpu_elementwise

__all__ = ["AttentionMetadata", "CausalLM"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, index: int):
        super().__init__()
        self.ops = ops
        self.self_attn = Attention(cfg, ops, index)
        moe = cfg.moe
        if moe is not None and index in moe.sparse_layers:
            self.mlp = SparseMoE(cfg.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.normalize,
                                 moe.weights_in_dtype, ops)
        else:
            self.mlp = MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, ropes, meta):
        x, residual = input_norm(self.ops, x, residual, self.input_layernorm)
        x = self.self_attn.forward(x, positions, ropes, meta)
        norm = self.post_attention_layernorm
        x, residual = self.ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp.forward(x), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        # built on the meta device and loaded: a weight of our own skips nn.Embedding's random init,
        # whose normal_ on meta tensors imports torch._dynamo (1.7 s of a worker's start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        layer = GemmaDecoderLayer if cfg.gemma else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, ops, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)  # [max_pos, D], set by the runner
        # the local layers' rope table where it differs (Gemma 3), else the same tensor
        self.register_buffer("cos_sin_local", torch.empty(0), persistent=False)
        self.embed_scale: float | None = None  # Gemma's sqrt(hidden), rounded to the weights' dtype at load
        self.final_softcap = cfg.gemma.final_softcap if cfg.gemma else 0.0
        # a step's layers in one C call where they allow it (layers_in_c); False turns it off
        self.layers_in_c = True
        # (its key, it, the projections whose forward a profiler may replace)
        self._c_layers: tuple[tuple, cpu_decoder.DecoderLayers | None, list[nn.Module]] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logit_rows: torch.Tensor, hidden_rows: torch.Tensor | None = None):
        """input_ids, positions [T]; logit_rows [S] token indices to score -> logits [S, V] in the
        model's dtype (the sampler works in fp32 where it needs to; greedy needs no copy). With
        ``hidden_rows`` [R] (prompt logprobs): (logits, their final normed hidden states [R, H]),
        which ``logits`` turns into logits a few rows at a time."""
        rows = logit_rows if hidden_rows is None else torch.cat([logit_rows, hidden_rows])
        x = self.final_hidden(input_ids, positions, meta, rows)  # [S (+ R), H]
        if hidden_rows is None:
            return self.logits(x)  # [S, V]
        return self.logits(x[: len(logit_rows)]), x[len(logit_rows):]

    @property
    def greedy_in_lm_head(self) -> bool:
        """Whether ``greedy`` runs: the lm_head takes its argmax without writing logits (the C kernels:
        bf16-stored, AVX512-BF16 and AMX), and no soft cap lies between them."""
        return hasattr(self.lm_head, "argmax") and not self.final_softcap

    def greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               logit_rows: torch.Tensor) -> torch.Tensor:
        """``forward(...).argmax(-1)`` -> [S] int64, the logits never written (``greedy_in_lm_head``)."""
        return self.lm_head.argmax(self.final_hidden(input_ids, positions, meta, logit_rows))

    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     rows: torch.Tensor) -> torch.Tensor:
        """The final normed hidden states [len(rows), H] of the tokens ``rows`` index."""
        x, residual = self.embed_tokens(input_ids), None  # [T, H]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        ropes = (self.cos_sin, self.cos_sin_local)  # [max_pos, D] each: global, local layers
        ran = self._run_layers_in_c(x, positions, meta) if self.layers_in_c else None
        if ran is not None:
            x, residual = ran
        else:
            for layer in self.layers:  # each module's forward called straight: a step makes ~400 such calls
                x, residual = layer.forward(x, residual, positions, ropes, meta)
        x = x.index_select(0, rows)  # [S, H]: only the tokens that get sampled (and scored)
        residual = residual.index_select(0, rows)
        x, _ = self.ops.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x

    def _run_layers_in_c(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """The layers' (output, residual) from one C call (kernels/cpu/decoder.py: the same kernels with
        the same arguments as the Python loop, so the same bits), or None where this model, its ops or
        this step are not ones it runs as the loop does."""
        layers = self._decoder_layers()
        if layers is None:
            return None
        return layers.run(x, positions, meta.slot_mapping, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                          self.ops.invariant, meta.kv_copies)

    def _decoder_layers(self) -> cpu_decoder.DecoderLayers | None:
        """The layers for kernels/cpu/decoder.py, made once for these caches and rope tables; None where
        any layer, op or projection is not the one it calls (another family's, the torch twin's, a
        forward replaced on the instance by a profiler)."""
        ops = self.ops
        if (ops.name != "cpu" or ops.rms_norm is not cpu_elementwise.rms_norm
                or ops.fused_add_rms_norm is not cpu_elementwise.fused_add_rms_norm
                or ops.rotary_store is not cpu_elementwise.rotary_store
                or getattr(ops.paged_attention, "func", ops.paged_attention) is not cpu_attention.paged_attention):
            return None
        ends = (self.layers[0].self_attn, self.layers[-1].self_attn) if len(self.layers) else ()
        key = (*(t.data_ptr() for a in ends for t in (a.k_cache, a.v_cache)), self.cos_sin.data_ptr(),
               self.cos_sin_local.data_ptr())
        if self._c_layers is None or self._c_layers[0] != key:
            self._c_layers = (key, *self._make_decoder_layers())
        _, layers, projections = self._c_layers
        if layers is None or any("forward" in m.__dict__ for m in projections):
            return None
        return layers

    def _make_decoder_layers(self) -> tuple[cpu_decoder.DecoderLayers | None, list[nn.Module]]:
        """(the layers for kernels/cpu/decoder.py or None, their projections in order)."""
        kernels = {Avx512Bf16Linear: "linear_bf16", AmxBf16Linear: "linear_amx", Bf16StoredLinear: "linear_bf16w"}
        cfg, out, all_projections = self.cfg, [], []
        if self.embed_scale is not None or not len(self.layers):
            return None, []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (type(layer) is not DecoderLayer or type(mlp) is not MLP or mlp.act_and_mul is not
                    cpu_elementwise.silu_and_mul or attn.q_norm is not None or attn.softcap):
                return None, []
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(type(p) not in kernels for p in projections) or any(p.bias is not None for p in projections[1:]):
                return None, []
            all_projections += projections
            qkv_bias = attn.qkv_proj.bias if type(attn.qkv_proj) is Bf16StoredLinear else attn.qkv_proj.panel_bias
            if qkv_bias is not None and (qkv_bias.dtype != torch.float32 or not qkv_bias.is_contiguous()):
                return None, []  # the float32 kernel's bias as matmul.linear would pass it
            out.append(cpu_decoder.Layer(
                *((kernels[type(p)], p.packed_weight) for p in projections), qkv_bias,
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.k_cache, attn.v_cache,
                self.cos_sin_local if attn.local_rope else self.cos_sin, attn.window))
        first = self.layers[0].self_attn
        layers = cpu_decoder.DecoderLayers(out, cfg.hidden_size, cfg.intermediate_size, first.num_heads,
                                           first.num_kv_heads, first.head_dim, self.layers[0].input_layernorm.eps,
                                           first.scale)
        return (layers, all_projections) if layers.usable else (None, [])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states [S, H] -> logits [S, V]."""
        logits = self.lm_head.forward(hidden)
        return soft_cap(logits, self.final_softcap) if self.final_softcap else logits

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face tensors in, fusing q/k/v and gate/up."""
        tied = self.cfg.tie_word_embeddings or "lm_head.weight" not in tensors
        if tied:  # moving the module between devices unties the shared parameter
            self.lm_head.weight = self.embed_tokens.weight
        own = dict(self.named_parameters())
        done = set()
        gemma = self.cfg.gemma is not None
        if gemma:  # rounded as transformers rounds it: an fp32 scalar cast to the weights' dtype
            self.embed_scale = float(torch.tensor(self.cfg.hidden_size**0.5).to(self.embed_tokens.weight.dtype))

        def put(name: str, value: torch.Tensor) -> None:
            if gemma and name.endswith("norm.weight"):
                value = norm_weight(value)
            param = own[name]
            assert param.shape == value.shape, f"{name}: checkpoint {tuple(value.shape)} vs model {tuple(param.shape)}"
            param.data.copy_(value)
            done.add(name)

        for i in range(self.cfg.num_layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            attn = hf + "self_attn."
            put(me + "self_attn.qkv_proj.weight", torch.cat([tensors[attn + p + "_proj.weight"] for p in "qkv"]))
            if self.cfg.qkv_bias:
                put(me + "self_attn.qkv_proj.bias", torch.cat([tensors[attn + p + "_proj.bias"] for p in "qkv"]))
            put(me + "self_attn.o_proj.weight", tensors[attn + "o_proj.weight"])
            if self.cfg.qk_norm:
                put(me + "self_attn.q_norm.weight", tensors[attn + "q_norm.weight"])
                put(me + "self_attn.k_norm.weight", tensors[attn + "k_norm.weight"])
            if isinstance(self.layers[i].mlp, SparseMoE):
                for name, value in moe_tensors(tensors, hf, self.cfg.moe.num_experts):
                    put(me + name, value)
            else:
                put(me + "mlp.gate_up_proj.weight",
                    torch.cat([tensors[hf + "mlp.gate_proj.weight"], tensors[hf + "mlp.up_proj.weight"]]))
                put(me + "mlp.down_proj.weight", tensors[hf + "mlp.down_proj.weight"])
            for norm in NORMS if gemma else NORMS[:2]:
                put(me + norm + ".weight", tensors[hf + norm + ".weight"])
        put("embed_tokens.weight", tensors["model.embed_tokens.weight"])
        put("norm.weight", tensors["model.norm.weight"])
        if not tied:
            put("lm_head.weight", tensors["lm_head.weight"])
        missing = set(own) - done
        assert not missing, f"weights missing from the checkpoint: {sorted(missing)[:5]}"


def moe_tensors(tensors: dict[str, torch.Tensor], layer: str, num_experts: int):
    """(our name, tensor) of one layer's router and experts, from a checkpoint of one expert a tensor
    (Qwen3-MoE's ``mlp.experts.{e}.gate_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1``, w3 the up,
    w2 the down projection) or of fused 3-D experts (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I], as transformers holds them in memory)."""
    prefix = layer + ("block_sparse_moe." if layer + "block_sparse_moe.gate.weight" in tensors else "mlp.")
    yield "mlp.gate.weight", tensors[prefix + "gate.weight"]
    fused = tensors.get(prefix + "experts.gate_up_proj")
    for e in range(num_experts):
        ours = f"mlp.experts.{e}."
        if fused is not None:
            gate_up, down = fused[e], tensors[prefix + "experts.down_proj"][e]
        elif prefix.endswith("block_sparse_moe."):
            theirs = f"{prefix}experts.{e}."
            gate_up = torch.cat([tensors[theirs + "w1.weight"], tensors[theirs + "w3.weight"]])
            down = tensors[theirs + "w2.weight"]
        else:
            theirs = f"{prefix}experts.{e}."
            gate_up = torch.cat([tensors[theirs + "gate_proj.weight"], tensors[theirs + "up_proj.weight"]])
            down = tensors[theirs + "down_proj.weight"]
        yield ours + "gate_up_proj.weight", gate_up
        yield ours + "down_proj.weight", down
