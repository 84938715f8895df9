"""Strict Ulysses sequence parallelism for the reference DiT over torch.distributed, for request mode
(``paged_step``: one timestep) and step batching (``paged_rows``: a timestep a row, ``DiTStepRunner`` takes it).

Each of ``world`` ranks holds ``1/world`` of a forward's query tokens for everything but attention
(projections, MLP, residuals); around attention an all-to-all turns "my tokens, every head" into "every
token, my heads" and back. The pages are sharded by heads: a rank's pool holds the K/V heads its query
heads read (``kv_layers``), for every token, at the same block ids on every rank (the core runs once, on
rank 0, and its metadata is broadcast, as for tensor parallelism). CFG rows and the prefix / target layout
are the core's, unchanged; a forward's tokens are padded to a multiple of ``world`` (the padding is never
written to the pages nor attended). K/V heads go through an all-to-all when each rank holds a whole
share of them, and are gathered and sliced when there are fewer K/V heads than ranks (GQA: several ranks
read one K/V head).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pagedkv.core.config import GroupSpec
from pagedkv.core.errors import ErrorCode
from pagedkv.core.grouping import LayerSpec
from pagedkv.models.dit import DiT, DiTRow
from pagedkv.shell.attention import AttentionBackend
from pagedkv.shell.errors import refuse
from pagedkv.shell.pool import PagePool
from pagedkv.shell.rank import Layout, attention_layers
from pagedkv.shell.worker import ForwardBatch


class HeadExchange:
    """Ulysses' all-to-all over ``size`` ranks (``group``: a process subgroup, or None for the whole world), this
    rank the ``index``-th of them: "my tokens, every head" <-> "every token of the group, my heads"; and K/V heads,
    exchanged when each rank holds a whole share of them, gathered and sliced when fewer K/V heads than ranks."""

    def __init__(self, model: DiT, index: int, size: int, group: Any = None) -> None:
        c = model.config
        if c.heads % size:
            raise refuse(ErrorCode.INVALID, f"Ulysses needs the query heads ({c.heads}) split evenly over {size} ranks")
        per_kv = c.heads // c.kv_heads  # query heads a K/V head serves
        self.heads = c.heads // size
        if self.heads % per_kv and per_kv % self.heads:
            raise refuse(
                ErrorCode.INVALID,
                f"{size} ranks split {c.heads} query heads into shares of {self.heads}, "
                f"which cut across K/V groups of {per_kv}",
            )
        self.size, self.group = size, group
        self.kv_heads = max(1, self.heads // per_kv)
        self.kv_first = index * self.heads // per_kv  # this rank's first K/V head
        self.kv_split = c.kv_heads % size == 0  # a whole share of K/V heads each: all-to-all them too

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(n, H, D) of my tokens -> (size * n, H / size, D): every token, my heads."""
        if self.size == 1:
            return x
        n, h, d = x.shape
        send = x.reshape(n, self.size, h // self.size, d).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.reshape(self.size * n, h // self.size, d)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(size * n, h, D) of my heads -> (n, size * h, D): my tokens, every head."""
        if self.size == 1:
            return x
        total, h, d = x.shape
        n = total // self.size
        send = x.reshape(self.size, n, h, d).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.transpose(0, 1).reshape(n, self.size * h, d)

    def kv(self, x: torch.Tensor) -> torch.Tensor:
        """(n, KVH, D) of my tokens -> (size * n, my K/V heads, D)."""
        if self.size == 1 or self.kv_split:
            return self.to_heads(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)[:, self.kv_first : self.kv_first + self.kv_heads]


class ShardedDiT:
    """What a sequence-parallel shard of the DiT shares: its pages (its K/V heads, ``exchange``) and ``paged_step``
    as ``paged_rows`` with one timestep (every rank returns the same predictions)."""

    model: DiT
    exchange: HeadExchange

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """This rank's pages: its K/V heads of every layer, fp32."""
        c = self.model.config
        return attention_layers(c.layers, kv_heads=self.exchange.kv_heads, head_dim=c.head_dim, dtype=torch.float32)

    def paged_step(
        self,
        rows: list[DiTRow],
        images: list[torch.Tensor],
        t: float,
        batch: ForwardBatch,
        pool: PagePool,
        backend: AttentionBackend,
        group: GroupSpec | Layout,
    ) -> list[torch.Tensor]:
        return self.paged_rows([(row, image, t) for row, image in zip(rows, images)], batch, pool, backend, group)

    def paged_rows(
        self,
        entries: list[tuple[DiTRow, torch.Tensor, float]],
        batch: ForwardBatch,
        pool: PagePool,
        backend: AttentionBackend,
        group: GroupSpec | Layout,
    ) -> list[torch.Tensor]:
        raise NotImplementedError


class UlyssesDiT(ShardedDiT):
    """``model``'s paged step on rank ``rank`` of ``world`` (an initialised process group)."""

    def __init__(self, model: DiT, rank: int, world: int) -> None:
        self.model, self.rank, self.world = model, rank, world
        self.exchange = HeadExchange(model, rank, world)

    def paged_rows(
        self,
        entries: list[tuple[DiTRow, torch.Tensor, float]],
        batch: ForwardBatch,
        pool: PagePool,
        backend: AttentionBackend,
        group: GroupSpec | Layout,
    ) -> list[torch.Tensor]:
        """``DiT.paged_rows`` (a timestep a row: rows of requests at different denoising steps in one forward, as
        step batching plans them), its tokens sharded over the ranks."""
        m, c = self.model, self.model.config
        x = m.query_inputs(entries, batch)
        total = x.shape[0]
        n = -(-total // self.world)
        x = torch.cat([x, x.new_zeros(n * self.world - total, c.hidden)])[self.rank * n : (self.rank + 1) * n]
        attns = m.attentions(group)
        for i, L in enumerate(m.layers):

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int = i) -> torch.Tensor:
                ex = self.exchange
                q_all, k_all, v_all = ex.to_heads(q)[:total], ex.kv(k)[:total], ex.kv(v)[:total]
                pool.write(i, k_all, v_all, batch.slot_mapping, attns[i].kv_scales)  # my heads' K/V of every token
                out = backend.forward(q_all, pool.k[i], pool.v[i], batch, attns[i])
                out = torch.cat([out, out.new_zeros(n * self.world - total, *out.shape[1:])])
                return self.exchange.to_tokens(out)

            x = m._block(x, L, attend)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return m.predictions(torch.cat(parts)[:total], entries, batch)


def broadcast(objects: list[Any]) -> list[Any]:
    """Rank 0's objects on every rank (the core's metadata: it runs once)."""
    box = [objects]
    dist.broadcast_object_list(box, src=0)
    return box[0]
