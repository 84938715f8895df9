"""Attention over pages, behind one small interface, selected by name.

``get_backend("torch" | "flash_attn" | "npu" | "triton")`` returns an ``AttentionBackend``;
one that cannot run here raises ``BackendUnavailable`` naming what to install.
There is no silent dense fallback: a paged forward needs an installed
``ForwardBatch``.

Native kernels take one causal flag per call, so the core's segments run as
separate calls (``segment_calls``): segment k of every row together (rows of one
forward share the segment structure). A single segment per row keeps the batched
layout as it is; otherwise the segment's tokens are gathered with
``index_select``, run, and scattered back with ``index_copy_`` into token order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedkv.core.config import GroupKind, GroupSpec
from pagedkv.shell.errors import BackendUnavailable
from pagedkv.shell.worker import ForwardBatch


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What attention of one layer needs besides the tensors."""

    group: int  # the KV cache group of this layer
    spec: GroupSpec  # its kind: full, sliding_window(window), chunked_local(chunk)
    scale: float
    softcap: float | None = None
    kv_index: tuple[int, ...] | None = None  # query head -> local KV head, when not contiguous groups (TP shards)


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch,
                layer: LayerAttention) -> torch.Tensor:  # fmt: skip
        """``q``: (tokens, heads, head_dim) in query order -> (tokens, heads, head_dim), q's dtype."""
        ...


def lowest_visible_key(spec: GroupSpec, position: int) -> int:
    """The first key a query at ``position`` sees: the core's rule, ``GroupSpec.first_visible_position``."""
    return spec.first_visible_position(position)


