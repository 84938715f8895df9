"""torch-npu over the shell's pages (unvalidated on hardware here: no Ascend NPU on these machines).

``torch_npu.npu_fused_infer_attention_score`` in TND layout with ``block_table`` and
``block_size``; ``actual_seq_lengths`` are cumulative query lengths (TND), and
``actual_seq_lengths_kv`` the keys each row reads. Causal segments use ``sparse_mode=3`` with
the compressed 2048x2048 mask; full segments ``sparse_mode=0``; a sliding window is the band
mode (``sparse_mode=4``, ``pre_tokens=window - 1``, ``next_tokens=0``). Pages are read as
``(num_blocks, block_size, kv_heads * head_dim)``. The block size must be a multiple of 16 and
at most 512 (fp16/bf16). KV is written with ``torch_npu._npu_reshape_and_cache``.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.core.errors import ErrorCode
from pagedkv.core.rules.kinds import GroupKind
from pagedkv.shell.attention.base import LayerAttention, SegmentCall, run_segments
from pagedkv.shell.errors import BackendUnavailable, refuse
from pagedkv.shell.worker import ForwardBatch

INSTALL = "pip install 'pagedkv[npu]'  (torch-npu, matching your CANN and torch versions)"


class NpuBackend:
    name = "npu"
    kv_write = None  # two index_copy_ (the page pool's own write)
    fp8_pages = False  # no fp8 path here: kv_cache_dtype fp8 is refused with this backend

    def __init__(self) -> None:
        try:
            import torch_npu
        except ImportError as e:
            raise BackendUnavailable(self.name, INSTALL, f"torch_npu does not import: {e}") from None
        self.npu: Any = torch_npu
        self._causal_mask: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
        num_blocks, block_size, kv_heads, head_dim = k_pages.shape
        if block_size % 16 or block_size > 512:
            raise refuse(
                ErrorCode.INVALID,
                f"npu_fused_infer_attention_score needs a block size that is a "
                f"multiple of 16 and at most 512; the pool's is {block_size}",
            )
        spec = layer.spec
        if spec.kind is GroupKind.CHUNKED_LOCAL:
            raise refuse(ErrorCode.INVALID, "chunked local attention has no fused-infer form; use the torch backend")
        if spec.kind is GroupKind.SLIDING_WINDOW and any(not s.causal for s in batch.metadata.rows[0].segments):
            raise refuse(
                ErrorCode.INVALID,
                "a full span under a sliding window has no fused-infer mask (its band "
                "is causal); use the torch backend for that group",
            )
        key = k_pages.view(num_blocks, block_size, kv_heads * head_dim)
        value = v_pages.view(num_blocks, block_size, kv_heads * head_dim)
        table = batch.block_tables[layer.group].to(torch.int32)

        def kernel(qp: torch.Tensor, call: SegmentCall) -> torch.Tensor:
            kw: dict[str, Any] = dict(
                num_heads=q.shape[1],
                num_key_value_heads=kv_heads,
                input_layout="TND",
                block_table=table,
                block_size=block_size,
                actual_seq_lengths=call.cu_seqlens_q[1:].tolist(),
                actual_seq_lengths_kv=call.kv_lens.tolist(),
            )
            if call.causal and spec.kind is GroupKind.SLIDING_WINDOW and spec.window:
                kw.update(sparse_mode=4, pre_tokens=spec.window - 1, next_tokens=0, atten_mask=self._mask(qp.device))
            elif call.causal:
                kw.update(sparse_mode=3, atten_mask=self._mask(qp.device))
            else:
                kw.update(sparse_mode=0)
            try:
                out, _ = self.npu.npu_fused_infer_attention_score(qp, key, value, scale=layer.scale, **kw)
            except TypeError:  # releases before 2.1 call it scale_value
                out, _ = self.npu.npu_fused_infer_attention_score(qp, key, value, scale_value=layer.scale, **kw)
            return out  # type: ignore[no-any-return]

        return run_segments(q, batch, kernel)

    def _mask(self, device: torch.device) -> torch.Tensor:
        if self._causal_mask is None or self._causal_mask.device != device:
            self._causal_mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
        return self._causal_mask
