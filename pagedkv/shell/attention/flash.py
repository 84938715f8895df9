"""flash-attn over the shell's pages (unvalidated on hardware here: no flash-attn on these machines).

FA3 (``flash_attn_interface``, Hopper): ``flash_attn_with_kvcache`` with ``page_table`` and
``cache_seqlens``, any block size. FA2 (``flash_attn``): ``flash_attn_varlen_func`` with
``block_table`` and ``cu_seqlens_k``; its paged path needs a block size divisible by 256.
Tables are int32. Sliding windows map to ``window_size=(window - 1, 0)``; softcap passes through.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.core.config import GroupKind
from pagedkv.core.errors import ErrorCode
from pagedkv.shell.attention.base import LayerAttention, SegmentCall, run_segments
from pagedkv.shell.errors import BackendUnavailable, refuse
from pagedkv.shell.worker import ForwardBatch

INSTALL = "pip install 'pagedkv[flash]'  (flash-attn; FA3 comes from flash-attention's hopper/ build)"


class FlashAttnBackend:
    name = "flash_attn"
    kv_write = None  # two index_copy_ (the page pool's own write)

    def __init__(self) -> None:
        self.fa3: Any = None
        self.fa2: Any = None
        try:
            import flash_attn_interface

            self.fa3 = flash_attn_interface
        except ImportError:
            pass
        try:
            import flash_attn

            self.fa2 = flash_attn
        except ImportError:
            pass
        if self.fa3 is None and self.fa2 is None:
            raise BackendUnavailable(self.name, INSTALL, "neither flash_attn nor flash_attn_interface imports")

    def forward(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch,
                layer: LayerAttention) -> torch.Tensor:  # fmt: skip
        spec = layer.spec
        if spec.kind is GroupKind.CHUNKED_LOCAL:
            raise refuse(ErrorCode.INVALID, "chunked local attention has no flash-attn window form; "
                                            "use the torch backend for that group")  # fmt: skip
        if spec.kind is GroupKind.SLIDING_WINDOW and any(not s.causal for s in batch.metadata.rows[0].segments):
            raise refuse(ErrorCode.INVALID, "a full span under a sliding window has no flash-attn window form (its "
                                            "window is causal); use the torch backend for that group")  # fmt: skip
        window = (spec.window - 1, 0) if spec.kind is GroupKind.SLIDING_WINDOW and spec.window else (-1, -1)
        table = batch.block_tables[layer.group].to(torch.int32)
        block_size = k_pages.shape[1]
        softcap = float(layer.softcap or 0.0)
        if self.fa3 is None and block_size % 256:
            raise refuse(ErrorCode.INVALID, f"flash-attn 2's paged path needs a block size divisible by 256; "
                                            f"the pool's is {block_size} (FA3 takes any size)")  # fmt: skip

        def kernel(qp: torch.Tensor, call: SegmentCall) -> torch.Tensor:
            if self.fa3 is not None:
                return self.fa3.flash_attn_with_kvcache(  # type: ignore[no-any-return]
                    qp, k_pages, v_pages, cache_seqlens=call.kv_lens, page_table=table,
                    cu_seqlens_q=call.cu_seqlens_q, max_seqlen_q=call.max_seqlen_q, softmax_scale=layer.scale,
                    causal=call.causal, window_size=window, softcap=softcap,
                )  # fmt: skip
            cu_k = torch.zeros_like(call.cu_seqlens_q)
            cu_k[1:] = torch.cumsum(call.kv_lens, 0)
            return self.fa2.flash_attn_varlen_func(  # type: ignore[no-any-return]
                qp, k_pages, v_pages, cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=cu_k,
                max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k, softmax_scale=layer.scale,
                causal=call.causal, window_size=window, softcap=softcap, block_table=table,
            )  # fmt: skip

        return run_segments(q, batch, kernel)