class TorchBackend:
    """The reference: gathers each row's pages, slices to ``seq_len`` (never reads unfilled
    slots, nor window blocks let go), exact masks from the segments, GQA, fp32 math."""

    name = "torch"

    def forward(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch,
                layer: LayerAttention) -> torch.Tensor:  # fmt: skip
        bs = k_pages.shape[1]
        heads, kv_heads = q.shape[1], k_pages.shape[2]
        rows = batch.metadata.rows
        if all(r.query_len == 1 and len(r.segments) == 1 for r in rows):
            return self._decode(q, k_pages, v_pages, batch, layer)
        out = torch.empty_like(q)
        tables = batch.block_tables[layer.group]
        qsl = batch.query_start_loc.tolist()
        for r, row in enumerate(batch.metadata.rows):
            start, seq_len = row.kv_start_pos, row.seq_len
            lo = lowest_visible_key(layer.spec, start)  # keys before it: no query of this row reads them
            first_block, last_block = lo // bs, -(-seq_len // bs)
            ids = tables[r, first_block:last_block].long()
            # (n_blocks * bs, kv_heads, head_dim) -> the row's keys [first_block * bs, seq_len)
            k = k_pages.index_select(0, ids).reshape(-1, kv_heads, k_pages.shape[3])[: seq_len - first_block * bs]
            v = v_pages.index_select(0, ids).reshape(-1, kv_heads, v_pages.shape[3])[: seq_len - first_block * bs]
            k, v = k.float(), v.float()
            if layer.kv_index is not None:  # an explicit head map (a tensor-parallel shard)
                idx = torch.tensor(layer.kv_index, device=k.device)
                k, v = k.index_select(1, idx), v.index_select(1, idx)
            elif heads != kv_heads:  # GQA: each KV head serves heads // kv_heads query heads
                k = k.repeat_interleave(heads // kv_heads, dim=1)
                v = v.repeat_interleave(heads // kv_heads, dim=1)
            qr = q[qsl[r] : qsl[r + 1]].float()  # (query, heads, head_dim)
            keys = torch.arange(first_block * bs, seq_len)
            mask = torch.zeros(row.query_len, keys.numel(), dtype=torch.bool)
            for seg in row.segments:
                pos = torch.arange(seg.q_start, seg.q_end)
                rows_ = slice(seg.q_start - start, seg.q_end - start)
                bound = pos[:, None] if seg.causal else torch.full((pos.numel(), 1), seg.kv_end - 1)
                allowed = keys[None, :] <= bound
                if layer.spec.kind is not GroupKind.FULL:
                    lows = torch.tensor([lowest_visible_key(layer.spec, int(p)) for p in pos])
                    allowed &= keys[None, :] >= lows[:, None]
                mask[rows_] = allowed
            scores = torch.einsum("qhd,khd->hqk", qr, k) * layer.scale
            if layer.softcap:
                scores = torch.tanh(scores / layer.softcap) * layer.softcap
            scores = scores.masked_fill(~mask.to(scores.device)[None], float("-inf"))  # masks are built on the host
            probs = torch.softmax(scores, dim=-1)
            out[qsl[r] : qsl[r + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        return out


    def _decode(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch,
                layer: LayerAttention) -> torch.Tensor:  # fmt: skip
        """Every row has one query token: all rows at once over their gathered pages."""
        bs, kv_heads, d = k_pages.shape[1], k_pages.shape[2], k_pages.shape[3]
        n, heads = q.shape[0], q.shape[1]
        seq_lens = batch.seq_lens.long()
        nb = -(-int(seq_lens.max()) // bs)
        tables = batch.block_tables[layer.group, :n, :nb].long()  # (rows, blocks)
        k = k_pages[tables].reshape(n, nb * bs, kv_heads, d).float()  # (rows, keys, kv_heads, d)
        v = v_pages[tables].reshape(n, nb * bs, kv_heads, d).float()
        keys = torch.arange(nb * bs, device=q.device)
        visible = keys[None, :] < seq_lens[:, None]  # (rows, keys); a lone query sees [lo, seq_len)
        if layer.spec.kind is not GroupKind.FULL:
            lows = torch.tensor([lowest_visible_key(layer.spec, r.kv_start_pos) for r in batch.metadata.rows],
                                device=q.device)  # fmt: skip
            visible &= keys[None, :] >= lows[:, None]
        hidden = ~visible[:, :, None, None]
        k, v = k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0)  # never let unread slots into the sums
        if layer.kv_index is not None:  # a shard's explicit head map: one KV head per query head
            idx = torch.tensor(layer.kv_index, device=k.device)
            k, v, kv_heads = k.index_select(2, idx), v.index_select(2, idx), heads
        qg = q.float().view(n, kv_heads, heads // kv_heads, d)  # GQA: query heads grouped by their KV head
        scores = torch.einsum("nvgd,nkvd->nvgk", qg, k) * layer.scale
        if layer.softcap:
            scores = torch.tanh(scores / layer.softcap) * layer.softcap
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        out = torch.einsum("nvgk,nkvd->nvgd", torch.softmax(scores, dim=-1), v)
        return out.reshape(n, heads, d).to(q.dtype)


@dataclass(frozen=True, slots=True)
class SegmentCall:
    """One native kernel call: segment ``index`` of every row."""

    causal: bool
    token_index: torch.Tensor | None  # positions in q of this call's tokens; None: all, in order
    cu_seqlens_q: torch.Tensor  # (rows + 1,) int32
    kv_lens: torch.Tensor  # (rows,) int32: keys each row's queries may read (seqused_k / cache_seqlens)
    max_seqlen_q: int
    max_seqlen_k: int


def segment_calls(batch: ForwardBatch) -> list[SegmentCall]:
    """The native calls for a forward: one per segment index (rows share the structure)."""
    rows = batch.metadata.rows
    nseg = len(rows[0].segments)
    qsl = batch.query_start_loc.tolist()
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
            index = torch.cat([torch.arange(qsl[r] + s.q_start - row.kv_start_pos, qsl[r] + s.q_end - row.kv_start_pos)
                               for r, (row, s) in enumerate(zip(rows, segs))]).to(batch.seq_lens.device)  # fmt: skip
        calls.append(SegmentCall(segs[0].causal, index, cu.to(batch.seq_lens.device),
                                 torch.tensor(kv, dtype=torch.int32, device=batch.seq_lens.device),
                                 max(lens), max(kv)))  # fmt: skip
    return calls


def run_segments(q: torch.Tensor, batch: ForwardBatch, kernel: object) -> torch.Tensor:
    """Run ``kernel(q_part, call) -> out_part`` per segment call; the output is in token order."""
    out = torch.empty_like(q)
    for call in segment_calls(batch):
        if call.token_index is None:
            out = kernel(q, call)  # type: ignore[operator]
        else:
            part = kernel(q.index_select(0, call.token_index), call)  # type: ignore[operator]
            out.index_copy_(0, call.token_index, part)
    return out


def get_backend(name: str) -> AttentionBackend:
    """The backend called ``name``; raises ``BackendUnavailable`` naming the package when it cannot run."""
    if name == "torch":
        return TorchBackend()
    if name == "flash_attn":
        from pagedkv.shell.backends.flash import FlashAttnBackend

        return FlashAttnBackend()
    if name == "npu":
        from pagedkv.shell.backends.npu import NpuBackend

        return NpuBackend()
    if name == "triton":
        from pagedkv.shell.backends.triton_backend import TritonBackend

        return TritonBackend()
    raise BackendUnavailable(name, "one of: torch, flash_attn, npu, triton", "no backend by that name")


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
