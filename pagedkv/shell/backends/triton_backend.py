"""The ``triton`` backend: decode forwards through the Triton split-KV kernel (no host syncs, so a
CUDA graph can capture them); forwards with several query tokens (prefill, chunked prefill,
denoising steps) through the varlen kernel, one call per segment of the core's metadata. Chunked
local groups, explicit head maps and softcap go to the ``torch`` reference."""

from __future__ import annotations

import torch

from pagedkv.core.config import GroupKind
from pagedkv.shell.attention import LayerAttention, SegmentCall, TorchBackend, run_segments
from pagedkv.shell.errors import BackendUnavailable
from pagedkv.shell.worker import ForwardBatch


class TritonBackend:
    name = "triton"

    def __init__(self, splits: int = 8) -> None:
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise BackendUnavailable(self.name, "pip install triton (with a CUDA build of torch)", str(e)) from None
        if not torch.cuda.is_available():
            raise BackendUnavailable(self.name, "a CUDA device", "no CUDA device is available")
        from pagedkv.shell.backends.triton_decode import paged_decode, paged_varlen

        self._decode, self._varlen, self._reference, self.splits = paged_decode, paged_varlen, TorchBackend(), splits
        self.decode_only = False  # set by a graph capture: every forward is a decode forward

    def forward(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch,
                layer: LayerAttention) -> torch.Tensor:  # fmt: skip
        spec = layer.spec
        if spec.kind is GroupKind.CHUNKED_LOCAL or layer.kv_index is not None or layer.softcap:
            return self._reference.forward(q, k_pages, v_pages, batch, layer)
        table = batch.block_tables[layer.group]
        window = spec.window if spec.kind is GroupKind.SLIDING_WINDOW and spec.window else 0
        if self.decode_only or all(r.query_len == 1 and len(r.segments) == 1 for r in batch.metadata.rows):
            return self._decode(q, k_pages, v_pages, table, batch.seq_lens, layer.scale, splits=self.splits,
                                window=window)  # fmt: skip

        def kernel(qp: torch.Tensor, call: SegmentCall) -> torch.Tensor:
            return self._varlen(qp, k_pages, v_pages, table, call.cu_seqlens_q, call.kv_lens, call.max_seqlen_q,
                                causal=call.causal, scale=layer.scale, window=window)  # fmt: skip

        return run_segments(q, batch, kernel)  # several query tokens: one native call per segment
