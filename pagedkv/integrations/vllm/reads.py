"""What vLLM's scheduler reads of pagedkv's manager besides its decisions: a request's blocks and ids, the
cached-token estimate, usage and prefix-cache stats, and the hooks of features refused at construction (nothing to do, or never
reached). A base of ``PagedKVCacheManager``: it reads the core's blocks and cache (never behind: only a row's length
inside its open block may be) and the block objects."""

from __future__ import annotations

from typing import Any

from pagedkv.core.errors import InvariantError
from pagedkv.core import CacheConfig, request_blocks
from pagedkv.core.state import KVState
from pagedkv.integrations.vllm.geometry import Unsupported


class ManagerReads:
    """The read-only surface of vLLM's ``KVCacheManager`` over the core's state (module docstring)."""

    block_size: int
    num_kv_cache_groups: int
    empty_kv_cache_blocks: Any
    _blocks_cls: Any
    _block: list[Any]

    config: CacheConfig
    enable_caching: bool
    log_stats: bool
    prefix_cache_stats: Any
    _stats_cls: Any
    _state: KVState
    _flush: Any  # (the queued blocks cached: before a read of the cache)

    @property
    def usage(self) -> float:
        """Blocks in use over usable blocks, as vLLM's block pool reports it (the null block not counted)."""
        usable = self.config.num_blocks - 1
        return (
            1.0 - self._state.free_blocks / usable if usable else 0.0
        )  # (a row's length kept by the manager takes no block)

    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, self._stats_cls()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        if self.prefix_cache_stats is None:
            raise InvariantError("log_stats keeps prefix_cache_stats")
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0
        )

    # -- what the scheduler reads of a request ---------------------------------------------------------------
    def get_blocks(self, request_id: str) -> Any:
        if request_id not in self._state.requests:
            return self.empty_kv_cache_blocks
        block = self._block
        return self._blocks_cls(tuple([block[b] for b in ids] for ids in request_blocks(self._state, request_id)[0]))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if request_id not in self._state.requests:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(list(ids) for ids in request_blocks(self._state, request_id)[0])

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        n = -(-num_computed_tokens // self.block_size)
        return tuple(ids[:n] for ids in self.get_block_ids(request_id))

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request's blocks that are in the prefix cache (vLLM's estimate for its stats)."""
        self._flush()
        req = self._state.requests.get(request.request_id)
        if req is None:
            return 0
        return self._state.rows[req.slots[0]].num_hashed * self.block_size

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> Any:
        return self._blocks_cls(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # -- hooks of features refused at construction: nothing to do, or never reached --------------------------
    def take_new_block_ids(self) -> list[int]:
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def __getattr__(self, name: str) -> Any:
        if name in (
            "coordinator",
            "block_pool",
            "pop_blocks_for_free",
            "evict_blocks",
            "remove_skipped_blocks",
            "truncate_computed_blocks",
            "record_blocks_for_zeroing",
            "finalize_partial_tail_offloads",
            "get_computed_blocks_for_connector",
        ):
            raise Unsupported(
                f"pagedkv's KV cache manager has no {name}: it serves vLLM's scheduler without KV "
                "connectors (refused at construction)"
            )
        raise AttributeError(name)
