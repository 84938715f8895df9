"""The Mamba2 mixer over state pages: each row's conv and SSM state live in its state block (the state group's one
block of the row, ``state_blocks``), read where the row's computed tokens end and written back where this forward
ends them. A row whose forward starts at position 0 starts from zero states (its block may hold an old state).

Backends, chosen by name (``shell.mixers.get_mixer``; ``HybridModel(mixer=...)``): ``torch`` (the reference, runs anywhere: the SSD chunked scan for prompts
and chunks of them, carrying the state from chunk to chunk; the recurrent step when every row has one query token,
all rows at once and without a host sync, so a CUDA graph captures it) and ``mamba_ssm`` (CUDA: the kernels of
``mamba-ssm`` and ``causal-conv1d``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pagedkv.shell.worker import ForwardBatch


@dataclass(frozen=True, slots=True)
class Mamba2Weights:
    """One Mamba2 layer's parameters the scan needs (its projections stay with the model)."""

    conv_w: torch.Tensor  # (conv_dim, kernel)
    conv_b: torch.Tensor | None  # (conv_dim,)
    dt_bias: torch.Tensor  # (heads,)
    A: torch.Tensor  # (heads,) fp32: -exp(A_log)
    D: torch.Tensor  # (heads,)
    heads: int
    head_dim: int
    groups: int  # B and C groups (heads // groups heads share one)
    d_state: int
    chunk: int  # the SSD chunk length
    dt_limit: tuple[float, float] = (0.0, float("inf"))


def state_blocks(batch: ForwardBatch, group: int) -> torch.Tensor:
    """Each row's state block in state group ``group``, (rows,) int64: the one block its list holds (the rest
    is the null block 0; a padding row's is 0). On the device, no host sync."""
    return batch.block_tables[group].amax(dim=-1).long()


