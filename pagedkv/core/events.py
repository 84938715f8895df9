"""KV events: what a transition did to the prefix cache, as vLLM publishes them
for cache-aware routers. They ride in each transition's effect."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full computed block entered the cache index."""

    block_hash: BlockHash
    parent_hash: BlockHash | None  # None for a first block
    token_ids: tuple[int, ...]
    group: int
    block_id: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A cached block was evicted (allocation reused it); its hash is gone."""

    block_hash: BlockHash
    group: int
    block_id: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """``reset_prefix_cache`` (or ``reset``) dropped every hash."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
