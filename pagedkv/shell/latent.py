"""Latent (MLA) pages and multi-head latent attention over them.

A layer's page holds one latent vector per token, ``(num_blocks, block_size, latent_dim)`` with
``latent_dim = kv_lora_rank + rope_dim``: the compressed KV ``c_kv`` and the decoupled RoPE key
``k_pe`` shared by all heads. Two ways to attend, the same numbers:

- unabsorbed (prefill): up-project every key's latent to per-head ``k_nope`` and ``v``;
- absorbed (decode): fold ``W_uk`` into the query and ``W_uv`` after the weighted sum, so attention
  runs in the latent space and no per-head key or value is ever built (DeepSeek-V2's trick).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.core.config import CacheConfig, InvalidConfig
from pagedkv.shell.pool import FP8, quantize
from pagedkv.shell.worker import ForwardBatch


class LatentPagePool:
    """Per layer ``(num_blocks, block_size, latent_dim)``. An fp8 ``dtype`` (``pool.FP8``) holds each layer's latents
    over its scale (``scales``, one a layer: a page holds ``latent / scale``); ``latents(layer, ids)`` reads them back."""

    def __init__(
        self,
        config: CacheConfig,
        *,
        num_layers: int,
        latent_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        scales: Sequence[float] | None = None,
    ) -> None:
        self.config, self.num_layers, self.latent_dim = config, num_layers, latent_dim
        shape = (config.num_blocks, config.block_size, latent_dim)  # no heads: one vector per token
        self.pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.fp8 = dtype in FP8
        self.scales = list(scales) if scales is not None else [1.0] * num_layers
        if len(self.scales) != num_layers:
            raise InvalidConfig(f"{len(self.scales)} latent scales for {num_layers} layers")

    @property
    def bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pages)

    def write(self, layer: int, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """``latent``: (tokens, latent_dim), written once through the slot mapping (fp8: over the layer's scale)."""
        page = self.pages[layer]
        if self.fp8:  # (the bytes as uint8: index_copy_ has no fp8 kernel on every device)
            q = quantize(latent, self.scales[layer], page.dtype)
            page.view(torch.uint8).view(-1, self.latent_dim).index_copy_(0, slot_mapping, q.view(torch.uint8))
            return
        page.view(-1, self.latent_dim).index_copy_(0, slot_mapping, latent.to(page.dtype))

    def latents(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids``' latents, fp32: (len(ids) * block_size, latent_dim), the scale applied."""
        lat = self.pages[layer].index_select(0, ids).reshape(-1, self.latent_dim).float()
        return lat * self.scales[layer] if self.fp8 else lat


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    pool: LatentPagePool,
    layer: int,
    batch: ForwardBatch,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    *,
    absorbed: bool,
) -> torch.Tensor:
    """q_nope (tokens, heads, d_nope), q_pe (tokens, heads, d_rope); w_uk (heads, d_nope, rank),
    w_uv (heads, d_v, rank) -> (tokens, heads, d_v). Causal within each row, keys from layer ``layer``'s pages."""
    bs = pool.config.block_size
    rank = w_uk.shape[2]
    out = torch.empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
    qsl = batch.query_start_loc.tolist()
    for r, row in enumerate(batch.metadata.rows):
        ids = batch.block_tables[0, r, : -(-row.seq_len // bs)].long()
        lat = pool.latents(layer, ids)[: row.seq_len]  # (keys, latent)
        c, k_pe = lat[:, :rank], lat[:, rank:]
        qn, qp = q_nope[qsl[r] : qsl[r + 1]].float(), q_pe[qsl[r] : qsl[r + 1]].float()
        pos = torch.arange(row.kv_start_pos, row.seq_len)
        mask = torch.arange(row.seq_len)[None, :] <= pos[:, None]  # (queries, keys)
        rope_scores = torch.einsum("qhd,kd->hqk", qp, k_pe)
        if absorbed:
            q_lat = torch.einsum("qhd,hdr->qhr", qn, w_uk.float())  # W_uk folded into the query
            scores = torch.einsum("qhr,kr->hqk", q_lat, c) + rope_scores
            p = torch.softmax((scores * scale).masked_fill(~mask[None], float("-inf")), dim=-1)
            o_lat = torch.einsum("hqk,kr->qhr", p, c)  # the weighted sum stays in the latent space
            o = torch.einsum("qhr,hvr->qhv", o_lat, w_uv.float())
        else:
            k_nope = torch.einsum("kr,hdr->khd", c, w_uk.float())
            v = torch.einsum("kr,hvr->khv", c, w_uv.float())
            scores = torch.einsum("qhd,khd->hqk", qn, k_nope) + rope_scores
            p = torch.softmax((scores * scale).masked_fill(~mask[None], float("-inf")), dim=-1)
            o = torch.einsum("hqk,khv->qhv", p, v)
        out[qsl[r] : qsl[r + 1]] = o.to(out.dtype)
    return out
