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

from pagedkv.core.errors import InvariantError
from pagedkv.core import RequestSpec, RowSpec, admit, append_decode, commit_many, initial_state, publish
from pagedkv.core.config import CacheConfig
from pagedkv.core.outputs.metadata import KVMetadata
from pagedkv.shell.attention.base import AttentionBackend
from pagedkv.shell.rank import Rank
from pagedkv.shell.worker import ForwardBatch


GRAPH_ROWS = 512  # the most rows captured for token rows past max_num_seqs (vLLM's largest capture size)

# A prefill forward over a replay's tokens cut into replays (runner.graph_pieces) reads the model's weights once a
# piece: it pays where the forward is bound by the host's launches (a small model), and costs where the device's
# matrix work is (bench/gpu_real.py, Llama-8B shapes on an H100: 9.13 s overlapped with every prefill forward so laid
# out, 7.62 eagerly). Forwards are cut so while a replay's tokens' matrix products take less than an eager forward's
# launches: a layer's ~25 kernels at ~4 us each, at a matrix rate a Hopper reaches. Overlapped, the host launches
# while the device runs the step before, so a quarter of that is what launches cost (Llama-1B shapes on the H100:
# 4.88 s overlapped with every prefill forward of 512 tokens so laid out, 4.10 eagerly; plain, 5.37 against 6.57).
LAUNCH_S_A_LAYER = 100e-6
OVERLAPPED_LAUNCH_SHARE = 0.25
MATRIX_FLOPS = 600e12


def launch_bound_tokens(model: Any, overlapped: bool = False) -> int:
    """The most tokens whose matrix products take less device time than an eager forward's launches
    (``LAUNCH_S_A_LAYER``, a share of it ``overlapped``, ``MATRIX_FLOPS``): the bound ``launches_outweigh`` holds a
    replay's tokens against. A model that does not say its parameters: no bound.

    >>> class Shape:  # (Llama-8B's layers: 6.98 G matrix parameters a token)
    ...     matmul_params, layers = 6_979_321_856, [None] * 32
    >>> launch_bound_tokens(Shape()), launch_bound_tokens(Shape(), overlapped=True)
    (137, 34)
    """
    params = getattr(model, "matmul_params", None)
    layers = len(getattr(model, "layers", ()))
    if not isinstance(params, int) or params <= 0 or not layers:
        return 1 << 62
    launch = LAUNCH_S_A_LAYER * (OVERLAPPED_LAUNCH_SHARE if overlapped else 1.0)
    return max(1, int(launch * layers * MATRIX_FLOPS / (2 * params)))


def launches_outweigh(model: Any, rows: int, overlapped: bool = False) -> bool:
    """Do a forward's launches outweigh the matrix work of ``rows`` tokens (``launch_bound_tokens``)? Where they do
    for a replay's rows, a prefill forward over them is cut into replays (``ModelRunner.pieces``) and a long
    prompt's chunks are capped at them (``EngineArgs.prefill_chunk_cap``): one rule for both.

    >>> class Shape:  # (Llama-8B's layers)
    ...     matmul_params, layers = 6_979_321_856, [None] * 32
    >>> launches_outweigh(Shape(), 512), launches_outweigh(Shape(), 32)
    (False, True)
    """
    return rows > 0 and launch_bound_tokens(model, overlapped) >= rows


def buckets_for(max_rows: int) -> tuple[int, ...]:
    """Graph batch sizes for up to ``max_rows`` rows: powers of two, then steps of 32 past 64 (vLLM's
    shape), and ``max_rows`` itself, so every batch size maps to the smallest bucket that holds it.

    >>> buckets_for(16), buckets_for(100)
    ((1, 2, 4, 8, 16), (1, 2, 4, 8, 16, 32, 64, 96, 100))
    """
    sizes = {b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_rows} | set(range(96, max_rows + 1, 32)) | {max_rows}
    return tuple(sorted(sizes))


