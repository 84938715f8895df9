"""Decode step of a SmolLM2-shaped model on the GPU: eager vs CUDA-graph replay, batch 1, 8, 64.

Random weights of SmolLM2's exact shapes (the weights package cannot travel to the device machine),
bf16, the `triton` backend. The graph replays over the worker's persistent buffers; its logits are
checked against the eager step's.

    python bench/gpu_decode.py
"""

from __future__ import annotations

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedkv.models.llama import SMOLLM2_SHAPES  # noqa: E402
from tests.gpu.decode_rig import DecodeRig, fused_write_matches  # noqa: E402


def main() -> None:
    print(f"fused KV write == index_copy_: {fused_write_matches()}")
    bench = DecodeRig()
    print(f"{torch.cuda.get_device_name()}; SmolLM2 shapes, random weights, bf16, triton backend, 512-token contexts")
    print(
        f"{'batch':>6} {'eager ms':>9} {'graph ms':>9} {'eager/graph':>12} {'logits rel diff':>16} {'transformers ms':>16}"
    )
    for batch_size in (1, 8, 64):
        tokens, batch, diff = bench.compare(batch_size)
        t_eager = triton.testing.do_bench(lambda: bench.eager(tokens, batch), return_mode="median")
        t_graph = triton.testing.do_bench(lambda: bench.graphs.decode(tokens, batch), return_mode="median")
        t_hf = hf_step(batch_size)
        print(f"{batch_size:>6} {t_eager:>9.3f} {t_graph:>9.3f} {t_eager / t_graph:>12.2f} {diff:>16.1e} {t_hf:>16.3f}")


def hf_step(batch_size: int) -> float:
    """transformers' own decode step (LlamaForCausalLM, its KV cache) for the same shapes, bf16: one new token per
    sequence after a 511-token prompt."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return float("nan")
    c = SMOLLM2_SHAPES
    cfg = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        rope_theta=c.rope_theta,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, c.vocab_size, (batch_size, 511), device="cuda")
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record()
            model(nxt, past_key_values=past, use_cache=True)
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1))
            past.crop(511)  # back to the prompt, so every timed step is the same step
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
