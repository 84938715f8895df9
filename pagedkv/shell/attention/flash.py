"""flash-attn over the shell's pages.

FA4 (``flash-attn-4``, ``flash_attn.cute``, CuTe DSL; Hopper and Blackwell): ``flash_attn_varlen_func``
with ``page_table``, ``cu_seqlens_q`` and ``seqused_k``, any block size (a block size other than the
kernel's tile reads pages without TMA); written against flash-attn-4 4.0.0b36's interface and not yet run:
on the H200 ``import cutlass.cute`` failed (the nvidia-cutlass-dsl-libs 4.8.1 and 4.6.2 wheels the package index
here serves hold ``cutlass/_mlir`` but no ``cutlass/cute`` sources). FA3
(``flash_attn_interface``, Hopper): ``flash_attn_with_kvcache`` with ``page_table`` and
``cache_seqlens``, any block size. FA2 (``flash_attn``): ``flash_attn_varlen_func`` with ``block_table``
and ``cu_seqlens_k``; its paged path needs a block size divisible by 256. FA3 and FA2 are written
against their APIs and unvalidated on hardware here too. The first that imports serves, in that order.
Tables are int32. Sliding windows map to ``window_size=(window - 1, 0)``; softcap passes through.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.core.errors import ErrorCode
from pagedkv.core.rules.kinds import GroupKind
from pagedkv.shell.attention.base import LayerAttention, SegmentCall, run_segments
from pagedkv.shell.errors import BackendUnavailable, refuse
from pagedkv.shell.worker import ForwardBatch

INSTALL = (
    "pip install flash-attn-4 (FA4), or 'pagedkv[flash]' (flash-attn 2; FA3 comes from flash-attention's hopper/ build)"
)


class FlashAttnBackend:
    name = "flash_attn"
    kv_write = None  # two index_copy_ (the page pool's own write)
    fp8_pages = False  # no fp8 path here: kv_cache_dtype fp8 is refused with this backend

    def __init__(self) -> None:
        self.fa4: Any = None
        self.fa3: Any = None
        self.fa2: Any = None
        try:
            from flash_attn.cute import flash_attn_varlen_func

            self.fa4 = flash_attn_varlen_func
        except ImportError:
            pass
        try:
            import flash_attn_interface

            self.fa3 = flash_attn_interface
        except ImportError:
            pass
        try:
            import flash_attn

            if hasattr(flash_attn, "flash_attn_varlen_func"):  # (FA4 alone leaves flash_attn a namespace)
                self.fa2 = flash_attn
        except ImportError:
            pass
        if self.fa4 is None and self.fa3 is None and self.fa2 is None:
            raise BackendUnavailable(
                self.name, INSTALL, "none of flash_attn.cute, flash_attn_interface, flash_attn imports"
            )
        self.version = 4 if self.fa4 is not None else 3 if self.fa3 is not None else 2

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
        spec = layer.spec
        if spec.kind is GroupKind.CHUNKED_LOCAL:
            raise refuse(
                ErrorCode.INVALID,
                "chunked local attention has no flash-attn window form; use the torch backend for that group",
            )
        if spec.kind is GroupKind.SLIDING_WINDOW and any(not s.causal for s in batch.metadata.rows[0].segments):
            raise refuse(
                ErrorCode.INVALID,
                "a full span under a sliding window has no flash-attn window form (its "
                "window is causal); use the torch backend for that group",
            )
        window = (spec.window - 1, 0) if spec.kind is GroupKind.SLIDING_WINDOW and spec.window else (-1, -1)
        table = batch.block_tables[layer.group].to(torch.int32)
        block_size = k_pages.shape[1]
        softcap = float(layer.softcap or 0.0)
        if self.version == 2 and block_size % 256:
            raise refuse(
                ErrorCode.INVALID,
                f"flash-attn 2's paged path needs a block size divisible by 256; "
                f"the pool's is {block_size} (FA3 takes any size)",
            )

        if self.version == 4 and q.dtype not in (torch.float16, torch.bfloat16):
            raise refuse(
                ErrorCode.INVALID,
                f"flash-attn 4 computes float16 and bfloat16 attention; this forward is "
                f"{str(q.dtype)[6:]} (use the triton or torch backend)",
            )

        def kernel(qp: torch.Tensor, call: SegmentCall) -> torch.Tensor:
            if self.fa4 is not None:
                out, _ = self.fa4(
                    qp,
                    k_pages,
                    v_pages,
                    cu_seqlens_q=call.cu_seqlens_q,
                    max_seqlen_q=call.max_seqlen_q,
                    seqused_k=call.kv_lens,
                    page_table=table,
                    softmax_scale=layer.scale,
                    causal=call.causal,
                    window_size=window if window != (-1, -1) else (None, None),
                    softcap=softcap,
                )
                return out  # type: ignore[no-any-return]
            if self.fa3 is not None:
                return self.fa3.flash_attn_with_kvcache(  # type: ignore[no-any-return]
                    qp,
                    k_pages,
                    v_pages,
                    cache_seqlens=call.kv_lens,
                    page_table=table,
                    cu_seqlens_q=call.cu_seqlens_q,
                    max_seqlen_q=call.max_seqlen_q,
                    softmax_scale=layer.scale,
                    causal=call.causal,
                    window_size=window,
                    softcap=softcap,
                )
            cu_k = torch.zeros_like(call.cu_seqlens_q)
            cu_k[1:] = torch.cumsum(call.kv_lens, 0)
            return self.fa2.flash_attn_varlen_func(  # type: ignore[no-any-return]
                qp,
                k_pages,
                v_pages,
                cu_seqlens_q=call.cu_seqlens_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=call.max_seqlen_q,
                max_seqlen_k=call.max_seqlen_k,
                softmax_scale=layer.scale,
                causal=call.causal,
                window_size=window,
                softcap=softcap,
                block_table=table,
            )

        return run_segments(q, batch, kernel)
