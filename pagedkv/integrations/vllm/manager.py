"""pagedkv's pure core as vLLM 0.33's KV cache manager (``vllm.v1.core.kv_cache_manager.KVCacheManager``).

``PagedKVCacheManager`` answers every call vLLM's v1 ``Scheduler`` makes of its manager on the paths it
supports (full attention and sliding-window groups of one block size, prefix caching on or off, events,
stats, the watermark, ``full_sequence_must_fit``), each decision taken by a transition of the core:

=====================================  ===========================================================
vLLM's call                            the core
=====================================  ===========================================================
``get_computed_blocks``                ``find_hit`` (read only, as vLLM's lookup)
``allocate_slots`` (a new request)     ``admit`` of a row holding the hit and the chunk, then
                                       ``cache_ahead`` through the tokens scheduled
``allocate_slots`` (a running one)     ``commit`` of what vLLM counts computed (a window's blocks go),
                                       ``append`` of the chunk's ids, ``cache_ahead``; a decode token
                                       joins the step's one ``decode_step`` (applied before anything
                                       reads the state; one that opens a block at once)
``free``                               ``release`` (finished, aborted, preempted)
``reset_prefix_cache``                 ``reset_prefix_cache`` (refused while blocks are held)
``take_events``                        the core's events as vLLM's ``BlockStored`` / ``BlockRemoved``
=====================================  ===========================================================

The core runs with vLLM's block-pool policies (``free_queue="vllm"``, ``reset_prefix_cache="when_idle"``,
``caching_point="schedule"``) and vLLM's ``sha256_cbor`` block hashes seeded as vLLM seeds them, so block
ids, hits and events are the ones vLLM's own manager gives (tests/test_vllm_manager.py runs both under
vLLM's real scheduler, step by step). Everything else is refused at construction with the reason
(``Unsupported``): Mamba and other group kinds, KV connectors, speculative decoding, context parallelism,
a hash block size other than the block size. ``PagedKVScheduler`` is vLLM's ``Scheduler`` with this
manager installed (``--scheduler-cls pagedkv.integrations.vllm.PagedKVScheduler``).

The ``KVCacheBlock`` objects handed to the scheduler carry block ids only (one per block id, made once);
reference counts, hashes and the free queue live in the core's state (``manager.state``, a value).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache
from typing import Any

from returns.result import Failure

from pagedkv.core import CacheConfig, GroupKind, GroupSpec, RequestSpec, RowSpec, initial_state
from pagedkv.core import admit, append, cache_ahead, cache_ahead_many, commit, decode_step, release, request_blocks
from pagedkv.core import reset_prefix_cache
from pagedkv.core.errors import ErrorCode, KVError
from pagedkv.core.prefix import find_hit
from pagedkv.core.state import KVState
from pagedkv.integrations.vllm.events import to_vllm

DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for a cryptographic hash when PYTHONHASHSEED is unset


class Unsupported(ValueError):
    """A vLLM configuration pagedkv's manager does not serve (raised at construction, never mid-run)."""


class ManagerError(RuntimeError):
    """The core refused what vLLM's scheduler asked, where vLLM's own manager would have done it."""


def _vllm() -> Any:
    try:
        from vllm.v1.core import kv_cache_manager, kv_cache_utils
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    except ImportError as exc:  # the extra is vLLM itself
        raise Unsupported(f"pagedkv's vLLM manager needs vLLM 0.33 installed: {exc}") from None
    return kv_cache_manager, kv_cache_utils, FullAttentionSpec, SlidingWindowSpec


