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

from pagedkv.core.config import GroupSpec
from pagedkv.shell.pool import PagePool
from pagedkv.shell.worker import ForwardBatch, Worker


class GraphDecoder:
    def __init__(self, model: Any, pool: PagePool, worker: Worker, backend: Any, group: GroupSpec,
                 buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> None:  # fmt: skip
        self.model, self.pool, self.worker, self.backend, self.group = model, pool, worker, backend, group
        self.buckets = buckets
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, ForwardBatch]] = {}
        self.epoch: int | None = None

    def _static_batch(self, n: int, meta: Any) -> ForwardBatch:
        w = self.worker
        return ForwardBatch(meta, n, n, w.block_tables[:, :n], w.seq_lens[:n], w.kv_start[:n],
                            w.query_start_loc[: n + 1], w.slot_mapping[:n], w.positions[:n])  # fmt: skip

    def capture(self, template: Any) -> None:
        """Capture every bucket (at start-up), with ``template`` a decode KVMetadata of one row."""
        self.backend.decode_only = True
        for n in self.buckets:
            if n > self.worker.max_rows:
                continue
            tokens = torch.zeros(n, dtype=torch.long, device=self.pool.device)
            batch = self._static_batch(n, template)
            s = torch.cuda.Stream()
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
            self.worker.slot_mapping[n:b].zero_()
            self.worker.seq_lens[n:b].fill_(1)
            self.worker.query_start_loc[n + 1 : b + 1] = torch.arange(n + 1, b + 1, dtype=torch.int32,
                                                                     device=self.worker.query_start_loc.device)  # fmt: skip
            self.worker.block_tables[:, n:b].zero_()
            static_tokens[n:].zero_()
        static_tokens[:n].copy_(tokens)
        g.replay()
        return out[:n]
