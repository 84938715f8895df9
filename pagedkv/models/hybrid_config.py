"""The config of a Mamba2 + attention hybrid as its ``config.json`` gives it: Bamba (``BambaForCausalLM``: RoPE on
half of each attention head, a SwiGLU MLP) and granite-4.0-h (``GraniteMoeHybridForCausalLM``: embedding,
residual, attention and logit multipliers, experts beside a shared MLP, attention with or without RoPE)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedkv.shell.pool import StateShape


@dataclass(frozen=True, slots=True)
class HybridConfig:
    arch: str  # "bamba" | "granitemoehybrid"
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: tuple[int, ...]  # the attention layers' indices; the rest are Mamba2 layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    rope_theta: float | None  # None: attention without RoPE
    rotary_dim: int  # the leading part of each head that RoPE turns (Bamba: half)
    attention_scale: float
    # the MLP: a SwiGLU of intermediate_size (Bamba's, granite's shared one), and granite's experts
    intermediate_size: int
    experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    # granite's multipliers (1.0: none)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Mamba2
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 1
    d_state: int = 0
    d_conv: int = 4
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    eos_token_id: int | None = None

    @property
    def inner(self) -> int:
        """The Mamba2 layers' inner width (heads x head_dim)."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.mamba_groups * self.d_state

    @property
    def state(self) -> StateShape:
        return StateShape((self.conv_dim, self.d_conv - 1), (self.mamba_heads, self.mamba_head_dim, self.d_state))

    def is_attention(self, layer: int) -> bool:
        return layer in self.attention

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any]) -> HybridConfig:
        """From a ``config.json`` (its ``model_type``: ``bamba`` or ``granitemoehybrid``); ``ValueError`` or
        ``KeyError`` for what it lacks or what is not served."""
        arch = raw["model_type"]
        n, hidden, heads = int(raw["num_hidden_layers"]), int(raw["hidden_size"]), int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if arch == "bamba":
            attention = tuple(sorted(int(i) for i in raw.get("attn_layer_indices") or ()))
        else:
            types = raw.get("layer_types") or raw.get("layers_block_type")
            if not isinstance(types, list) or len(types) != n:
                raise ValueError(f"layer_types must list the {n} layers' kinds")
            attention = tuple(i for i, t in enumerate(types) if t in ("attention", "full_attention"))
        if any(not 0 <= i < n for i in attention):
            raise ValueError(f"attention layers {list(attention)} are not all among the {n} layers")
        rope = _rope(raw, arch, head_dim)
        mamba_heads = int(raw["mamba_n_heads"])
        expand = raw.get("mamba_expand", 2)
        mamba_head_dim = int(raw.get("mamba_d_head") or expand * hidden // mamba_heads)
        if mamba_heads * mamba_head_dim != int(expand * hidden):
            raise ValueError(
                f"mamba_n_heads x mamba_d_head is {mamba_heads * mamba_head_dim}; mamba_expand x "
                f"hidden_size is {int(expand * hidden)}"
            )
        groups = int(raw.get("mamba_n_groups", 1))
        if mamba_heads % groups:
            raise ValueError(f"mamba_n_heads {mamba_heads} is not a multiple of mamba_n_groups {groups}")
        limit = raw.get("time_step_limit") or (0.0, float("inf"))
        granite = arch == "granitemoehybrid"
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ValueError("attention_bias and mlp_bias are not served for hybrids")
        return cls(
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=n,
            attention=attention,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            max_position=int(raw.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_theta=rope[0],
            rotary_dim=rope[1],
            attention_scale=float(raw.get("attention_multiplier", 1.0)) if granite else head_dim**-0.5,
            intermediate_size=int(raw["shared_intermediate_size" if granite else "intermediate_size"]),
            experts=int(raw.get("num_local_experts", 0)) if granite else 0,
            experts_per_token=int(raw.get("num_experts_per_tok", 0)) if granite else 0,
            expert_size=int(raw["intermediate_size"]) if granite else 0,
            embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)) if granite else 1.0,
            residual_multiplier=float(raw.get("residual_multiplier", 1.0)) if granite else 1.0,
            logits_scaling=float(raw.get("logits_scaling", 1.0)) if granite else 1.0,
            mamba_heads=mamba_heads,
            mamba_head_dim=mamba_head_dim,
            mamba_groups=groups,
            d_state=int(raw["mamba_d_state"]),
            d_conv=int(raw.get("mamba_d_conv", 4)),
            chunk_size=int(raw.get("mamba_chunk_size", 256)),
            conv_bias=bool(raw.get("mamba_conv_bias", True)),
            proj_bias=bool(raw.get("mamba_proj_bias", False)),
            dt_limit=_limit(limit),
            eos_token_id=raw.get("eos_token_id") if isinstance(raw.get("eos_token_id"), int) else None,
        )