def hash_seed() -> str:
    """The seed vLLM derives ``NONE_HASH`` from for ``sha256_cbor``: PYTHONHASHSEED if set, else its default."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)


class PagedKVCacheManager:
    """vLLM's ``KVCacheManager`` surface over pagedkv's core (module docstring)."""

    def __init__(self, kv_cache_config: Any, max_model_len: int, scheduler_block_size: int, hash_block_size: int,
                 max_in_flight_tokens: int | None = None, enable_caching: bool = True, use_eagle: bool = False,
                 num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, dcp_world_size: int = 1, pcp_world_size: int = 1,
                 metrics_collector: Any = None, watermark: float = 0.0,
                 enable_mamba_shared_prefix_checkpoint: bool = False) -> None:  # fmt: skip
        kvm, utils, full_spec, window_spec = _vllm()
        refused = [why for bad, why in (
            (use_eagle, "EAGLE speculative decoding"),
            (num_hash_lookahead_tokens or num_prefill_lookahead, "lookahead hashing / multi-module MTP prefill"),
            (dcp_world_size != 1 or pcp_world_size != 1, "decode / prefill context parallelism"),
            (metrics_collector is not None, "KV cache residency metrics (--kv-cache-metrics)"),
            (enable_mamba_shared_prefix_checkpoint, "Mamba checkpoints"),
            (hash_block_size != scheduler_block_size, f"a hash block size ({hash_block_size}) other than the "
                                                      f"block size ({scheduler_block_size})"),
        ) if bad]  # fmt: skip
        groups: list[GroupSpec] = []
        caps: list[int | None] = []
        in_flight = max_in_flight_tokens if max_in_flight_tokens is not None else max_model_len
        for i, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if getattr(spec, "block_size", None) != scheduler_block_size:
                refused.append(f"group {i}'s block size {getattr(spec, 'block_size', None)} (pagedkv pools one "
                               f"block size: {scheduler_block_size})")  # fmt: skip
            if type(spec) is full_spec:
                groups.append(GroupSpec(f"g{i}"))
                caps.append(None)
            elif type(spec) is window_spec:
                groups.append(GroupSpec(f"g{i}", GroupKind.SLIDING_WINDOW, window=spec.sliding_window))
                caps.append(spec.max_admission_blocks_per_request(max_in_flight_tokens=in_flight,
                                                                  max_model_len=max_model_len))  # fmt: skip
            else:
                refused.append(f"group {i}'s {type(spec).__name__} (full attention and sliding windows only)")
        if not 0.0 <= watermark < 1.0:
            refused.append(f"watermark {watermark} (must be in [0, 1))")
        if refused:
            raise Unsupported("pagedkv's KV cache manager does not serve " + "; ".join(refused))
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.block_size = scheduler_block_size
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.log_stats = log_stats
        self.use_eagle = False
        self.num_kv_cache_groups = len(groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self._caps = caps
        self._windows = [g.window for g in groups]
        self.config = CacheConfig(block_size=scheduler_block_size, num_blocks=kv_cache_config.num_blocks,
                                  groups=tuple(groups), enable_prefix_caching=enable_caching,
                                  max_model_len=max_model_len, hash_namespace=hash_seed(), free_queue="vllm",
                                  reset_prefix_cache="when_idle", caching_point="schedule",
                                  block_hash="sha256_cbor", cache_duplicates=True)  # fmt: skip
        self._state: KVState = initial_state(self.config)
        # decode tokens that go into a request's open block, queued and applied as one decode_step before
        # anything reads the state (they allocate, free and evict nothing, so nothing else sees them first)
        self._len: dict[str, int] = {}  # each request's row length, queued tokens included
        self._fast = all(g.kind is GroupKind.FULL for g in groups)  # windows let blocks go at each commit
        self._queue_ids: list[str] = []
        self._queue_tokens: list[int] = []
        self._queue_full: list[tuple[str, list[int]]] = []  # (request, [length]) whose token fills its block
        self._places: list[_Stored] = []  # where each one's events go in the stream
        self._events: list[Any] = []  # pagedkv.integrations.vllm.events structs, in order
        self._blocks_cls = kvm.KVCacheBlocks
        self._block = [utils.KVCacheBlock(i) for i in range(kv_cache_config.num_blocks)]
        self._block[0].is_null = True
        self.empty_kv_cache_blocks = kvm.KVCacheBlocks(tuple(() for _ in groups))
        from vllm.v1.metrics.stats import PrefixCacheStats

        self._stats_cls = PrefixCacheStats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        from vllm.distributed import kv_events

        self._vllm_events = kv_events
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()

    # -- the state the scheduler reads ---------------------------------------------------------------------
    @property
    def state(self) -> KVState:
        """The core's state, every queued decode token applied (a value: keep it, replay from it)."""
        if self._queue_ids:
            self._flush()
        return self._state

    @property
    def usage(self) -> float:
        """Blocks in use over usable blocks, as vLLM's block pool reports it (the null block not counted)."""
        usable = self.config.num_blocks - 1
        return 1.0 - self._state.num_free / usable if usable else 0.0  # (queued tokens take no block)

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
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)  # fmt: skip

    # -- lookup and allocation -------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None) -> tuple[Any, int, int]:
        """The longest prefix hit (whole blocks, at most ``num_tokens - 1`` tokens): its blocks and tokens."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        cap = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        if cap < self.block_size:
            return self.empty_kv_cache_blocks, 0, 0
        hit = find_hit(self.state, RequestSpec(request.request_id, (RowSpec.of_tokens(request.all_token_ids),),
                                               self._extra(request), max_hit=cap))  # fmt: skip
        if not hit.num_blocks:
            return self.empty_kv_cache_blocks, 0, 0
        block = self._block
        return self._blocks_cls(tuple([block[b] for b in ids] for ids in hit.ids[0])), hit.num_blocks * self.block_size, 0

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True, skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:  # fmt: skip
        """Slots for ``num_new_tokens`` more tokens (after the hit, for a new request); the new blocks, or
        None when the pool cannot hold them (nothing then changes but a window's blocks let go)."""
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        if num_lookahead_tokens or num_external_computed_tokens or delay_cache_blocks or num_encoder_tokens:
            raise Unsupported("pagedkv's KV cache manager allocates no lookahead, external (connector) or encoder "
                              "slots; the scheduler was built with a feature it refuses")  # fmt: skip
        rid = request.request_id
        n = self._len.get(rid)
        if (n is not None and self._fast and num_new_tokens == 1 and not num_new_computed_tokens
                and request.num_computed_tokens == n and n < self.max_model_len):  # fmt: skip
            # a decode: its row committed through n, its token appended, in the step's one decode batch
            token = request.all_token_ids[n]
            fills = (n + 1) % self.block_size == 0 and self.enable_caching  # vLLM caches the block it fills now
            if n % self.block_size:  # into the open block: nothing taken or freed, nothing anyone sees yet
                self._queue_ids.append(rid)
                self._queue_tokens.append(token)
                self._len[rid] = n + 1
                if fills:
                    place = _Stored()  # its events' place in the stream, filled in when the batch is applied
                    self._events.append(place)
                    self._queue_full.append((rid, [n + 1]))
                    self._places.append(place)
                return self.empty_kv_cache_blocks
            if self._state.num_free - reserved_blocks < self.num_kv_cache_groups:
                return None  # (queued tokens take no block: the free count is the state's)
            # a block taken now, apart from the queued ones (they neither take nor free a block)
            self._apply(decode_step(self._state, [rid], [token]), "decode")
            self._len[rid] = n + 1
            if fills:  # (a block of one token)
                self._apply(cache_ahead(self._state, rid, [n + 1]), "cache_ahead")
            block = self._block
            return self._blocks_cls(tuple([block[ids[-1]]] for ids in request_blocks(self._state, rid)[0]))
        state = self.state
        req = state.requests.get(rid)
        computed = request.num_computed_tokens + num_new_computed_tokens
        total = min(computed, self.max_model_len)
        need_slot = min(total + num_new_tokens, self.max_model_len)
        cache_through = min(total + num_new_tokens, request.num_tokens)
        if req is None:  # a new (or resumed) request: admitted with its hit
            watermark = self.watermark_blocks if has_scheduled_reqs and _waiting(request) else 0
            hit_ids = new_computed_blocks.get_block_ids() if new_computed_blocks is not None else ((),) * len(self._caps)
            if full_sequence_must_fit:
                full = min(request.num_tokens, self.max_model_len)
                if self._blocks_to_admit(full, total, hit_ids, capped=True) + watermark > state.num_free:
                    return None
            if self._blocks_to_admit(need_slot, total, hit_ids, capped=False) + watermark > state.num_free - reserved_blocks:
                return None
            spec = RequestSpec(rid, (RowSpec.of_tokens(request.all_token_ids[:need_slot]),), self._extra(request),
                               max_hit=num_new_computed_tokens if self.prefix_cache_lookup_enabled(request) else 0)
            step = self._apply(admit(state, spec), "admit")
            if step.effect.cached_tokens[0] != num_new_computed_tokens:
                raise ManagerError(f"request {rid!r}: the core's hit is {step.effect.cached_tokens[0]} tokens, the "
                                   f"scheduler's {num_new_computed_tokens}")  # fmt: skip
            before: Sequence[Sequence[int]] = hit_ids
        else:
            slot = req.slots[0]
            if computed > state.row_computed[slot]:  # what vLLM counts computed: a window lets its blocks go
                state = self._apply(commit(state, rid, [computed]), "commit").state
            before = request_blocks(state, rid)[0]
            need = sum(max(-(-need_slot // self.block_size) - len(ids), 0) for ids in before)
            if need > state.num_free - reserved_blocks:  # (counting what the window let go)
                return None
            length = state.row_len[slot]
            if need_slot > length:
                state = self._apply(append(state, rid, [request.all_token_ids[length:need_slot]]), "append").state
        state = self._state
        slot = state.requests[rid].slots[0]
        self._len[rid] = state.row_len[slot]
        if self.enable_caching and cache_through > state.row_computed[slot]:
            self._apply(cache_ahead(state, rid, [cache_through]), "cache_ahead")
        after = request_blocks(self._state, rid)[0]
        block = self._block
        new = tuple([block[b] for b in ids[len(old):]] for ids, old in zip(after, before))
        return self._blocks_cls(new) if any(new) else self.empty_kv_cache_blocks

    def _blocks_to_admit(self, num_tokens: int, computed: int, hit_ids: Sequence[Sequence[int]], capped: bool) -> int:
        """vLLM's count of the blocks a new request takes for ``num_tokens`` slots with its hit: fresh blocks
        past the hit (a window's admission capped, where ``capped``) and each hit block no one holds."""
        bs, refcount = self.block_size, self.state.refcount
        total = 0
        for ids, window, cap in zip(hit_ids, self._windows, self._caps):
            required = -(-num_tokens // bs)
            if capped and cap is not None:
                required = min(required, cap)
            skipped = max(0, computed - window + 1) // bs if window else 0
            total += max(required - max(skipped, len(ids)), 0)
            total += sum(1 for b in ids[skipped:] if b and refcount[b] == 0)
        return total

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        req = self.state.requests.get(request.request_id)
        if req is None:
            return
        slot = req.slots[0]
        through = min(num_computed_tokens, self.state.row_len[slot])
        if through > self.state.row_computed[slot]:
            self._apply(cache_ahead(self.state, request.request_id, [through]), "cache_ahead")

    def free(self, request: Any) -> None:
        """The request's blocks go back (tail first, group by group), its cached blocks stay cached."""
        if request.request_id not in self.state.requests:
            return
        del self._len[request.request_id]
        self._apply(release(self._state, request.request_id, _reason(request)), "release")

    def reset_prefix_cache(self) -> bool:
        result = reset_prefix_cache(self.state)
        if isinstance(result, Failure):
            err = result.failure()
            if err.code is ErrorCode.BLOCKS_IN_USE:
                return False
            raise ManagerError(f"reset_prefix_cache: {err.code.value}: {err.message}")
        self._take(result.unwrap())
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    # -- what the scheduler reads of a request ---------------------------------------------------------------
    def get_blocks(self, request_id: str) -> Any:
        if request_id not in self.state.requests:
            return self.empty_kv_cache_blocks
        block = self._block
        return self._blocks_cls(tuple([block[b] for b in ids] for ids in request_blocks(self.state, request_id)[0]))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if request_id not in self.state.requests:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(list(ids) for ids in request_blocks(self.state, request_id)[0])

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        n = -(-num_computed_tokens // self.block_size)
        return tuple(ids[:n] for ids in self.get_block_ids(request_id))

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request's blocks that are in the prefix cache (vLLM's estimate for its stats)."""
        req = self.state.requests.get(request.request_id)
        if req is None:
            return 0
        return self.state.rows[req.slots[0]].num_hashed * self.block_size

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> Any:
        return self._blocks_cls(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def take_events(self) -> list[Any]:
        """The KV events since the last call, as vLLM's own event objects (as its block pool sends them)."""
        if self._queue_ids:
            self._flush()
        if not self._events:
            return []
        events, self._events = self._events, []
        ev = self._vllm_events
        out = []
        for e in [x for e in events for x in (e.events if isinstance(e, _Stored) else (e,))]:
            if type(e).__name__ == "BlockStored":
                out.append(ev.BlockStored(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                                          token_ids=e.token_ids, block_size=e.block_size, lora_id=None,
                                          medium=e.medium, lora_name=None, extra_keys=[None] * len(e.block_hashes),
                                          group_idx=e.group_idx, kv_cache_spec_kind=e.kv_cache_spec_kind,
                                          kv_cache_spec_sliding_window=e.kv_cache_spec_sliding_window))  # fmt: skip
            elif type(e).__name__ == "BlockRemoved":
                out.append(ev.BlockRemoved(block_hashes=e.block_hashes, medium=e.medium, group_idx=e.group_idx))
            else:
                out.append(ev.AllBlocksCleared())
        return out

    # -- hooks of features refused at construction: nothing to do, or never reached --------------------------
    def new_step_starts(self) -> None:
        return None

    def take_new_block_ids(self) -> list[int]:
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def __getattr__(self, name: str) -> Any:
        if name in ("coordinator", "block_pool", "pop_blocks_for_free", "evict_blocks", "remove_skipped_blocks",
                    "truncate_computed_blocks", "record_blocks_for_zeroing", "finalize_partial_tail_offloads",
                    "get_computed_blocks_for_connector"):  # fmt: skip
            raise Unsupported(f"pagedkv's KV cache manager has no {name}: it serves vLLM's scheduler without KV "
                              "connectors, Mamba groups or speculative decoding (refused at construction)")  # fmt: skip
        raise AttributeError(name)

    # -- the core's steps ------------------------------------------------------------------------------------
    def _apply(self, result: Any, what: str) -> Any:
        if isinstance(result, Failure):
            err: KVError = result.failure()
            raise ManagerError(f"the core refused {what}: {err.code.value}: {err.message}")
        step = result.unwrap()
        self._take(step)
        return step

    def _flush(self) -> None:
        """The queued decode tokens as one transition (each row committed through its length, its token
        appended), then the blocks they filled cached, as vLLM caches them when it allocates."""
        self._apply(decode_step(self._state, self._queue_ids, self._queue_tokens), "the decode batch")
        if self._queue_full:
            result = cache_ahead_many(self._state, self._queue_full)
            if isinstance(result, Failure):
                raise ManagerError(f"the core refused cache_ahead: {result.failure().message}")
            step = result.unwrap()
            self._state = step.state
            for place, effect in zip(self._places, step.effect):
                place.events = to_vllm(effect.events, self.config) if self.enable_kv_cache_events else []
            self._places.clear()
        self._queue_ids.clear()
        self._queue_tokens.clear()
        self._queue_full.clear()

    def _take(self, step: Any) -> None:
        self._state = step.state
        if self.enable_kv_cache_events:  # one request's stores group by group, as vLLM's pool sends them
            if isinstance(step.effect, tuple):  # a batch: each request's apart
                for effect in step.effect:
                    if effect.events:
                        self._events.extend(to_vllm(effect.events, self.config))
            elif step.effect.events:
                self._events.extend(to_vllm(step.effect.events, self.config))

    @staticmethod
    def _extra(request: Any) -> tuple[str, ...]:
        """What else decides a block's content: the LoRA adapter and the cache salt (multimodal inputs and
        prompt embeddings are refused)."""
        if request.mm_features or request.prompt_embeds is not None:
            raise Unsupported(f"request {request.request_id!r}: multimodal inputs and prompt embeddings are not "
                              "served by pagedkv's KV cache manager")  # fmt: skip
        keys = []
        if request.lora_request:
            keys.append(f"lora:{request.lora_request.lora_name}:{request.lora_request.lora_path}")
        if request.cache_salt:
            keys.append(f"cache_salt:{request.cache_salt}")
        return tuple(keys)


class _Stored:
    """The place in the event stream of a queued decode token's filled block (its BlockStored)."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: list[Any] = []


def _waiting(request: Any) -> bool:
    status = _vllm_request().RequestStatus
    return request.status in (status.WAITING, status.PREEMPTED)


def _reason(request: Any) -> str:
    status = _vllm_request().RequestStatus
    if request.status == status.FINISHED_ABORTED:
        return "cancelled"
    if status.is_finished(request.status):
        return "finished"
    return "preempted"


@cache
def _vllm_request() -> Any:
    import vllm.v1.request  # (looked up once: the manager exists only where vLLM does)

    return vllm.v1.request
