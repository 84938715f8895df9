"""CUDA-graph decode: one capture per batch-size bucket, replayed over the worker's persistent buffers.

The worker's block tables, lengths, slots and positions live in buffers sized once, so a graph
captured over views of them replays with whatever the latest install wrote. A batch smaller than
its bucket is padded: padding rows are never installed, their slots point at the null block and
their logits are ignored. Captures are made at start-up (``capture``), and dropped when the pool's
geometry changes (a new epoch).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.core.metadata import KVMetadata
from pagedkv.shell.attention.base import AttentionBackend
from pagedkv.shell.rank import Rank
from pagedkv.shell.worker import ForwardBatch


class GraphDecoder:
    """Decode forwards of ``model`` on ``rank`` through ``backend``, one captured graph per bucket."""

    def __init__(self, model: Any, rank: Rank, backend: AttentionBackend,
                 buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> None:  # fmt: skip
        self.model, self.pool, self.worker, self.backend, self.group = model, rank.pool, rank.worker, backend, rank.group
        self.buckets = buckets
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, ForwardBatch]] = {}
        self.epoch: int | None = None

    def capture(self, template: KVMetadata) -> None:
        """Capture every bucket (at start-up), with ``template`` a decode KVMetadata of one row."""
        for n in self.buckets:
            if n > self.worker.max_rows:
                continue
            tokens = torch.zeros(n, dtype=torch.long, device=self.pool.device)
            batch = self.worker.decode_views(n, template)
            s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm up outside the graph (allocations, Triton compilation)
                for _ in range(2):
                    self.model.forward(tokens, batch, self.pool, self.backend, self.group)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = self.model.forward(tokens, batch, self.pool, self.backend, self.group)
            self.graphs[n] = (g, tokens, out, batch)
        self.epoch = self.worker.epoch

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n and b in self.graphs)

    def decode(self, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits of an installed decode batch (rows, vocab), by graph replay (recaptured first when the
        pool was reinitialised: a new epoch)."""
        if self.worker.epoch != self.epoch:
            self.graphs.clear()
            self.capture(batch.metadata)
        n = batch.num_rows
        g, static_tokens, out, _ = self.graphs[self.bucket(n)]
        b = static_tokens.numel()
        if b > n:  # padding rows: the null block's slot, length 1, nothing installed
            self.worker.pad_decode(n, b)
            static_tokens[n:].zero_()
        static_tokens[:n].copy_(tokens)
        g.replay()
        return out[:n]