def _rope(raw: dict[str, Any], arch: str, head_dim: int) -> tuple[float | None, int]:
    """(RoPE's base or None, the rotary part of a head): Bamba turns half of each head (transformers fixes its
    partial_rotary_factor at 0.5); granite-4.0-h turns whole heads when ``position_embedding_type`` is "rope"."""
    if arch == "granitemoehybrid" and raw.get("position_embedding_type") != "rope":
        return None, 0
    params = raw.get("rope_parameters") or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} is not served for hybrids (only 'default')")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    factor = 0.5 if arch == "bamba" else float(params.get("partial_rotary_factor", 1.0))
    rotary = int(head_dim * factor)
    if rotary % 2:
        raise ValueError(f"a rotary part of {rotary} dimensions is odd")
    return theta, rotary


def _limit(limit: Any) -> tuple[float, float]:
    """``time_step_limit`` as saved (transformers writes infinity as ``{"__float__": "Infinity"}``)."""

    def one(v: Any) -> float:
        return float(v["__float__"]) if isinstance(v, dict) else float(v)

    lo, hi = (one(v) for v in limit)
    if not 0.0 <= lo <= hi or math.isnan(hi):
        raise ValueError(f"time_step_limit {list(limit)} is not a range")
    return lo, hi


def hybrid_shapes(c: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of config ``c`` must hold, with its shape."""
    h, granite = c.hidden_size, c.arch == "granitemoehybrid"
    out = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        ("model.norm.weight" if granite else "model.final_layernorm.weight"): (h,),
    }
    if not c.tie_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        if granite:
            out.update(
                {
                    p + "post_attention_layernorm.weight": (h,),
                    p + "shared_mlp.input_linear.weight": (2 * c.intermediate_size, h),
                    p + "shared_mlp.output_linear.weight": (h, c.intermediate_size),
                }
            )
            if c.experts:
                out.update(
                    {
                        p + "block_sparse_moe.router.layer.weight": (c.experts, h),
                        p + "block_sparse_moe.input_linear.weight": (c.experts, 2 * c.expert_size, h),
                        p + "block_sparse_moe.output_linear.weight": (c.experts, h, c.expert_size),
                    }
                )
        else:
            out.update(
                {
                    p + "pre_ff_layernorm.weight": (h,),
                    p + "feed_forward.gate_proj.weight": (c.intermediate_size, h),
                    p + "feed_forward.up_proj.weight": (c.intermediate_size, h),
                    p + "feed_forward.down_proj.weight": (h, c.intermediate_size),
                }
            )
        if c.is_attention(i):
            kv = c.num_kv_heads * c.head_dim
            out.update(
                {
                    p + "self_attn.q_proj.weight": (c.num_heads * c.head_dim, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, c.num_heads * c.head_dim),
                }
            )
        else:
            m = p + "mamba."
            out.update(
                {
                    m + "in_proj.weight": (c.inner + c.conv_dim + c.mamba_heads, h),
                    m + "out_proj.weight": (h, c.inner),
                    m + "norm.weight": (c.inner,),
                    m + "conv1d.weight": (c.conv_dim, 1, c.d_conv),
                    m + "dt_bias": (c.mamba_heads,),
                    m + "A_log": (c.mamba_heads,),
                    m + "D": (c.mamba_heads,),
                }
            )
            if c.conv_bias:
                out[m + "conv1d.bias"] = (c.conv_dim,)
    return out
