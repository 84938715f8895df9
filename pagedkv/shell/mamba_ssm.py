"""The ``mamba_ssm`` mixer backend (CUDA): ``mamba-ssm``'s SSD kernel (``mamba_chunk_scan_combined``) and its
one-token state update (``selective_state_update``), ``causal-conv1d``'s convolution and its update, over the
pool's state pages. Each row's state is read from and written to its state block (``state_batch_indices`` and
``conv_state_indices`` name the pages; no copy of the states). Where the packages or a CUDA device are missing it
refuses with what to install; it never falls back to the reference on its own."""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.shell.errors import BackendUnavailable
from pagedkv.shell.mamba import Mamba2Weights, by_row
from pagedkv.shell.worker import ForwardBatch

INSTALL = "pip install mamba-ssm causal-conv1d (CUDA; they build with nvcc)"


class MambaSsmMixer:
    name = "mamba_ssm"

    def __init__(self) -> None:
        try:
            from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        except ImportError as e:
            raise BackendUnavailable(self.name, INSTALL, str(e)) from None
        if not torch.cuda.is_available():
            raise BackendUnavailable(self.name, INSTALL, "its kernels need a CUDA device")
        self._conv_fn: Any = causal_conv1d_fn
        self._conv_update: Any = causal_conv1d_update
        self._step: Any = selective_state_update
        self._scan: Any = mamba_chunk_scan_combined

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
            return self._decode(xbc, dt, w, conv, ssm, blocks, batch)

        def row(
            xr: torch.Tensor, d: torch.Tensor, cs: torch.Tensor | None, s0: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            n = xr.shape[0]
            # (1, conv_dim, L) and (1, conv_dim, k - 1) channels last: the layout causal-conv1d takes initial states in
            x = xr.contiguous()[None].transpose(1, 2)
            init = None if cs is None else cs[None].to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)
            h, new_cs = self._conv_fn(
                x,
                w.conv_w.to(x.dtype),
                None if w.conv_b is None else w.conv_b.to(x.dtype),
                initial_states=init,
                return_final_states=True,
                activation="silu",
            )
            inner, gn = w.heads * w.head_dim, w.groups * w.d_state
            xs, B, C = torch.split(h.transpose(1, 2)[0], [inner, gn, gn], dim=-1)  # (L, ...)
            y, s1 = self._scan(
                xs.reshape(1, n, w.heads, w.head_dim),
                d[None],
                w.A,
                B.reshape(1, n, w.groups, w.d_state),
                C.reshape(1, n, w.groups, w.d_state),
                w.chunk,
                D=w.D,
                dt_bias=w.dt_bias,
                initial_states=None if s0 is None else s0[None].float(),
                dt_softplus=True,
                dt_limit=w.dt_limit,
                return_final_states=True,
            )
            return y, new_cs, s1

        return by_row(xbc, dt, w, conv, ssm, blocks, batch, row)

    def _decode(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        w: Mamba2Weights,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        blocks: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """One token a row: the kernels update the states in their pages (a row that starts at 0 first gets zero
        states: its block may hold an old one). No host sync: a CUDA graph captures it."""
        live = (batch.kv_start > 0) & (blocks > 0)
        conv.index_copy_(0, blocks, torch.where(live[:, None, None], conv.index_select(0, blocks), 0))
        ssm.index_copy_(0, blocks, torch.where(live[:, None, None, None], ssm.index_select(0, blocks), 0))
        idx = blocks.to(torch.int32)
        h = self._conv_update(
            xbc,
            conv,
            w.conv_w.to(conv.dtype),
            None if w.conv_b is None else w.conv_b.to(conv.dtype),
            activation="silu",
            conv_state_indices=idx,
        )
        n, inner, gn = xbc.shape[0], w.heads * w.head_dim, w.groups * w.d_state
        xs, B, C = torch.split(h, [inner, gn, gn], dim=-1)
        p = w.head_dim
        y = self._step(
            ssm,
            xs.reshape(n, w.heads, p),
            dt[:, :, None].expand(-1, -1, p),
            w.A[:, None, None].expand(-1, p, w.d_state),
            B.reshape(n, w.groups, w.d_state),
            C.reshape(n, w.groups, w.d_state),
            D=w.D[:, None].expand(-1, p),
            dt_bias=w.dt_bias[:, None].expand(-1, p),
            dt_softplus=True,
            state_batch_indices=idx,
        )
        out: torch.Tensor = y.reshape(n, -1).to(xbc.dtype)
        return out
