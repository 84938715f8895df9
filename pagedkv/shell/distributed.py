"""Several ranks: one core and scheduler (rank 0), every rank's pages, through torch.distributed.

Rank 0 runs the engine. Before each forward it broadcasts the forward's ``KVMetadata``, its query
tokens and the set of requests its worker holds; every other rank drops rows rank 0 dropped and
installs the same snapshot with the same generation checks, so a rank that missed a step sees a
stale or conflicting snapshot and raises instead of computing on wrong pages. This module moves
metadata only; how a model is cut into shards is ``pagedkv.models.parallel``'s.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedkv.shell.attention import AttentionBackend
from pagedkv.shell.pool import PagePool
from pagedkv.shell.rank import Rank
from pagedkv.shell.worker import ForwardBatch, Worker


class Leader:
    """Rank 0's model for the engine: broadcasts each forward, then runs its own shard. ``worker``:
    rank 0's worker, whose installed requests every follower keeps and no other."""

    capturable = False  # it talks to other processes each forward: never inside a CUDA graph

    def __init__(self, model: Any, worker: Worker) -> None:
        self.model, self.config, self.dtype, self.device = model, model.config, model.dtype, model.device
        self.worker = worker
        worker.cuts = []  # (rows the core cut back: each follower's worker cuts them too)
        self.broadcast_seconds = 0.0  # time spent distributing metadata (bench/ranks.py)

    def forward(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        pool: PagePool,
        backend: AttentionBackend,
        layout: Any,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        held = sorted({key[0] for key in self.worker.rows}, key=str)
        t0 = time.perf_counter()
        cuts, self.worker.cuts = self.worker.cuts, []
        flat = batch.source is not None  # (laid out one query token a row: each follower lays it out so too)
        dist.broadcast_object_list([("step", batch.snapshot, tokens.tolist(), (held, cuts, flat))], src=0)
        self.broadcast_seconds += time.perf_counter() - t0
        out: torch.Tensor = self.model.forward(tokens, batch, pool, backend, layout, logits_at)
        return out

    @staticmethod
    def stop() -> None:
        dist.broadcast_object_list([("stop", None, None, None)], src=0)


def follow(model: Any, rank: Rank, backend: AttentionBackend, fail_at: int | None = None) -> int:
    """A non-zero rank: mirror rank 0's worker, install, run the shard; returns the steps run."""
    pool, worker, layout = rank.pool, rank.worker, rank.layout
    steps = 0
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        op, meta, tokens, held = box[0]
        if op == "stop":
            return steps
        held, cuts, flat = held
        gone = [rid for rid in {k[0] for k in worker.rows} if rid not in set(held)]
        worker.remove(gone)
        for rid, blocks, generation in cuts:
            worker.cut(rid, blocks, generation)
        batch = worker.install(meta, token_rows=flat)  # the same generation checks as rank 0's
        if fail_at is not None and steps == fail_at:
            raise RuntimeError(f"rank {dist.get_rank()} failed at step {steps} (injected)")
        model.forward(torch.tensor(tokens), batch, pool, backend, layout)
        steps += 1


def init(rank: int, world: int, init_file: str, timeout_s: float = 60.0, backend: str = "gloo") -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared hosts)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def describe(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()
