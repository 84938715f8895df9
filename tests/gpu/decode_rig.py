"""A SmolLM2-shaped decode on one CUDA rank, shared by bench/gpu_decode.py (its timings) and the GPU tests
(graph replay against the eager step, the fused K/V write): random weights of SmolLM2's exact shapes, bf16,
64 rows of 511 computed tokens each decoding its 512th.
"""

from __future__ import annotations

from typing import Any

import torch

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


class DecodeRig:
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
