"""Real-size Llama shapes built on a device with transformers' random initialisation (no hub), served by pagedkv's
``Llama``: what bench/gpu_offline.py and bench/gpu_real.py time. Imports nothing of pagedkv's at module level, so
that bench/gpu_real.py's children load the pagedkv of the tree their PYTHONPATH names."""

from __future__ import annotations

import tempfile
from typing import Any

SHAPES = {  # transformers LlamaConfig fields
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8
    ),
    "llama-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
    ),
}
VOCAB = 128_256


def build(shape: str, device: str) -> tuple[Any, int, int]:
    """The model (pagedkv's Llama over transformers' random weights, seed 0, bf16), its layers' matrix parameters a
    token (q, k, v, gate and up are views into qkv and gate_up), the LM head's."""
    import torch
    import transformers

    from pagedkv.models.hf import hf_config
    from pagedkv.models.llama import Llama

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False, **SHAPES[shape]
    )
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.config.architectures = ["LlamaForCausalLM"]  # (as the model's save_pretrained names it)
        hf.config.save_pretrained(d)  # (the config alone: read as `--model DIR` reads it)
        _, ours, _ = hf_config(d)
    sd = dict(hf.state_dict())
    model = Llama(ours, sd, dtype=torch.bfloat16, device=device)  # type: ignore[arg-type]
    del hf, sd
    if device == "cuda":
        torch.cuda.empty_cache()
    return model, model.matmul_params, model.lm_head.numel()


def load(checkpoint: str | None, shape: str, device: str) -> tuple[Any, int, int]:
    """What a bench serves: ``checkpoint``'s weights (../shared/vllm_gpu's, the ones vLLM's side serves: pagedkv's
    loader, bf16) where given, else ``build(shape)``; with its layers' matrix parameters a token and the LM head's."""
    if checkpoint is None:
        return build(shape, device)
    from pagedkv.models.hf import load_model

    model = load_model(checkpoint, dtype="bfloat16", device=device)[0]
    return model, model.matmul_params, model.lm_head.numel()
