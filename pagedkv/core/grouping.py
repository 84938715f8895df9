"""From a model's layer list to KV cache groups with one page size, and from a
byte budget to a block count.

The rules are those of vLLM's hybrid KV cache manager:

- Layers of one attention kind (and window/chunk) form that kind's layer list.
  Every group holds the same number of layers, ``layers_per_group``: the
  smallest layer count among the kinds. A kind whose count does not divide is
  split into groups of that size, the last one padded (52 sliding-window + 10
  full layers -> 1 full group of 10 and 6 window groups, the last with 2 layers
  and 8 padding slots).
- All groups share ``layers_per_group`` page tensors of ``num_blocks`` pages: a
  block id belongs to one group at a time, and layer slot i of every group uses
  tensor i. So a block costs ``page_bytes x layers_per_group`` bytes.
- A layer that shares another layer's KV gets no blocks: it maps to its target.
- State layers (Mamba) keep one state per request; the attention block size is
  raised (in steps of 16 tokens) until an attention page holds a state, and the
  state page is padded to the attention page.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pagedkv.core.config import CacheConfig, GroupSpec, InvalidConfig
from pagedkv.core.errors import InvariantError, is_int, shown
from pagedkv.core.rules.kinds import GroupKind

BLOCK_ALIGN = 16  # attention kernels want block sizes in multiples of 16 when the size is raised


class LayerKind(StrEnum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MLA = "mla"  # one latent vector (KV LoRA rank + decoupled RoPE part) per token, no heads
    MAMBA = "mamba"


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's KV needs. ``dtype_bytes``: 2 for bf16, 4 for fp32."""

    name: str
    kind: LayerKind = LayerKind.FULL
    kv_heads: int = 1
    head_dim: int = 64
    dtype_bytes: int = 2
    window: int | None = None
    chunk: int | None = None
    kv_sharing_target: str | None = None  # this layer reads that layer's KV
    state_bytes: int | None = None  # Mamba: bytes of its state per request
    latent_dim: int | None = None  # MLA: kv_lora_rank + qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        """What one token costs in this layer's pages: K and V, or one latent vector for MLA."""
        if self.kind is LayerKind.MLA:
            if self.latent_dim is None:
                raise InvariantError("an MLA layer has its latent size")
            return self.latent_dim * self.dtype_bytes
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class PlannedGroup:
    name: str
    kind: LayerKind
    window: int | None
    chunk: int | None
    layers: tuple[str, ...]  # fewer than layers_per_group in a padded group
    block_size: int = 0  # tokens per block of this group (page sizes unified across groups)


@dataclass(frozen=True, slots=True)
class GroupPlan:
    groups: tuple[PlannedGroup, ...]
    layers_per_group: int
    block_size: int  # tokens per attention block (raised when state layers need bigger pages)
    page_bytes: int  # one layer slot's page
    shared: tuple[tuple[str, str], ...]  # (layer, the layer whose KV it reads)
    padding_slots: int  # layer slots no layer fills, over all groups
    state_padding_bytes: int  # per state page: bytes the padding to the attention page adds

    @property
    def bytes_per_block(self) -> int:
        return self.page_bytes * self.layers_per_group

    @property
    def waste_fraction(self) -> float:
        """Share of the pool's bytes that hold nothing: padding layer slots, padded state pages."""
        slots = len(self.groups) * self.layers_per_group
        state_pages = sum(len(g.layers) for g in self.groups if g.kind is LayerKind.MAMBA)
        wasted = self.padding_slots * self.page_bytes + state_pages * self.state_padding_bytes
        return wasted / (slots * self.page_bytes) if slots else 0.0

    def cache_config(self, num_blocks: int, **limits: object) -> CacheConfig:
        """The core's geometry for this plan: its attention groups, then its state (Mamba) groups, whose rows
        hold one state block each (its page padded to the attention page: ``state_padding_bytes``)."""
        sizes = {g.block_size for g in self.groups}
        if len(sizes) > 1:
            raise InvalidConfig(
                f"page sizes are unified with block sizes {sorted(sizes)} tokens; the core "
                "allocates one block size for every group"
            )
        groups = tuple(GroupSpec(g.name, GroupKind(g.kind.value), g.window, g.chunk) for g in self.groups)
        return CacheConfig(block_size=self.block_size, num_blocks=num_blocks, groups=groups, **limits)  # type: ignore[arg-type]


