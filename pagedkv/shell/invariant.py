"""Batch-invariant numerics (``EngineArgs(batch_invariant=True)``, ``pagedkv generate --batch-invariant``): what a
request's row computes never follows the rest of the batch, so its greedy and seeded tokens are the same served
alone or beside any others, chunked, preempted and recomputed, verified beside its drafts, overlapped.

Three sources of difference, and what this module does about each:

- Attention: a kernel that cuts a row's keys by the batch (a split count, a block size chosen from the longest
  row), and a prefix read by a prefill kernel where a decode read it before. Every query token is laid out as a
  decode row of its own (the worker's token rows: ``Engine._token_rows``) and read by a kernel whose key splits
  have a fixed size, merged in order: the Triton decode kernel on CUDA (``triton_decode.SPLIT_KEYS``), the torch
  backend's ``split_attention`` elsewhere.
- Matrix products: a GEMM library picks its kernel, and with it how a row's sums are cut, by the row count. Each
  product runs over row chunks whose counts lie in a range where the device's GEMM keeps a row's bits
  (``PRODUCT_ROWS``: measured, ``bench/rows.py`` and ``bench/gpu_rows.py``; tests/shell/test_invariant.py pins the
  CPU's): fewer rows are padded with zeros, more are cut into chunks.
- Norms: CUDA's reductions pick their layout by the row count too: there a norm runs over row chunks of one fixed
  size (``NORM_ROWS``). The CPU reduces each row alone in one order (no chunking).

Elementwise work (activations, RoPE, residuals) is a row's own already; sampling draws its noise from the
request's seed and counter alone (``shell.sampling``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedkv.core.errors import ErrorCode
from pagedkv.core.outputs.metadata import Phase
from pagedkv.shell.attention.base import AttentionBackend, LayerAttention
from pagedkv.shell.errors import refuse
from pagedkv.shell.pool import KVWrite
from pagedkv.shell.worker import ForwardBatch

# (fewest, most) rows a product runs over, by device type: the range in which the device's GEMM gives a row the
# same bits at every row count (None: no bound). CPU (MKL, fp32): 1-3, 5-7 and 9-11 rows take other kernels,
# every count from 12 agrees (bench/rows.py). CUDA (cuBLAS, bf16, H200): 8-512 rows agree (bench/gpu_rows.py).
PRODUCT_ROWS: dict[str, tuple[int, int | None]] = {"cpu": (16, None), "cuda": (8, 512)}
NORM_ROWS: dict[str, int | None] = {"cpu": None, "cuda": 512}  # a norm's row chunk (None: the rows as they are)

Product = Callable[..., torch.Tensor]


def plain_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` (+ ``bias``): a model's product when the batch may change a row's bits."""
    return x @ w.T if bias is None else torch.addmm(bias, x, w.T)


def row_product(fewest: int, most: int | None) -> Product:
    """``plain_product`` over row chunks of ``fewest`` to ``most`` rows: fewer rows padded with zeros (their
    results dropped), more cut into chunks of ``most`` (the last padded)."""

    def product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _in_chunks(lambda part: plain_product(part, w, bias), x, fewest, most)

    return product


def row_norm(rows: int | None) -> Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]:
    """A norm over its input's last dimension run over row chunks of exactly ``rows`` rows (the leading
    dimensions flattened; ``None``: the input as it is)."""

    def norm(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if rows is None:
            return fn(x)
        flat = x.reshape(-1, x.shape[-1])
        return _in_chunks(fn, flat, rows, rows).reshape(*x.shape[:-1], -1)

    return norm


def _in_chunks(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, fewest: int, most: int | None
) -> torch.Tensor:
    m = x.shape[0]
    if fewest <= m and (most is None or m <= most):
        return fn(x)
    step = m if most is None else most
    outs = []
    for start in range(0, max(m, 1), step):
        part = x[start : start + step]
        n = part.shape[0]
        if n < fewest:
            part = torch.cat([part, part.new_zeros((fewest - n, *part.shape[1:]))])
        outs.append(fn(part)[:n])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class InvariantBackend:
    """The attention backend of a batch-invariant engine, and the products and norms its model runs (a model
    asks its backend for them: ``product``, ``norm``). Attention: one query token a decode row, read with
    fixed key splits: the triton backend on CUDA, the torch backend's ``split_attention`` elsewhere."""

    def __init__(self, attention: AttentionBackend, device: torch.device) -> None:
        self.attention = attention
        self.name = f"invariant/{attention.name}"
        self.capturable = getattr(attention, "capturable", False)
        self.fp8_pages = getattr(attention, "fp8_pages", False)
        fewest, most = PRODUCT_ROWS.get(device.type, PRODUCT_ROWS["cpu"])
        self.product = row_product(fewest, most)
        self.norm = row_norm(NORM_ROWS.get(device.type, NORM_ROWS["cpu"]))

    @property
    def kv_write(self) -> KVWrite | None:
        return self.attention.kv_write

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
        if batch.metadata.phase is not Phase.DECODE:
            raise refuse(
                ErrorCode.INVALID,
                "batch-invariant attention reads one query token a row (the worker's token rows); this forward "
                "has rows of several",
            )
        return self.attention.forward(q, k_pages, v_pages, batch, layer)
