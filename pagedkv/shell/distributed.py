"""Several ranks: one core and scheduler (rank 0), every rank's pages, through torch.distributed.

Rank 0 runs the engine. Before each forward it broadcasts the forward's ``KVMetadata``, its query
tokens and the set of requests its worker holds; every other rank drops rows rank 0 dropped and
installs the same snapshot with the same generation checks, so a rank that missed a step sees a
stale or conflicting snapshot and raises instead of computing on wrong pages.

The model is sharded tensor-parallel (gpt-fast's way: the model code above does not see ranks):
Q/K/V and gate/up are split by output rows, the output and down projections by input columns and
summed with an all-reduce. Query heads are split into contiguous, as even as possible ranges; each
rank keeps the KV heads its query heads read (SmolLM2's 9 heads and 3 KV heads: 3 ranks hold 3 and
1 each; with 2 ranks the middle KV head is replicated on both), with an explicit head map.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedkv.core.config import GroupSpec
from pagedkv.models.llama import Llama
from pagedkv.shell.attention import AttentionBackend
from pagedkv.shell.pool import PagePool
from pagedkv.shell.worker import ForwardBatch, Worker


def head_plan(num_heads: int, num_kv_heads: int, world: int, rank: int) -> tuple[list[int], list[int], tuple[int, ...]]:
    """(query heads, KV heads kept, local KV index of each query head) of ``rank``."""
    sizes = [num_heads // world + (1 if r < num_heads % world else 0) for r in range(world)]
    start = sum(sizes[:rank])
    q = list(range(start, start + sizes[rank]))
    per_kv = num_heads // num_kv_heads
    kv = sorted({h // per_kv for h in q})
    return q, kv, tuple(kv.index(h // per_kv) for h in q)


def _split(n: int, world: int, rank: int) -> slice:
    sizes = [n // world + (1 if r < n % world else 0) for r in range(world)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


class TPLlama(Llama):
    """One rank's shard of a ``Llama``."""

    def __init__(self, full: Llama, rank: int, world: int) -> None:
        c = full.config
        self.rank, self.world = rank, world
        self.q_heads, self.kv_heads, kv_index = head_plan(c.num_heads, c.num_kv_heads, world, rank)
        self.n_heads, self.n_kv_heads, self.kv_index = len(self.q_heads), len(self.kv_heads), kv_index
        self.config = replace(c, num_kv_heads=len(self.kv_heads))  # this rank's pages hold its KV heads
        self.dtype, self.device = full.dtype, full.device
        self.embed, self.lm_head, self.norm, self.inv_freq = full.embed, full.lm_head, full.norm, full.inv_freq
        hd = c.head_dim

        def rows(w: torch.Tensor, heads: list[int]) -> torch.Tensor:
            return torch.cat([w[h * hd : (h + 1) * hd] for h in heads])

        ff = _split(c.intermediate_size, world, rank)
        self.layers = []
        for L in full.layers:
            o_cols = torch.cat([L["o"][:, h * hd : (h + 1) * hd] for h in self.q_heads], dim=1)
            self.layers.append({
                "ln1": L["ln1"], "ln2": L["ln2"], "q": rows(L["q"], self.q_heads), "k": rows(L["k"], self.kv_heads),
                "v": rows(L["v"], self.kv_heads), "o": o_cols, "gate": L["gate"][ff], "up": L["up"][ff],
                "down": L["down"][:, ff],
            })  # fmt: skip

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial)  # row-parallel output and down projections: sum the shards
        return partial


class Leader:
    """Rank 0's model for the engine: broadcasts each forward, then runs its own shard."""

    def __init__(self, model: Llama) -> None:
        self.model, self.config, self.dtype, self.device = model, model.config, model.dtype, model.device
        self.worker: Worker | None = None
        self.broadcast_seconds = 0.0  # time spent distributing metadata (bench/ranks.py)

    def forward(self, tokens: torch.Tensor, batch: ForwardBatch, pool: PagePool, backend: AttentionBackend,
                group: GroupSpec) -> torch.Tensor:  # fmt: skip
        assert self.worker is not None
        held = sorted({key[0] for key in self.worker.rows}, key=str)
        t0 = time.perf_counter()
        dist.broadcast_object_list([("step", batch.metadata, tokens.tolist(), held)], src=0)
        self.broadcast_seconds += time.perf_counter() - t0
        return self.model.forward(tokens, batch, pool, backend, group)

    @staticmethod
    def stop() -> None:
        dist.broadcast_object_list([("stop", None, None, None)], src=0)


def follow(model: TPLlama, pool: PagePool, worker: Worker, backend: AttentionBackend, group: GroupSpec,
           fail_at: int | None = None) -> int:  # fmt: skip
    """A non-zero rank: mirror rank 0's worker, install, run the shard; returns the steps run."""
    steps = 0
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        op, meta, tokens, held = box[0]
        if op == "stop":
            return steps
        gone = [rid for rid in {k[0] for k in worker.rows} if rid not in set(held)]
        worker.remove(gone)
        batch = worker.install(meta)  # the same generation checks as rank 0's
        if fail_at is not None and steps == fail_at:
            raise RuntimeError(f"rank {dist.get_rank()} failed at step {steps} (injected)")
        model.forward(torch.tensor(tokens), batch, pool, backend, group)
        steps += 1


def init(rank: int, world: int, init_file: str, timeout_s: float = 60.0, backend: str = "gloo") -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared hosts)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip


def describe(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()
