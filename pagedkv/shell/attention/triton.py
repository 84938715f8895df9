"""The ``triton`` backend: decode forwards through the Triton split-KV kernel (no host syncs, so a
CUDA graph can capture them); forwards with several query tokens (prefill, chunked prefill,
denoising steps) through the varlen kernel, one call per segment of the core's metadata, the decode rows
riding at their front (``runner.ride_along``) through the decode kernel.

What the kernels do not compute (chunked local groups, an explicit head map of a tensor-parallel
shard, a logit softcap) is refused with a message naming the backend that does: a layer is never
rerouted to another backend behind the caller's back.
"""

from __future__ import annotations

import torch

from pagedkv.core.errors import ErrorCode
from pagedkv.core.rules.kinds import GroupKind
from pagedkv.core.outputs.metadata import Phase
from pagedkv.shell.attention.base import LayerAttention, SegmentCall, decode_lead, run_segments
from pagedkv.shell.errors import BackendUnavailable, refuse
from pagedkv.shell.worker import ForwardBatch


class TritonBackend:
    name = "triton"
    capturable = True  # its decode path has no host sync: a CUDA graph captures it (shell.graphs)
    fp8_pages = True  # its kernels read fp8 pages and apply the layer's scales in registers

    def __init__(self, programs: int | None = None) -> None:  # programs a row: None, triton_decode.auto_programs
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise BackendUnavailable(self.name, "pip install triton (with a CUDA build of torch)", str(e)) from None
        if not torch.cuda.is_available():
            raise BackendUnavailable(self.name, "a CUDA device", "no CUDA device is available")
        from pagedkv.shell.attention.triton_decode import kv_write, paged_decode, paged_varlen

        self._decode, self._varlen, self.programs = paged_decode, paged_varlen, programs
        self.kv_write = kv_write  # the slot-mapping write as one kernel (K and V together)

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
        spec = layer.spec
        if spec.kind is GroupKind.CHUNKED_LOCAL or layer.kv_index is not None or layer.softcap:
            what = (
                "chunked local attention"
                if spec.kind is GroupKind.CHUNKED_LOCAL
                else "an explicit head map (a tensor-parallel shard)"
                if layer.kv_index is not None
                else "a logit softcap"
            )
            raise refuse(ErrorCode.INVALID, f"the triton backend does not compute {what}; use the torch backend")
        table = batch.block_tables[layer.group]
        window = spec.window if spec.kind is GroupKind.SLIDING_WINDOW and spec.window else 0
        if batch.metadata.phase is Phase.DECODE:  # one query token a row, one causal segment
            return self._decode(
                q,
                k_pages,
                v_pages,
                table,
                batch.seq_lens,
                layer.scale,
                programs=self.programs,
                window=window,
                kv_scales=layer.kv_scales,
            )

        lead = decode_lead(batch)  # (decode rows riding in a prompt's forward: the decode kernel's, its splits)
        out: torch.Tensor | None = None  # (with a lead: one output, the decode rows' first)
        if lead:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self._decode(
                q[:lead],
                k_pages,
                v_pages,
                table[:lead],
                batch.seq_lens[:lead],
                layer.scale,
                programs=self.programs,
                window=window,
                kv_scales=layer.kv_scales,
                out=out[:lead],
            )
            if lead == batch.num_rows:
                return out

        def kernel(qp: torch.Tensor, call: SegmentCall) -> torch.Tensor:
            return self._varlen(
                qp,
                k_pages,
                v_pages,
                table,
                call.cu_seqlens_q,
                call.kv_lens,
                call.max_seqlen_q,
                causal=call.causal,
                scale=layer.scale,
                window=window,
                kv_scales=layer.kv_scales,
                first_row=lead,  # (the rows after the lead)
                out=out,  # (with a lead: rows of one segment, one call over the tokens in order, after the lead's)
            )

        return run_segments(q, batch, kernel)  # several query tokens: one native call per segment
