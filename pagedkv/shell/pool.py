"""Device page pools: per layer K and V pages, allocated once from the core's geometry."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedkv.core.config import CacheConfig

KVWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``(k, v, k_pages, v_pages, slot_mapping) -> None``: one kernel writing a layer's new K and V."""


class PagePool:
    """Per layer K and V pages, ``(num_blocks, block_size, kv_heads_on_this_rank, head_dim)``:
    the layout flash-attn's paged path reads. ``write``: a backend's fused K/V write kernel
    (``AttentionBackend.kv_write``), or None for two ``index_copy_``."""

    def __init__(self, config: CacheConfig, *, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 write: KVWrite | None = None) -> None:  # fmt: skip
        self.config = config
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (config.num_blocks, config.block_size, kv_heads, head_dim)
        # zeros: block 0 (the null block) and padding slots hold finite values, never garbage
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._fused = write

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this forward's K/V, ``(tokens, kv_heads, head_dim)``, once, through the slot mapping.

        Padding tokens map to slots of the null block, never to -1, so no index is negative.
        """
        if self._fused is not None:  # one kernel for K and V
            self._fused(k, v, self.k[layer], self.v[layer], slot_mapping)
            return
        flat = (-1, self.kv_heads, self.head_dim)
        self.k[layer].view(flat).index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].view(flat).index_copy_(0, slot_mapping, v.to(self.dtype))
