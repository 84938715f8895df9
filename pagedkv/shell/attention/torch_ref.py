"""The ``torch`` reference backend: runs anywhere, exact masks, fp32 math."""

from __future__ import annotations

import torch

from pagedkv.core.kinds import GroupKind
from pagedkv.shell.attention.base import LayerAttention, lowest_visible_key
from pagedkv.shell.worker import ForwardBatch


class TorchBackend:
    """The reference: gathers each row's pages, slices to ``seq_len`` (never reads unfilled
    slots, nor window blocks let go), exact masks from the segments, GQA, fp32 math."""

    name = "torch"
    kv_write = None  # two index_copy_ (the page pool's own write)
    fp8_pages = True  # reads fp8 pages (their scales applied)

    def __init__(self) -> None:
        self._made: tuple[ForwardBatch, tuple[object, ...], torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
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
            k, v = _dequantized(k, v, layer)
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

    def _decode_plan(
        self, batch: ForwardBatch, layer: LayerAttention, bs: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' block tables and visible keys for a decode batch: the same for every layer of a group,
        so made once a forward (kept for the batch and group it was made for)."""
        made = self._made
        if made is not None and made[0] is batch and made[1] == (layer.group, layer.spec, bs, n):
            return made[2], made[3]
        seq_lens = batch.seq_lens.long()
        nb = -(-int(seq_lens.max()) // bs)
        tables = batch.block_tables[layer.group, :n, :nb].long()  # (rows, blocks)
        keys = torch.arange(nb * bs, device=tables.device)
        visible = keys[None, :] < seq_lens[:, None]  # (rows, keys); a lone query sees [lo, seq_len)
        if layer.spec.kind is not GroupKind.FULL:
            lows = torch.tensor(
                [lowest_visible_key(layer.spec, r.kv_start_pos) for r in batch.metadata.rows], device=tables.device
            )
            visible &= keys[None, :] >= lows[:, None]
        self._made = (batch, (layer.group, layer.spec, bs, n), tables, visible)
        return tables, visible

    def _decode(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
        """Every row has one query token: all rows at once over their gathered pages."""
        bs, kv_heads, d = k_pages.shape[1], k_pages.shape[2], k_pages.shape[3]
        n, heads = q.shape[0], q.shape[1]
        tables, visible = self._decode_plan(batch, layer, bs, n)
        nb = tables.shape[1]
        k, v = _dequantized(
            k_pages[tables].reshape(n, nb * bs, kv_heads, d), v_pages[tables].reshape(n, nb * bs, kv_heads, d), layer
        )  # (rows, keys, kv_heads, d)
        v = v.masked_fill(~visible[:, :, None, None], 0.0)  # never let unread slots into the sums (K's are masked
        # in the scores below)
        if layer.kv_index is not None:  # a shard's explicit head map: one KV head per query head
            idx = torch.tensor(layer.kv_index, device=k.device)
            k, v, kv_heads = k.index_select(2, idx), v.index_select(2, idx), heads
        qg = q.float().view(n, kv_heads, heads // kv_heads, d)  # GQA: query heads grouped by their KV head
        scores = torch.einsum("nvgd,nkvd->nvgk", qg, k) * layer.scale
        if layer.softcap:
            scores = torch.tanh(scores / layer.softcap) * layer.softcap
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))  # also what an unread K made
        out = torch.einsum("nvgk,nkvd->nvgd", torch.softmax(scores, dim=-1), v)
        return out.reshape(n, heads, d).to(q.dtype)


def _dequantized(k: torch.Tensor, v: torch.Tensor, layer: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered K and V in fp32, times the layer's scales (fp8 pages hold value / scale)."""
    ks, vs = layer.kv_scales
    k, v = k.float(), v.float()
    return (k, v) if (ks, vs) == (1.0, 1.0) else (k * ks, v * vs)
