"""Decode step of a SmolLM2-shaped model on the GPU: eager vs CUDA-graph replay, batch 1, 8, 64.

Random weights of SmolLM2's exact shapes (the weights package cannot travel to the device machine),
bf16, the `triton` backend. The graph replays over the worker's persistent buffers; its logits are
checked against the eager step's.

    python bench/gpu_decode.py
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from pagedkv.core import RequestSpec, RowSpec, admit, append_decode, commit_many, initial_state, publish
from pagedkv.models.llama import SMOLLM2_SHAPES, random_llama
from pagedkv.shell.attention.triton import TritonBackend
from pagedkv.shell.attention.triton_decode import kv_write
from pagedkv.shell.graphs import GraphDecoder
from pagedkv.shell.rank import build_rank, plan_rank


def fused_write_matches() -> bool:
    """The Triton K/V write kernel leaves the pages exactly as two ``index_copy_`` do."""
    dev = "cuda"
    kp, vp = (torch.randn(33, 16, 3, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = torch.randn(40, 3, 64, device=dev), torch.randn(40, 3, 64, device=dev)
    slots = torch.randperm(33 * 16, device=dev)[:40]
    a, b = kp.clone(), vp.clone()
    kv_write(k, v, a, b, slots)
    kp.view(-1, 3, 64).index_copy_(0, slots, k.bfloat16())
    vp.view(-1, 3, 64).index_copy_(0, slots, v.bfloat16())
    return torch.equal(a, kp) and torch.equal(b, vp)


class DecodeBench:
    """A SmolLM2-shaped model (random weights, bf16) on one rank with the triton backend, 64 rows
    of 511 computed tokens each decoding its 512th, and the graphs of buckets 1, 8 and 64."""

    def __init__(self, backend: Any = None) -> None:
        dev = "cuda"
        self.model = random_llama(SMOLLM2_SHAPES, dtype=torch.bfloat16, device=dev)
        # triton by default: its pool writes K and V with one kernel (backend.kv_write)
        self.backend = backend if backend is not None else TritonBackend()
        plan = plan_rank(self.model.kv_layers(), block_size=16, dtype=torch.bfloat16)
        cfg = plan.cache_config(64 * 40 + 1, max_model_len=40 * 16)
        self.rank = build_rank(plan, cfg, max_rows=64, max_tokens=64 * 600, device=dev, backend=self.backend)
        s = initial_state(cfg)
        self.ids = list(range(64))
        for i in self.ids:
            s = admit(s, RequestSpec(i, (RowSpec(511),))).unwrap().state
        s = commit_many(s, [(i, [511]) for i in self.ids]).unwrap().state
        self.state = append_decode(s, self.ids).unwrap().state  # every row decodes its 512th token
        self.graphs = GraphDecoder(self.model, self.rank, self.backend, buckets=(1, 8, 64))
        self.graphs.capture(self.meta(1))

    def meta(self, batch_size: int) -> Any:
        return publish(self.state, self.ids[:batch_size], "decode").unwrap().effect  # subsets of one generation

    def eager(self, tokens: torch.Tensor, batch: Any) -> torch.Tensor:
        return self.model.forward(tokens, batch, self.rank.pool, self.backend, self.rank.layout)

    def compare(self, batch_size: int) -> tuple[torch.Tensor, Any, float]:
        """(tokens, installed batch, relative difference of graph-replay logits from the eager step's)."""
        batch = self.rank.worker.install(self.meta(batch_size))
        tokens = torch.randint(0, self.model.config.vocab_size, (batch_size,), device="cuda")
        eager = self.eager(tokens, batch).float()
        replay = self.graphs.decode(tokens, batch).float()
        return tokens, batch, ((replay - eager).norm() / eager.norm()).item()


def main() -> None:
    print(f"fused KV write == index_copy_: {fused_write_matches()}")
    bench = DecodeBench()
    print(f"{torch.cuda.get_device_name()}; SmolLM2 shapes, random weights, bf16, triton backend, 512-token contexts")
    print(f"{'batch':>6} {'eager ms':>9} {'graph ms':>9} {'eager/graph':>12} {'logits rel diff':>16} {'transformers ms':>16}")
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
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                      rope_theta=c.rope_theta, tie_word_embeddings=True)  # fmt: skip
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
