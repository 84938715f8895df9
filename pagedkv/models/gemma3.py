"""Gemma 3 (text), on the shared Llama-family decoder (models/llama.py): its config as transformers 5.24 reads
``Gemma3TextConfig`` (and the text part of a ``Gemma3Config``), and the decoder's Gemma features it turns on.

Five sliding-window layers to one global by default (``layer_types``, or ``sliding_window_pattern``), RMSNorm
scaling by (1 + w) around attention and the MLP (four norms a layer) and over each head of q and k, the query
scaled by ``query_pre_attn_scalar`` ** -0.5, separate RoPE bases for sliding and global layers
(``rope_parameters`` per layer type, or ``rope_theta`` and ``rope_local_base_freq``), the embedding scaled by
sqrt(hidden), GELU (tanh) in the MLP, soft-capped logits where the config sets it, tied embeddings.
"""

from __future__ import annotations

from typing import Any

from pagedkv.models.gguf import LlamaConfig

GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' defaults (Gemma3TextConfig.default_theta)


def gemma3_config(c: dict[str, Any]) -> LlamaConfig:
    c = {**c, **(c.get("text_config") or {})}  # (a multimodal Gemma3Config: its text part)
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types is None:
        pattern = c.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    rope = c.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    scaling = dict(c.get("rope_scaling") or {}) or {k: v for k, v in full.items() if k != "rope_theta"}
    kind = scaling.pop("type", scaling.get("rope_type", "default"))
    scaling["rope_type"] = scaling.get("rope_type", kind)
    act = c.get("hidden_activation", c.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 3 activation {act!r} is not served (gelu_pytorch_tanh is)")
    if scaling["rope_type"] not in ("default", "linear") or local.get("rope_type", "default") != "default":
        raise ValueError(
            f"Gemma 3 RoPE scaling {scaling['rope_type']!r} is not served (default and linear on global layers are)"
        )
    window = c.get("sliding_window", 4096)
    return LlamaConfig(
        vocab_size=c.get("vocab_size", 262_208),
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=n,
        num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        rope_theta=full.get("rope_theta", c.get("rope_theta", GLOBAL_THETA)),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        max_position=c.get("max_position_embeddings", 131_072),
        tie_embeddings=c.get("tie_word_embeddings", True),
        bos_token_id=c.get("bos_token_id"),
        eos_token_id=c.get("eos_token_id"),
        head_dim_=c.get("head_dim", 256),
        layer_types=tuple(types) if "sliding_attention" in types and window else None,
        sliding_window=window if "sliding_attention" in types and window else None,
        qk_norm=True,
        rope_scaling=tuple(sorted(scaling.items())) if scaling["rope_type"] != "default" else None,
        sandwich_norms=True,
        norm_offset=1.0,
        query_scale=c.get("query_pre_attn_scalar", 256),
        local_rope_theta=local.get("rope_theta", c.get("rope_local_base_freq", LOCAL_THETA)),
        embed_scale=True,
        activation="gelu_tanh",
        final_softcap=c.get("final_logit_softcapping"),
        attn_softcap=c.get("attn_logit_softcapping"),
    )
