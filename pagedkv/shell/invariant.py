"""Batch-invariant numerics (``EngineArgs(batch_invariant=True)``, ``pagedkv generate --batch-invariant``): what a
request's row computes never follows the rest of the batch, so its greedy and seeded tokens are the same served
alone or beside any others, chunked, preempted and recomputed, verified beside its drafts, overlapped.

Three sources of difference, and what this module does about each:

- Attention: a kernel that cuts a row's keys by the batch (a split count, a block size chosen from the longest
  row), and a prefix read by a prefill kernel where a decode read it before. Every query token is laid out as a
  decode row of its own (the worker's token rows: ``ModelRunner._token_rows``) and read by a kernel whose key splits
  have a fixed size, merged in order: the Triton decode kernel on CUDA (``triton_decode.SPLIT_KEYS``), the torch
  backend's ``split_attention`` elsewhere.
- Matrix products: a GEMM library picks its kernel, and with it how a row's sums are cut, by the row count and the
  matrix's shape. Each product runs over row chunks whose counts lie in a range where the device's GEMM keeps a
  row's bits: fewer rows are padded with zeros, more are cut into chunks. The CPU's range is a constant
  (``PRODUCT_ROWS``, ``bench/rows.py``; tests/shell/test_invariant.py pins it); on CUDA it follows the shape (an
  H100's cuBLAS keeps a row's bits from 8 to 512 rows at SmolLM2's shapes but only to 16 for Llama-8B's 4,096 x
  4,096 output projection: ``bench/gpu_rows.py``), so each weight's range is measured on the device at its first
  product (``agreeing_rows``), before any graph captures it.
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

# (fewest, most) rows a product runs over where the range is the device's, whatever the shape (None: no bound).
# CPU (MKL, fp32): 1-3, 5-7 and 9-11 rows take other kernels, every count from 12 agrees (bench/rows.py).
PRODUCT_ROWS: dict[str, tuple[int, int | None]] = {"cpu": (16, None)}
# CUDA: the counts a weight's range is measured within (``agreeing_rows``): cuBLAS' kernels below 8 rows differ
PROBED_ROWS = (8, 512)
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


def agreeing_rows(w: torch.Tensor, bias: torch.Tensor | None, fewest: int, most: int) -> tuple[int, int]:
    """The longest range of row counts from ``fewest`` in which ``plain_product`` gives every row, at every
    position of its chunk, the bits it gets in a chunk of ``fewest`` rows: measured on random rows of ``w``'s
    device and dtype (the GEMM library picks its kernel by the row count and the shape, not by the values)."""
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(most, w.shape[1], device=w.device, generator=gen).to(w.dtype)
    ref = torch.cat([plain_product(x[i : i + fewest], w, bias) for i in range(0, most, fewest)])
    for m in range(fewest + 1, most + 1):
        if not torch.equal(plain_product(x[:m], w, bias), ref[:m]):
            return fewest, m - 1
    return fewest, most


class ProbedProduct:
    """``plain_product`` over row chunks in each weight's own range (``agreeing_rows``), measured at the weight's
    first product and kept by its shape, dtype and bias. The first product of a shape must not run inside a
    graph's capture (the measurement reads results back): a capture's warm-up forward runs it first."""

    def __init__(self, fewest: int, most: int) -> None:
        self.fewest, self.most = fewest, most
        self.ranges: dict[tuple[torch.Size, torch.dtype, bool], tuple[int, int]] = {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        key = (w.shape, w.dtype, bias is not None)
        rows = self.ranges.get(key)
        if rows is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise refuse(
                    ErrorCode.INVALID,
                    f"a batch-invariant product of a new shape {tuple(w.shape)} inside a graph's capture: its row "
                    "range is measured eagerly first (a warm-up forward)",
                )
            rows = self.ranges[key] = agreeing_rows(w, bias, self.fewest, self.most)
        return _in_chunks(lambda part: plain_product(part, w, bias), x, *rows)


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
        self.product: Product = (
            ProbedProduct(*PROBED_ROWS) if device.type == "cuda" else row_product(*PRODUCT_ROWS["cpu"])
        )
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
