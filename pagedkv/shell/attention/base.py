"""What every attention backend shares: a layer's attention parameters, the backend interface,
and the cutting of a forward's segments into native kernel calls.

Native kernels take one causal flag per call, so the core's segments run as separate calls
(``segment_calls``): segment k of every row together (rows of one forward share the segment
structure). A single segment per row keeps the batched layout as it is; otherwise the segment's
tokens are gathered with ``index_select``, run, and scattered back with ``index_copy_`` into
token order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedkv.core.config import GroupSpec
from pagedkv.core.outputs.metadata import DecodeRows
from pagedkv.shell.pool import KVWrite
from pagedkv.shell.worker import ForwardBatch


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What attention of one layer needs besides the tensors."""

    group: int  # the KV cache group of this layer
    spec: GroupSpec  # its kind: full, sliding_window(window), chunked_local(chunk)
    scale: float
    softcap: float | None = None
    kv_index: tuple[int, ...] | None = None  # query head -> local KV head, when not contiguous groups (TP shards)
    kv_scales: tuple[float, float] = (1.0, 1.0)  # fp8 pages: K's and V's scale (a page holds value / scale)


class AttentionBackend(Protocol):
    name: str

    @property
    def kv_write(self) -> KVWrite | None:
        """A fused K/V write kernel the page pool uses (``build_rank``), or None."""
        ...

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
        """``q``: (tokens, heads, head_dim) in query order -> (tokens, heads, head_dim), q's dtype."""
        ...


def lowest_visible_key(spec: GroupSpec, position: int) -> int:
    """The first key a query at ``position`` sees: the core's rule, ``KindRules.first_visible_position``."""
    return spec.rules.first_visible_position(position)


@dataclass(frozen=True, slots=True)
class SegmentCall:
    """One native kernel call: segment ``segment`` of every row."""

    causal: bool
    token_index: torch.Tensor | None  # positions in q of this call's tokens; None: all, in order
    cu_seqlens_q: torch.Tensor  # (rows + 1,) int32
    kv_lens: torch.Tensor  # (rows,) int32: keys each row's queries may read (seqused_k / cache_seqlens)
    max_seqlen_q: int
    max_seqlen_k: int
    segment: int = 0  # which segment of the rows (a backend that plans a call a segment keys its plan on it)


_LAST: list[Any] = [None, None, None]  # the last forward's (metadata, device, calls): every layer asks again
_LEAD: list[Any] = [None, 0]  # the last forward's (metadata, decode_lead)


def segment_calls(batch: ForwardBatch) -> list[SegmentCall]:
    """The native calls for a forward: one per segment index (rows share the structure). Built from the
    snapshot on the host (no device sync) once a forward: the layers after the first get the same ones."""
    meta, device = batch.metadata, batch.seq_lens.device
    if _LAST[0] is meta and _LAST[1] == device:
        return _LAST[2]  # type: ignore[no-any-return]
    calls = _segment_calls(batch)
    _LAST[:] = [meta, device, calls]  # (holding the snapshot keeps its identity from being reused)
    return calls


def decode_lead(batch: ForwardBatch) -> int:
    """How many of a forward's first rows are one query token each, one causal segment (the decode rows riding in a
    prompt's forward, ``runner.ride_along``): a backend with a decode kernel runs them through it, what a decode of
    that position computes, with its splits over a long row's keys (a varlen kernel walks a row's keys in one
    program). Counted once a forward, for the backends that ask."""
    meta = batch.metadata
    if _LEAD[0] is meta:
        return _LEAD[1]  # type: ignore[no-any-return]
    rows = meta.rows
    n = len(rows) if isinstance(rows, DecodeRows) else 0
    if not n:
        for r in rows:
            if r.query_len != 1 or len(r.segments) != 1 or not r.segments[0].causal:
                break
            n += 1
    _LEAD[:] = [meta, n]  # (holding the snapshot keeps its identity from being reused)
    return n


def _segment_calls(batch: ForwardBatch) -> list[SegmentCall]:
    rows = batch.metadata.rows
    nseg = len(rows[0].segments)
    qsl = [0]
    for row in rows:
        qsl.append(qsl[-1] + row.query_len)
    calls = []
    for k in range(nseg):
        segs = [row.segments[k] for row in rows]
        lens = [s.q_end - s.q_start for s in segs]
        kv = [s.kv_end for s in segs]
        cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        if nseg == 1:
            index = None  # the batched layout as it stands
        else:
            index = torch.cat(
                [
                    torch.arange(qsl[r] + s.q_start - row.kv_start_pos, qsl[r] + s.q_end - row.kv_start_pos)
                    for r, (row, s) in enumerate(zip(rows, segs))
                ]
            ).to(batch.seq_lens.device)
        calls.append(
            SegmentCall(
                segs[0].causal,
                index,
                cu.to(batch.seq_lens.device),
                torch.tensor(kv, dtype=torch.int32, device=batch.seq_lens.device),
                max(lens),
                max(kv),
                k,
            )
        )
    return calls


def run_segments(
    q: torch.Tensor, batch: ForwardBatch, kernel: Callable[[torch.Tensor, SegmentCall], torch.Tensor]
) -> torch.Tensor:
    """Run ``kernel(q_part, call) -> out_part`` per segment call; the output is in token order."""
    calls = segment_calls(batch)
    if calls[0].token_index is None:  # (one segment a row: one call over the tokens as they stand, its output)
        return kernel(q, calls[0])
    out = torch.empty_like(q)
    for call in calls:  # (several segments a row: each call's tokens gathered, run and put back in place)
        index: torch.Tensor = call.token_index  # type: ignore[assignment]
        out.index_copy_(0, index, kernel(q.index_select(0, index), call))
    return out
