"""Device page pools: per layer slot K and V pages (and, for a hybrid model, its Mamba layers' states in the same
pages), allocated once from the core's geometry."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedkv.core.config import CacheConfig, InvalidConfig

KVWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``(k, v, k_pages, v_pages, slot_mapping) -> None``: one kernel writing a layer's new K and V."""

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # page dtypes stored quantized: a scale per layer for K and for V


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in an fp8 ``dtype``, saturated at its largest finite value (vLLM's fp8 KV write)."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-top, top).to(dtype)


@dataclass(frozen=True, slots=True)
class StateShape:
    """One Mamba2 layer's state, as a page holds it: the conv state ``(conv_dim, kernel - 1)`` (the last inputs
    of the causal convolution, causal-conv1d's layout) then the SSM state ``(heads, head_dim, d_state)``, both in
    the pool's dtype.

    >>> StateShape((80, 3), (4, 16, 8)).elements
    752
    """

    conv: tuple[int, int]
    ssm: tuple[int, int, int]

    @property
    def elements(self) -> int:
        return math.prod(self.conv) + math.prod(self.ssm)


class PagePool:
    """Per layer slot K and V pages, ``(num_blocks, block_size, kv_heads_on_this_rank, head_dim)``:
    the layout flash-attn's paged path reads. ``write``: a backend's fused K/V write kernel
    (``AttentionBackend.kv_write``), or None for two ``index_copy_``. An fp8 ``dtype`` (``FP8``) stores K and V
    quantized, each layer with its own K and V scale (``write``'s ``scales``; readers multiply them back).

    With ``state`` (a hybrid model: state groups beside attention groups), a block of a slot is one page
    that holds either an attention block's K and V or a Mamba layer's state (vLLM's hybrid layout): each
    slot is one buffer ``(num_blocks, page)``, K and V are its halves (``(num_blocks, 2, block_size, ...)``:
    a block's K and V side by side, so K's and V's block stride is the whole page), and ``conv[slot]``,
    ``ssm[slot]`` view the same pages as states (the rest of a page is padding)."""

    def __init__(
        self,
        config: CacheConfig,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        write: KVWrite | None = None,
        state: StateShape | None = None,
    ) -> None:
        self.config = config
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.state = state
        self.fp8 = dtype in FP8
        if self.fp8 and state is not None:
            raise InvalidConfig("fp8 pages beside Mamba states are not served: a state kept in fp8 drifts step by step")
        nb, bs = config.num_blocks, config.block_size
        shape = (nb, bs, kv_heads, head_dim)
        self.conv: list[torch.Tensor] = []
        self.ssm: list[torch.Tensor] = []
        # every layer's pages in one tensor a side, ``(layers, num_blocks, ...)``, each layer's a view of it: a copy of
        # some blocks in every layer is one index operation (the host tier's: shell/host_pages.py). K and V; a hybrid
        # pool's one side, its pages (a block's K and V, or a Mamba layer's state)
        self.whole: tuple[torch.Tensor, ...]
        if state is None:
            # zeros: block 0 (the null block) and padding slots hold finite values, never garbage
            k_all = torch.zeros((num_layers, *shape), dtype=dtype, device=self.device)
            v_all = torch.zeros((num_layers, *shape), dtype=dtype, device=self.device)
            self.k, self.v = list(k_all.unbind(0)), list(v_all.unbind(0))
            self.whole = (k_all, v_all)
        else:
            page = 2 * bs * kv_heads * head_dim
            if state.elements > page:
                raise InvalidConfig(
                    f"a state of {state.elements} elements does not fit a page of {page} "
                    f"(block size {bs}): plan the pool with plan_rank"
                )
            pages = torch.zeros((num_layers, nb, page), dtype=dtype, device=self.device)
            raw = list(pages.unbind(0))
            kv = [r.view(nb, 2, bs, kv_heads, head_dim) for r in raw]
            self.k, self.v = [t[:, 0] for t in kv], [t[:, 1] for t in kv]
            self.whole = (pages,)  # (a layer's K, V and state share its page)
            c = math.prod(state.conv)
            self.conv = [r[:, :c].view(nb, *state.conv) for r in raw]
            self.ssm = [r[:, c : state.elements].view(nb, *state.ssm) for r in raw]
        self._fused = write
        self._bytes = sum(t.numel() * t.element_size() for t in (self.k + self.v if state is None else raw))

    @property
    def bytes(self) -> int:
        return self._bytes

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        """Write this forward's K/V, ``(tokens, kv_heads, head_dim)``, once, through the slot mapping (fp8 pages:
        quantized by the layer's ``scales``, K's and V's).

        Padding tokens map to slots of the null block, never to -1, so no index is negative.
        """
        if self.fp8:
            k, v = quantize(k, scales[0], self.dtype), quantize(v, scales[1], self.dtype)
        if self._fused is not None:  # one kernel for K and V
            self._fused(k, v, self.k[layer], self.v[layer], slot_mapping)
            return
        if self.state is not None:  # K's blocks a page apart: index (block, offset)
            bs = self.config.block_size
            at = (slot_mapping // bs, slot_mapping % bs)
            self.k[layer].index_put_(at, k.to(self.dtype))
            self.v[layer].index_put_(at, v.to(self.dtype))
            return
        flat = (-1, self.kv_heads, self.head_dim)
        if self.fp8:  # (index_copy_ has no fp8 kernel on every device: the same bytes, as uint8)
            self.k[layer].view(torch.uint8).view(flat).index_copy_(0, slot_mapping, k.view(torch.uint8))
            self.v[layer].view(torch.uint8).view(flat).index_copy_(0, slot_mapping, v.view(torch.uint8))
            return
        self.k[layer].view(flat).index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].view(flat).index_copy_(0, slot_mapping, v.to(self.dtype))
