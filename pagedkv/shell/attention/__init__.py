"""Attention over pages, behind one small interface, selected by name (``registry``): the ``torch``
reference (``torch_ref``), the Triton kernels (``triton``, ``triton_decode``), flash-attn
(``flash``) and torch-npu (``npu``), sharing ``base``'s parameters and segment calls."""

from pagedkv.shell.attention.base import (
    AttentionBackend,
    LayerAttention,
    SegmentCall,
    lowest_visible_key,
    run_segments,
    segment_calls,
)
from pagedkv.shell.attention.registry import get_backend
from pagedkv.shell.attention.torch_ref import TorchBackend

__all__ = [
    "AttentionBackend",
    "LayerAttention",
    "SegmentCall",
    "TorchBackend",
    "get_backend",
    "lowest_visible_key",
    "run_segments",
    "segment_calls",
]