def decode_template(config: CacheConfig) -> KVMetadata:
    """A decode snapshot of one row from a scratch core state: what a capture names as its metadata
    (the backends read its phase; the buffers hold the values)."""
    s = initial_state(config)
    s = admit(s, RequestSpec("capture", (RowSpec(1),))).unwrap().state
    s = commit_many(s, [("capture", [1])]).unwrap().state
    s = append_decode(s, ["capture"]).unwrap().state
    return publish(s, ["capture"], "decode").unwrap().effect


class GraphDecoder:
    """Decode forwards of ``model`` on ``rank`` through ``backend``, one captured graph per bucket."""

    def __init__(
        self, model: Any, rank: Rank, backend: AttentionBackend, buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    ) -> None:
        self.model, self.pool, self.worker, self.backend, self.layout = (
            model,
            rank.pool,
            rank.worker,
            backend,
            rank.layout,
        )
        self.config = rank.cache
        # (a bucket's rows are its tokens too: none past the tokens a step may carry, max_num_batched_tokens)
        self.buckets = tuple(b for b in buckets if b <= min(self.worker.forward_rows, self.worker.max_tokens))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, ForwardBatch]] = {}
        self.epoch: int | None = None  # the epoch the graphs were captured in (None: before any install)
        self.captures = 0  # how many times every bucket was captured (start-up, then each new epoch)
        self.replays = 0  # decode forwards served by a replay

    def capture(self, template: KVMetadata | None = None) -> None:
        """Capture every bucket, largest first, into one memory pool; the buffers' rows are padding
        meanwhile (the null block), so nothing installed is touched but what the next install rewrites."""
        template = template if template is not None else decode_template(self.config)
        self.graphs.clear()
        mempool = torch.cuda.graph_pool_handle()
        begin = getattr(self.backend, "begin_graph", None)  # a backend with host-side plans (flashinfer)
        for n in sorted(self.buckets, reverse=True):
            tokens = torch.zeros(n, dtype=torch.long, device=self.pool.device)
            self.worker.pad_decode(0, n)
            batch = self.worker.decode_views(n, template)
            if begin is not None:
                begin(n, batch, self.worker.max_blocks)
            s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm up outside the graph (allocations, Triton compilation)
                for _ in range(2):
                    self.model.forward(tokens, batch, self.pool, self.backend, self.layout)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=mempool):
                out = self.model.forward(tokens, batch, self.pool, self.backend, self.layout)
            self.graphs[n] = (g, tokens, out, batch)
            if begin is not None:
                self.backend.end_graph()  # type: ignore[attr-defined]
        self.worker.last = None  # the padding overwrote what a repeated install would have reused
        self.epoch = self.worker.epoch
        self.captures += 1

    def fits(self, n: int) -> bool:
        return bool(self.buckets) and n <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n and b in self.graphs)

    def decode(self, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits of an installed decode batch (rows, vocab), by graph replay (recaptured first when the
        pool was reinitialised: a new epoch). The logits live in the graph's output buffer: read them
        before the next replay."""
        if self.epoch is None:
            self.epoch = self.worker.epoch  # captured at start-up: good for the first epoch installed
        elif self.worker.epoch != self.epoch:
            rows = batch.num_rows
            self.capture(batch.metadata)
            batch = self.worker.install(batch.snapshot, token_rows=batch.source is not None)  # (the capture padded
            # the rows: written again)
            if batch.num_rows != rows:
                raise InvariantError(f"a captured bucket of {rows} rows installed {batch.num_rows}")
        n = batch.num_rows
        g, static_tokens, out, _ = self.graphs[self.bucket(n)]
        b = static_tokens.numel()
        if b > n:  # padding rows: the null block's slot, length 1, nothing installed
            self.worker.pad_decode(n, b)
            static_tokens[n:].zero_()
        static_tokens[:n].copy_(tokens)
        begin = getattr(self.backend, "begin_graph", None)
        if begin is not None:  # its plan for this batch: host work the graph's kernels then read
            begin(b, batch, self.worker.max_blocks)
        g.replay()
        if begin is not None:
            self.backend.end_graph()  # type: ignore[attr-defined]
        self.replays += 1
        return out[:n]
