"""The ``torch`` reference backend: runs anywhere, exact masks, fp32 math."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.core.rules.kinds import GroupKind
from pagedkv.shell.attention.base import LayerAttention, lowest_visible_key
from pagedkv.shell.worker import ForwardBatch


class TorchBackend:
    """The reference: gathers each row's pages, slices to ``seq_len`` (never reads unfilled
    slots, nor window blocks let go), exact masks from the segments, GQA, fp32 math: on the CPU through
    torch's fused attention (its flash kernel, fp32 throughout), elsewhere the products and the softmax
    written out (CUDA's fused kernels are the backends' business)."""

    name = "torch"
    kv_write = None  # two index_copy_ (the page pool's own write)
    fp8_pages = True  # reads fp8 pages (their scales applied)

    def __init__(self, *, invariant: bool = False) -> None:
        self._made: tuple[ForwardBatch, tuple[object, ...], Any, Any] | None = None  # a plan of this forward's
        # batch-invariant decode reads (shell.invariant): fixed key splits merged in order (``split_attention``),
        # rows gathered SPLIT_ROWS at a time (a prompt laid out a token a row reads its whole prefix per token)
        self.invariant = invariant

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
        bs = k_pages.shape[1]
        kv_heads = k_pages.shape[2]
        rows = batch.metadata.rows
        if all(r.query_len == 1 and len(r.segments) == 1 for r in rows):
            return self._decode(q, k_pages, v_pages, batch, layer)
        out = torch.empty_like(q)
        qsl = batch.query_start_loc.tolist()
        for r, (ids, n_keys, mask) in enumerate(self._rows_plan(batch, layer, bs)):
            # (n_blocks * bs, kv_heads, head_dim) -> the row's keys [first_block * bs, seq_len)
            k = k_pages.index_select(0, ids).reshape(-1, kv_heads, k_pages.shape[3])[:n_keys]
            v = v_pages.index_select(0, ids).reshape(-1, kv_heads, v_pages.shape[3])[:n_keys]
            k, v = _dequantized(k, v, layer)
            if layer.kv_index is not None:  # an explicit head map (a tensor-parallel shard)
                idx = torch.tensor(layer.kv_index, device=k.device)
                k, v = k.index_select(1, idx), v.index_select(1, idx)
            qr = q[qsl[r] : qsl[r + 1]].float()  # (query, heads, head_dim)
            n_q, heads, d = qr.shape
            read = k.shape[1]  # GQA: each KV head serves heads // read query heads
            qh = qr.view(n_q, read, heads // read, d).permute(1, 2, 0, 3)  # (KV heads, group, queries, head_dim)
            kh, vh = k.transpose(0, 1)[:, None], v.transpose(0, 1)[:, None]  # (KV heads, 1, keys, head_dim)
            if layer.softcap or qr.device.type != "cpu":
                scores = torch.matmul(qh, kh.transpose(-1, -2)) * layer.scale
                if layer.softcap:
                    scores = torch.tanh(scores / layer.softcap) * layer.softcap
                got = torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), vh)
            else:  # (K and V expanded over the group, not copied: the CPU's fused kernel takes them so)
                shape = (read, heads // read, n_keys, d)
                got = F.scaled_dot_product_attention(
                    qh, kh.expand(shape), vh.expand(shape), attn_mask=mask, scale=layer.scale
                )
            got = got.permute(2, 0, 1, 3).reshape(n_q, heads, d)
            out[qsl[r] : qsl[r + 1]] = got.to(q.dtype)
        return out

    def _rows_plan(
        self, batch: ForwardBatch, layer: LayerAttention, bs: int
    ) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """Each row's blocks to read, its keys' count and its exact mask (queries x keys) from its segments: the
        same for every layer of a group, so made once a forward (kept for the batch and group it was made for)."""
        made = self._made
        key = ("rows", layer.group, layer.spec, bs)
        if made is not None and made[0] is batch and made[1] == key:
            return made[2]  # type: ignore[no-any-return]
        tables = batch.block_tables[layer.group]
        plan = []
        for r, row in enumerate(batch.metadata.rows):
            start, seq_len = row.kv_start_pos, row.seq_len
            lo = lowest_visible_key(layer.spec, start)  # keys before it: no query of this row reads them
            first_block, last_block = lo // bs, -(-seq_len // bs)
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
            ids = tables[r, first_block:last_block].long()
            plan.append((ids, keys.numel(), mask.to(tables.device)))  # (masks are built on the host)
        self._made = (batch, key, plan, None)
        return plan

    def _decode_plan(
        self, batch: ForwardBatch, layer: LayerAttention, shape: tuple[int, ...], n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode batch's gather: for every row, head and key, the row of the pages (viewed as
        ``(blocks * block_size * kv_heads, head_dim)``) it reads, and the keys each row sees. A key the row
        does not see (past ``seq_len``, before a window) reads the row's last key instead (written, so finite;
        its weight is zero), so nothing unwritten ever enters the sums. The same for every layer of a group:
        made once a forward (kept for the batch and the group it was made for)."""
        made = self._made
        key = (layer.group, layer.spec, shape, n, layer.kv_index)
        if made is not None and made[0] is batch and made[1] == key:
            return made[2], made[3]
        bs, kv_heads = shape[1], shape[2]
        seq_lens = batch.seq_lens[:n].long()
        nb = -(-int(seq_lens.max()) // bs)
        tables = batch.block_tables[layer.group, :n, :nb].long()  # (rows, blocks)
        keys = torch.arange(nb * bs, device=tables.device)
        visible = keys[None, :] < seq_lens[:, None]  # (rows, keys); a lone query sees [lo, seq_len)
        if layer.spec.kind is not GroupKind.FULL:
            lows = torch.tensor(
                [lowest_visible_key(layer.spec, r.kv_start_pos) for r in batch.metadata.rows], device=tables.device
            )
            visible &= keys[None, :] >= lows[:, None]
        slots = (tables[:, :, None] * bs + torch.arange(bs, device=tables.device)).reshape(n, nb * bs)
        last = slots.gather(1, (seq_lens - 1)[:, None])  # (the query's own key: always seen, always written)
        slots = torch.where(visible, slots, last)
        pad = (-slots.shape[1]) % SPLIT_KEYS if self.invariant else 0  # (whole splits: split_attention's)
        if pad:
            slots = torch.cat([slots, last.expand(n, pad)], 1)
            visible = torch.cat([visible, visible.new_zeros((n, pad))], 1)
        heads = (
            torch.tensor(layer.kv_index, device=tables.device)
            if layer.kv_index is not None
            else torch.arange(kv_heads, device=tables.device)
        )
        index = (slots[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)  # (rows, heads read, keys)
        self._made = (batch, key, index, visible[:, None, None, :])
        return index, visible[:, None, None, :]

    def _decode(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
        """Every row has one query token: all rows at once over their gathered keys, read in one
        ``index_select`` a side into (rows, KV heads, keys, head_dim)."""
        d = k_pages.shape[3]
        n, heads = q.shape[0], q.shape[1]
        index, visible = self._decode_plan(batch, layer, tuple(k_pages.shape), n)
        if self.invariant:
            keys = visible.shape[-1]
            read = index.numel() // (n * keys)
            out = torch.empty((n, heads, d), dtype=torch.float32, device=q.device)
            for a in range(0, n, SPLIT_ROWS):
                b = min(n, a + SPLIT_ROWS)
                part = index[a * read * keys : b * read * keys]
                k, v = _dequantized(_rows(k_pages, d, part), _rows(v_pages, d, part), layer)
                qg = q[a:b].float().view(b - a, read, heads // read, d)
                got = split_attention(
                    qg,
                    k.view(b - a, read, keys, d),
                    v.view(b - a, read, keys, d),
                    visible[a:b],
                    layer.scale,
                    layer.softcap,
                )
                out[a:b] = got.reshape(b - a, heads, d)
            return out.to(q.dtype)
        k, v = _dequantized(_rows(k_pages, d, index), _rows(v_pages, d, index), layer)
        read = index.numel() // (n * visible.shape[-1])  # KV heads read: the pages' own, or one a query head
        k, v = k.view(n, read, -1, d), v.view(n, read, -1, d)
        qg = q.float().view(n, read, heads // read, d)  # GQA: query heads grouped by their KV head
        if layer.softcap or q.device.type != "cpu":
            scores = torch.matmul(qg, k.transpose(-1, -2)) * layer.scale
            if layer.softcap:
                scores = torch.tanh(scores / layer.softcap) * layer.softcap
            scores.masked_fill_(~visible, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), v)
        else:
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible, scale=layer.scale)
        return out.reshape(n, heads, d).to(q.dtype)


SPLIT_KEYS = 256  # keys a split of ``split_attention`` covers (fixed: a row's sums never follow the batch)
SPLIT_ROWS = 64  # decode rows ``split_attention`` reads at a time


def split_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """One query a row over its keys, the keys cut into splits of ``SPLIT_KEYS`` merged in order by their running
    maximum and sum (the Triton decode kernel's scheme): every product a batched one of one fixed shape a row and
    KV head (group x head_dim x ``SPLIT_KEYS``), every sum over a split's fixed length, so what a row gets never
    follows the batch (tests/shell/test_invariant.py). A split past a row's keys (the batch's longest row has
    more) changes nothing, bit for bit: its weights are exactly 0, its scale exactly 1.

    ``q`` (rows, KV heads, group, head_dim), ``k``/``v`` (rows, KV heads, keys, head_dim), ``visible``
    (rows, 1, 1, keys) -> (rows, KV heads, group, head_dim), float32."""
    n, kvh, keys, d = k.shape
    g = q.shape[2]
    m = torch.full((n, kvh, g, 1), float("-inf"), device=q.device)
    total = torch.zeros((n, kvh, g, 1), device=q.device)
    acc = torch.zeros((n, kvh, g, d), device=q.device)
    for s in range(0, keys, SPLIT_KEYS):
        ks, vs, seen = k[:, :, s : s + SPLIT_KEYS], v[:, :, s : s + SPLIT_KEYS], visible[..., s : s + SPLIT_KEYS]
        width = ks.shape[2]
        if width < SPLIT_KEYS:  # (the last split at its fixed length: the missing keys unseen)
            pad = (0, 0, 0, SPLIT_KEYS - width)
            ks, vs = torch.nn.functional.pad(ks, pad), torch.nn.functional.pad(vs, pad)
            seen = torch.nn.functional.pad(seen, (0, SPLIT_KEYS - width), value=False)
        scores = torch.matmul(q, ks.transpose(-1, -2)) * scale  # (rows, KV heads, group, split)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~seen, float("-inf"))
        top = torch.maximum(m, scores.amax(-1, keepdim=True))
        base = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # (a row that has seen nothing yet)
        p = torch.exp(scores - base)
        keep = torch.exp(m - base)
        total = total * keep + p.sum(-1, keepdim=True)
        acc = acc * keep + torch.matmul(p, vs)
        m = top
    return acc / total


def _rows(pages: torch.Tensor, d: int, index: torch.Tensor) -> torch.Tensor:
    """``pages`` viewed as rows of ``head_dim``, the rows ``index`` names (fp8 pages gathered as bytes)."""
    flat = pages.reshape(-1, d)
    if flat.element_size() == 1 and flat.dtype != torch.uint8:  # (index_select has no float8 kernel everywhere)
        return flat.view(torch.uint8).index_select(0, index).view(flat.dtype)
    return flat.index_select(0, index)


def _dequantized(k: torch.Tensor, v: torch.Tensor, layer: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered K and V in fp32, times the layer's scales (fp8 pages hold value / scale)."""
    ks, vs = layer.kv_scales
    k, v = k.float(), v.float()
    return (k, v) if (ks, vs) == (1.0, 1.0) else (k * ks, v * vs)