def plan_groups(layers: list[LayerSpec] | tuple[LayerSpec, ...], block_size: int) -> GroupPlan:
    """Group a model's layers into KV cache groups of one page size.

    >>> layers = [LayerSpec(f"swa{i}", LayerKind.SLIDING_WINDOW, window=128) for i in range(52)]
    >>> layers += [LayerSpec(f"full{i}") for i in range(10)]
    >>> plan = plan_groups(layers, 16)
    >>> plan.layers_per_group, len(plan.groups), [len(g.layers) for g in plan.groups], plan.padding_slots
    (10, 7, [10, 10, 10, 10, 10, 10, 2], 8)
    """
    if not is_int(block_size) or block_size < 1:
        raise InvalidConfig(f"block_size must be a positive integer, got {shown(block_size)}")
    owners, shared = _owners(layers)
    bs, page, state_padding = _page_size(owners, block_size)
    # one list of layers per kind (kind, window, chunk), in order of first appearance
    kinds: dict[tuple[LayerKind, int | None, int | None], list[str]] = {}
    tokens_per_block: dict[tuple[LayerKind, int | None, int | None], int] = {}
    for layer in owners:
        key = (layer.kind, layer.window, layer.chunk)
        kinds.setdefault(key, []).append(layer.name)
        tokens_per_block[key] = bs if layer.kind is LayerKind.MAMBA else page // layer.bytes_per_token
    size = min(len(v) for v in kinds.values())
    groups = []
    padding = 0
    for (kind, window, chunk), members in kinds.items():
        for k in range(0, len(members), size):
            chunk_layers = tuple(members[k : k + size])
            padding += size - len(chunk_layers)
            suffix = f"{kind.value}" + (f"{window}" if window else "") + (f"{chunk}" if chunk else "")
            name = suffix if len(members) <= size else f"{suffix}.{k // size}"  # one group: the core's default name
            groups.append(
                PlannedGroup(name, kind, window, chunk, chunk_layers, tokens_per_block[(kind, window, chunk)])
            )
    # full groups first: the hit lookup scans them left to right before the windowed ones cut back
    groups.sort(key=lambda g: g.kind not in (LayerKind.FULL, LayerKind.MLA))
    return GroupPlan(tuple(groups), size, bs, page, tuple(shared), padding, state_padding)


def _owners(layers: list[LayerSpec] | tuple[LayerSpec, ...]) -> tuple[list[LayerSpec], list[tuple[str, str]]]:
    """The layers with KV of their own, and (layer, target) for each layer that reads another's."""
    names = [layer.name for layer in layers]
    if len(set(names)) != len(names):
        raise InvalidConfig("layer names must be unique")
    by_name = {layer.name: layer for layer in layers}
    shared = []
    owners = []
    for layer in layers:
        if layer.kv_sharing_target is not None:
            target = by_name.get(layer.kv_sharing_target)
            if target is None or target.kv_sharing_target is not None:
                raise InvalidConfig(
                    f"layer {shown(layer.name)} shares KV with {shown(layer.kv_sharing_target)}, "
                    "which is not a layer with KV of its own"
                )
            shared.append((layer.name, target.name))
        else:
            owners.append(layer)
    if not owners:
        raise InvalidConfig("no layer has KV of its own")
    return owners, shared


def _page_size(owners: list[LayerSpec], block_size: int) -> tuple[int, int, int]:
    """(attention block size, page bytes, state padding bytes): pages unified to the largest bytes per
    token (vLLM), the block size raised until a page holds a state."""
    attention = [layer for layer in owners if layer.kind is not LayerKind.MAMBA]
    per_token = {layer.bytes_per_token for layer in attention}
    # page-size unification (vLLM): a kind with fewer bytes per token takes more tokens per block
    largest = max(per_token) if per_token else 0
    for b in per_token:
        if largest % b:
            raise InvalidConfig(
                f"attention layers' bytes per token {sorted(per_token)} do not divide; "
                "their pages cannot be made one size"
            )
    if len(per_token) > 1 and any(layer.kind is LayerKind.MAMBA for layer in owners):
        raise InvalidConfig("state layers beside attention layers of different page sizes are not planned")
    state_sizes = []
    for layer in owners:
        if layer.kind is LayerKind.MAMBA:
            if layer.state_bytes is None or not is_int(layer.state_bytes) or layer.state_bytes < 1:
                raise InvalidConfig(f"state layer {shown(layer.name)} needs a positive state_bytes")
            state_sizes.append(layer.state_bytes)
    if not attention:
        return block_size, max(state_sizes), 0
    bs, page = block_size, block_size * largest
    if not state_sizes:
        return bs, page, 0
    while page < max(state_sizes):  # raise the attention block size until a page holds a state
        bs = (bs // BLOCK_ALIGN + 1) * BLOCK_ALIGN
        page = bs * largest
    return bs, page, page - min(state_sizes)


def num_blocks_for_budget(kv_cache_memory_bytes: int, plan: GroupPlan) -> int:
    """How many blocks (the null block included) a per-rank byte budget holds.

    >>> plan = plan_groups([LayerSpec(f"l{i}", kv_heads=3, head_dim=64, dtype_bytes=4) for i in range(30)], 16)
    >>> plan.bytes_per_block, num_blocks_for_budget(1 << 30, plan)
    (737280, 1456)
    """
    if not is_int(kv_cache_memory_bytes) or kv_cache_memory_bytes < 0:
        raise InvalidConfig(f"kv_cache_memory_bytes must be a non-negative integer, got {shown(kv_cache_memory_bytes)}")
    n = kv_cache_memory_bytes // plan.bytes_per_block
    if n < 2:
        raise InvalidConfig(
            f"{kv_cache_memory_bytes} bytes hold {n} blocks of {plan.bytes_per_block} bytes; "
            "a pool needs at least 2 (block 0 is the null block)"
        )
    return n
