"""Device page pools: per layer K and V pages, allocated once from the core's geometry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedkv.core.config import CacheConfig, InvalidConfig


@dataclass(frozen=True, slots=True)
class PoolSizing:
    num_blocks: int  # including the null block 0
    page_bytes: int  # all layers' K and V pages of one block
    total_bytes: int
    tokens: int  # tokens the usable blocks hold

    def __str__(self) -> str:
        return (f"{self.num_blocks} blocks ({self.num_blocks - 1} usable) x {self.page_bytes} bytes = "
                f"{self.total_bytes / 2**20:.1f} MiB, {self.tokens} tokens")  # fmt: skip


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V pages of one block over every layer on this rank."""
    return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def size_pool(
    *,
    num_layers: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kv_cache_memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    profile: Callable[[], object] | None = None,
) -> PoolSizing:
    """Blocks for an explicit byte budget, or (CUDA) for a memory fraction of the device
    minus the non-KV memory a profile forward of the largest shape takes.

    >>> s = size_pool(num_layers=30, block_size=16, kv_heads=3, head_dim=64, dtype=torch.float32,
    ...               kv_cache_memory_bytes=1 << 30)
    >>> s.num_blocks, s.page_bytes
    (1456, 737280)
    """
    per_block = bytes_per_block(num_layers, block_size, kv_heads, head_dim, dtype)
    device = torch.device(device)
    if kv_cache_memory_bytes is None:
        if device.type != "cuda":
            raise InvalidConfig(f"on {device.type} the KV budget must be given: pass kv_cache_memory_bytes "
                                "(a memory fraction is measured only on CUDA)")  # fmt: skip
        if memory_fraction is None or not 0 < memory_fraction <= 1 or profile is None:
            raise InvalidConfig("on CUDA give kv_cache_memory_bytes, or memory_fraction in (0, 1] with a profile "
                                "forward of the largest shape")  # fmt: skip
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile()
        torch.cuda.synchronize(device)
        non_kv = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        kv_cache_memory_bytes = int(total * memory_fraction) - non_kv
    num_blocks = kv_cache_memory_bytes // per_block
    if num_blocks < 2:
        raise InvalidConfig(f"{kv_cache_memory_bytes} bytes hold {num_blocks} blocks of {per_block} bytes; "
                            "a pool needs at least 2 (block 0 is the null block)")  # fmt: skip
    return PoolSizing(num_blocks, per_block, num_blocks * per_block, (num_blocks - 1) * block_size)


class PagePool:
    """Per layer K and V pages, ``(num_blocks, block_size, kv_heads_on_this_rank, head_dim)``:
    the layout flash-attn's paged path reads."""

    def __init__(self, config: CacheConfig, *, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:  # fmt: skip
        self.config = config
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (config.num_blocks, config.block_size, kv_heads, head_dim)
        # zeros: block 0 (the null block) and padding slots hold finite values, never garbage
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.fused_write: object = None  # e.g. triton_decode.kv_write: (k, v, k_pages, v_pages, slots) -> None

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this forward's K/V, ``(tokens, kv_heads, head_dim)``, once, through the slot mapping.

        Padding tokens map to slots of the null block, never to -1, so no index is negative.
        """
        if self.fused_write is not None:  # one kernel for K and V (the triton backend on CUDA)
            self.fused_write(k, v, self.k[layer], self.v[layer], slot_mapping)  # type: ignore[operator]
            return
        flat = (-1, self.kv_heads, self.head_dim)
        self.k[layer].view(flat).index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].view(flat).index_copy_(0, slot_mapping, v.to(self.dtype))
