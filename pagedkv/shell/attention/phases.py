"""One backend a phase: ``get_backend("triton+flashinfer")`` runs decode forwards on the triton backend
(captured in the engine's CUDA graphs, where it is as fast as FlashInfer or faster: bench/RESULTS.md) and
forwards with several query tokens (prefill, chunked prefill, denoising steps) on FlashInfer's prefill
kernels (launched from its C++ side: a layer's call costs less host time than a Triton launch), and
float32 forwards, which FlashInfer does not compute, on triton. Which backend ran which phase is in
``PhaseBackend.calls``."""

from __future__ import annotations

import torch

from pagedkv.core.outputs.metadata import Phase
from pagedkv.shell.attention.base import AttentionBackend, LayerAttention
from pagedkv.shell.pool import KVWrite
from pagedkv.shell.worker import ForwardBatch


class PhaseBackend:
    """Decode on ``decode``, every other phase on ``prefill`` (float32 on ``decode`` too)."""

    capturable = True  # graphs capture decode forwards only: the decode backend's

    def __init__(self, decode: AttentionBackend, prefill: AttentionBackend) -> None:
        self.decode, self.prefill = decode, prefill
        self.name = f"{decode.name}+{prefill.name}"
        self.calls = {decode.name: 0, prefill.name: 0}

    @property
    def kv_write(self) -> KVWrite | None:
        return self.decode.kv_write  # (the pages are the same: one write for both)

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
        use = self.decode if batch.metadata.phase is Phase.DECODE or q.dtype == torch.float32 else self.prefill
        self.calls[use.name] += 1
        return use.forward(q, k_pages, v_pages, batch, layer)