class MixerBackend(Protocol):
    name: str

    def forward(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        w: Mamba2Weights,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        blocks: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """``xbc`` (tokens, conv_dim): the convolution's input (x, B, C); ``dt`` (tokens, heads), before its bias
        and softplus; ``conv`` (num_blocks, conv_dim, kernel - 1) and ``ssm`` (num_blocks, heads, head_dim,
        d_state): the layer's state pages; ``blocks``: ``state_blocks``. -> y (tokens, heads * head_dim), the
        scan's output with D's skip (before the gated norm); the rows' states written back."""
        ...


class TorchMixer:
    """The reference: fp32 math, states stored in the pool's dtype."""

    name = "torch"

    def forward(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        w: Mamba2Weights,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        blocks: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        if batch.num_tokens == batch.num_rows:
            return self._step(xbc, dt, w, conv, ssm, blocks, batch)

        def row(
            x: torch.Tensor, d: torch.Tensor, cs: torch.Tensor | None, s0: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            h, new_cs = conv_prefill(x, torch.zeros_like(conv[0]) if cs is None else cs, w)
            y, s1 = ssd_scan(h, d, w, torch.zeros_like(ssm[0], dtype=torch.float32) if s0 is None else s0.float())
            return y, new_cs, s1

        return by_row(xbc, dt, w, conv, ssm, blocks, batch, row)

    @staticmethod
    def _step(
        xbc: torch.Tensor,
        dt: torch.Tensor,
        w: Mamba2Weights,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        blocks: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """One query token a row, every row at once: the recurrent form."""
        n = xbc.shape[0]
        live = ((batch.kv_start > 0) & (blocks > 0))[:, None]  # rows that carry a state in
        cs = torch.where(live[:, :, None], conv.index_select(0, blocks), 0).float()  # (rows, conv_dim, k - 1)
        window = torch.cat((cs, xbc.float()[:, :, None]), dim=-1)  # (rows, conv_dim, k)
        x = (window * w.conv_w.float()).sum(-1)
        if w.conv_b is not None:
            x = x + w.conv_b.float()
        x = F.silu(x)
        conv.index_copy_(0, blocks, window[:, :, 1:].to(conv.dtype))
        xs, B, C = _split(x, w)  # (rows, heads, head_dim), (rows, heads, d_state) x 2
        delta = _delta(dt, w)  # (rows, heads)
        s = torch.where(live[:, :, None, None], ssm.index_select(0, blocks), 0).float()
        s = s * torch.exp(delta * w.A)[:, :, None, None] + (delta[:, :, None] * xs)[..., None] * B[:, :, None, :]
        ssm.index_copy_(0, blocks, s.to(ssm.dtype))
        y = torch.einsum("rhpn,rhn->rhp", s, C) + w.D.float()[:, None] * xs
        return y.reshape(n, -1).to(xbc.dtype)


RowScan = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""``(xbc, dt, conv state | None, ssm state | None) -> (y, conv state, ssm state)``: one row's query tokens from where
its states leave it (None: the row starts at position 0)."""


def by_row(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    w: Mamba2Weights,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    blocks: torch.Tensor,
    batch: ForwardBatch,
    scan: RowScan,
) -> torch.Tensor:
    """A forward of several query tokens a row, row by row (both backends' prefill): each row's states read from its
    state block (None where the row starts at 0: a block just taken may hold someone's old state), ``scan`` over its
    tokens, the new states written back. -> y (tokens, heads * head_dim)."""
    out = torch.empty(xbc.shape[0], w.heads * w.head_dim, dtype=xbc.dtype, device=xbc.device)
    qsl = batch.query_start_loc.tolist()
    for r, row in enumerate(batch.metadata.rows):
        a, b = qsl[r], qsl[r + 1]
        block = blocks[r : r + 1]
        fresh = row.kv_start_pos == 0
        cs = None if fresh else conv.index_select(0, block)[0]
        s0 = None if fresh else ssm.index_select(0, block)[0]
        y, new_cs, s1 = scan(xbc[a:b], dt[a:b], cs, s0)
        out[a:b] = y.reshape(b - a, -1).to(out.dtype)
        conv.index_copy_(0, block, new_cs.reshape(1, *conv.shape[1:]).to(conv.dtype))
        ssm.index_copy_(0, block, s1.reshape(1, *ssm.shape[1:]).to(ssm.dtype))
    return out


def conv_prefill(xbc: torch.Tensor, cs: torch.Tensor, w: Mamba2Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise convolution over one row's query tokens, ``xbc`` (L, conv_dim), after the inputs its
    state ``cs`` (conv_dim, k - 1) holds -> (silu(conv) (L, conv_dim) fp32, the new state (conv_dim, k - 1))."""
    window = torch.cat((cs.float(), xbc.float().T), dim=-1)[None]  # (1, conv_dim, k - 1 + L)
    x = F.conv1d(
        window, w.conv_w.float()[:, None, :], None if w.conv_b is None else w.conv_b.float(), groups=window.shape[1]
    )[0]
    return F.silu(x.T), window[0, :, -cs.shape[-1] :]


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, w: Mamba2Weights, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's SSD over one row, chunk by chunk (``w.chunk`` tokens): ``x`` (L, conv_dim) after the convolution,
    ``dt`` (L, heads) raw, ``state`` (heads, head_dim, d_state) fp32 where the row's earlier tokens left it ->
    (y (L, heads * head_dim) fp32, the state after the last token).

    Within a chunk, with a = dt * A and S its running sum from the chunk's start, token t gets
    ``sum_{s<=t} (C_t . B_s) exp(S_t - S_s) dt_s x_s`` (the quadratic, attention-like part) plus
    ``exp(S_t) C_t . state`` (what the chunks before left), and the chunk hands on
    ``exp(S_end) state + sum_s exp(S_end - S_s) dt_s x_s B_s^T``."""
    xs, B, C = _split(x, w)  # (L, h, p), (L, h, n), (L, h, n)
    delta = _delta(dt, w)  # (L, h)
    ys = []
    for a in range(0, x.shape[0], w.chunk):
        b = min(a + w.chunk, x.shape[0])
        d, xc, Bc, Cc = delta[a:b], xs[a:b], B[a:b], C[a:b]
        S = torch.cumsum(d * w.A, dim=0)  # (l, h)
        gap = S[:, None, :] - S[None, :, :]  # (t, s, h): S_t - S_s
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(gap.masked_fill(~causal[:, :, None], float("-inf")))
        scores = torch.einsum("thn,shn->tsh", Cc, Bc) * decay
        y = torch.einsum("tsh,shp->thp", scores, d[:, :, None] * xc)
        y = y + torch.exp(S)[:, :, None] * torch.einsum("thn,hpn->thp", Cc, state)
        carry = torch.exp(S[-1:] - S) * d  # (s, h)
        state = torch.exp(S[-1])[:, None, None] * state + torch.einsum("sh,shp,shn->hpn", carry, xc, Bc)
        ys.append(y + w.D.float()[:, None] * xc)
    return torch.cat(ys).reshape(x.shape[0], -1), state


def _split(x: torch.Tensor, w: Mamba2Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (tokens, conv_dim) -> x (tokens, heads, head_dim), B and C (tokens, heads, d_state): each group's B and C
    serve ``heads // groups`` heads."""
    n, inner, gn = x.shape[0], w.heads * w.head_dim, w.groups * w.d_state
    xs, B, C = torch.split(x.float(), [inner, gn, gn], dim=-1)
    per = w.heads // w.groups
    B = B.reshape(n, w.groups, w.d_state).repeat_interleave(per, dim=1)
    C = C.reshape(n, w.groups, w.d_state).repeat_interleave(per, dim=1)
    return xs.reshape(n, w.heads, w.head_dim), B, C


def _delta(dt: torch.Tensor, w: Mamba2Weights) -> torch.Tensor:
    """Each token's step per head: softplus(dt + bias), clamped to the layer's limit."""
    d = F.softplus(dt.float() + w.dt_bias.float())
    lo, hi = w.dt_limit
    return d if (lo, hi) == (0.0, float("inf")) else d.clamp(lo, hi)
