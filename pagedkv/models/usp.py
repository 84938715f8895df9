"""USP: Ulysses x Ring sequence parallelism for the reference DiT over torch.distributed (xDiT's and yunchang's
unified sequence parallelism), on ``ulysses * ring`` ranks; ``ring=1`` is Ulysses alone, ``ulysses=1`` Ring alone.

A forward's query tokens are split evenly over the ranks (rank ``k = ring_index * ulysses + ulysses_index`` holds
share ``k``). Inside a Ulysses group (``ulysses`` consecutive ranks) an all-to-all turns "my tokens, every head"
into "the group's tokens, my heads" (``ulysses.HeadExchange``, ``UlyssesDiT``'s). Across the ``ring`` groups the K/V pages are
sharded by sequence: position ``p`` belongs to ring group ``(p // block_size) % ring`` (block-cyclic, so a prefix
cached at one step, or by another request, is where every later forward looks for it), each rank's pages hold its
heads of the positions its group owns, and a K/V row computed elsewhere is sent to its owner before it is written.
Attention then passes each group's K/V around the ring (``ring`` steps, neighbours by isend/irecv), each rank
merging the partial attention of its queries over each chunk with an online softmax (running max and sum). The
core runs once (rank 0) and its metadata is broadcast; every rank installs the same snapshot.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pagedkv.core.config import GroupSpec
from pagedkv.core.errors import ErrorCode
from pagedkv.models.dit import DiT, DiTRow
from pagedkv.models.ulysses import HeadExchange, ShardedDiT
from pagedkv.shell.attention import AttentionBackend
from pagedkv.shell.errors import refuse
from pagedkv.shell.pool import PagePool
from pagedkv.shell.rank import Layout
from pagedkv.shell.worker import ForwardBatch


class UspDiT(ShardedDiT):
    """``model``'s paged rows on rank ``rank`` of a ``ulysses`` x ``ring`` grid (an initialised process group of
    ``ulysses * ring`` ranks; every rank constructs it, in the same order, since it makes the subgroups)."""

    def __init__(self, model: DiT, rank: int, ulysses: int, ring: int) -> None:
        if ulysses < 1 or ring < 1:
            raise refuse(ErrorCode.INVALID, f"USP needs a grid of at least 1 x 1 ranks, got {ulysses} x {ring}")
        self.model, self.rank, self.u, self.r = model, rank, ulysses, ring
        self.ui, self.ri = rank % ulysses, rank // ulysses  # my place in my Ulysses group, my ring group
        ulysses_group = ring_group = None
        for k in range(ring):  # (every rank makes every subgroup, in one order)
            g = dist.new_group([k * ulysses + j for j in range(ulysses)])
            ulysses_group = g if k == self.ri else ulysses_group
        for j in range(ulysses):
            g = dist.new_group([k * ulysses + j for k in range(ring)])
            ring_group = g if j == self.ui else ring_group
        self.ring_group = ring_group
        self.exchange = HeadExchange(model, self.ui, ulysses, ulysses_group)

    # -- the forward -----------------------------------------------------------------------------
    def paged_rows(
        self,
        entries: list[tuple[DiTRow, torch.Tensor, float]],
        batch: ForwardBatch,
        pool: PagePool,
        backend: AttentionBackend,
        group: GroupSpec | Layout,
    ) -> list[torch.Tensor]:
        """``DiT.paged_rows`` (a timestep a row) over the grid; every rank returns the same predictions.
        (``backend``: the pages are read here, by position, not through an attention backend; ``group``: the
        group, or the rank's layout, whose fp8 scales the writes and reads apply.)"""
        m, c = self.model, self.model.config
        x = m.query_inputs(entries, batch)
        total, world = x.shape[0], self.u * self.r
        n = -(-total // world)
        plan = _Plan(batch, total, n, self.u, self.r, self.ri, [a.kv_scales for a in m.attentions(group)])
        x = torch.cat([x, x.new_zeros(n * world - total, c.hidden)])[self.rank * n : (self.rank + 1) * n]
        for i, L in enumerate(m.layers):

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int = i) -> torch.Tensor:
                ex = self.exchange
                return ex.to_tokens(self._attend(ex.to_heads(q), ex.kv(k), ex.kv(v), plan, pool, i))

            x = m._block(x, L, attend)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return m.predictions(torch.cat(parts)[:total], entries, batch)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan, pool: PagePool, layer: int
    ) -> torch.Tensor:
        """My group's tokens (G, my heads, D): their K/V to the ring groups that own their positions, written there;
        then my queries over every group's K/V, chunk by chunk around the ring."""
        real = plan.real  # how many of my group's G tokens are real (the rest: padding)
        order = plan.send_order  # my group's real tokens, by the ring group that owns each one's position
        kv = torch.stack((k[:real], v[:real]), dim=1)[order].contiguous()  # (real, 2, kvh, D)
        got = kv
        if self.r > 1:
            got = torch.empty(sum(plan.recv_counts), *kv.shape[1:], dtype=kv.dtype)
            dist.all_to_all_single(got, kv, plan.recv_counts, plan.send_counts, group=self.ring_group)
        pool.write(layer, got[:, 0], got[:, 1], plan.recv_slots, plan.kv_scales[layer])  # the positions I own
        flat = (-1, *pool.k[layer].shape[2:])
        ks, vs = plan.kv_scales[layer]
        chunk = torch.stack(
            (
                pool.k[layer].reshape(flat)[plan.key_slots[self.ri]].float() * ks,
                pool.v[layer].reshape(flat)[plan.key_slots[self.ri]].float() * vs,
            )
        )  # (2, my keys, kvh, D)
        qr = q[:real].float()
        g = qr.shape[1] // chunk.shape[2]
        peak = torch.full((qr.shape[1], real), float("-inf"))
        total = torch.zeros(qr.shape[1], real)
        acc = torch.zeros(qr.shape[1], real, qr.shape[2])
        scale = 1 / math.sqrt(self.model.config.head_dim)
        for s in range(self.r):
            owner = (self.ri - s) % self.r  # whose keys this chunk holds
            if chunk.shape[1] and real:  # (a group may own no key of this forward's rows, or hold no real query)
                kc, vc = (t.float().repeat_interleave(g, dim=1) for t in chunk)
                scores = torch.einsum("qhd,khd->hqk", qr, kc) * scale
                scores = scores.masked_fill(~plan.visible(owner)[None], float("-inf"))
                new_peak = torch.maximum(peak, scores.amax(-1))
                safe = torch.where(new_peak == float("-inf"), 0.0, new_peak)  # (a query that sees none of the chunk)
                w = torch.exp(scores - safe[..., None])
                fade = torch.exp(peak - safe)
                total = total * fade + w.sum(-1)
                acc = acc * fade[..., None] + torch.einsum("hqk,khd->hqd", w, vc)
                peak = new_peak
            if s + 1 < self.r:
                chunk = self._pass(chunk, plan.key_count((self.ri - s - 1) % self.r))
        out = (acc / total.clamp_min(1e-30)[..., None]).transpose(0, 1).to(q.dtype)  # (real, heads, D)
        return torch.cat([out, out.new_zeros(q.shape[0] - real, *out.shape[1:])])

    def _pass(self, chunk: torch.Tensor, incoming: int) -> torch.Tensor:
        """Send my current chunk to the next ring group, take the previous one's (``incoming`` keys)."""
        nxt = ((self.ri + 1) % self.r) * self.u + self.ui
        prev = ((self.ri - 1) % self.r) * self.u + self.ui
        recv = torch.empty(2, incoming, *chunk.shape[2:], dtype=chunk.dtype)
        ops = [dist.P2POp(dist.isend, chunk.contiguous(), nxt), dist.P2POp(dist.irecv, recv, prev)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return recv


class _Plan:
    """A forward's layout over the grid, from the snapshot alone (so every rank computes the same, with no
    exchange): who holds which query tokens, which ring group owns each position, which keys each group reads."""

    def __init__(
        self, batch: ForwardBatch, total: int, n: int, u: int, r: int, ri: int, kv_scales: list[tuple[float, float]]
    ) -> None:
        rows = batch.metadata.rows
        bs = batch.metadata.block_size
        pos, row_of, limit = [], [], []
        for k, row in enumerate(rows):
            for seg in row.segments:
                for p in range(seg.q_start, seg.q_end):
                    pos.append(p)
                    row_of.append(k)
                    limit.append(p + 1 if seg.causal else seg.kv_end)  # keys it sees: [0, limit)
        self.r, self.kv_scales = r, kv_scales  # (fp8 pages: each layer's K and V scales)

        def owner(p: int) -> int:
            return (p // bs) % r

        def group_tokens(g: int) -> range:
            return range(g * u * n, min((g + 1) * u * n, total))

        mine = group_tokens(ri)
        self.real = len(mine)
        by_owner = [[t for t in mine if owner(pos[t]) == o] for o in range(r)]
        self.send_order = torch.tensor([t - mine.start for o in range(r) for t in by_owner[o]], dtype=torch.long)
        self.send_counts = [len(b) for b in by_owner]
        incoming = [[t for t in group_tokens(g) if owner(pos[t]) == ri] for g in range(r)]
        self.recv_counts = [len(b) for b in incoming]
        self.recv_slots = batch.slot_mapping[torch.tensor([t for b in incoming for t in b], dtype=torch.long)]
        # each group's keys: every position below each row's length that it owns, with its row and slot
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.key_slots: list[torch.Tensor] = []
        for g in range(r):
            kp, kr, ks = [], [], []
            for k, row in enumerate(rows):
                ids = row.block_ids[0]
                for p in range(row.seq_len):
                    if owner(p) == g:
                        kp.append(p)
                        kr.append(k)
                        ks.append(ids[p // bs] * bs + p % bs)
            self.keys.append((torch.tensor(kp, dtype=torch.long), torch.tensor(kr, dtype=torch.long)))
            self.key_slots.append(torch.tensor(ks, dtype=torch.long))
        self.q_row = torch.tensor([row_of[t] for t in mine], dtype=torch.long)
        self.q_limit = torch.tensor([limit[t] for t in mine], dtype=torch.long)

    def key_count(self, g: int) -> int:
        return int(self.key_slots[g].numel())

    def visible(self, g: int) -> torch.Tensor:
        """(my queries, group g's keys): same row, and the key before the query's limit."""
        kp, kr = self.keys[g]
        return (self.q_row[:, None] == kr[None, :]) & (kp[None, :] < self.q_limit[:, None])
