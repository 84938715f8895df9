"""pagedkv's pure core as vLLM's KV cache manager (``vllm.v1.core.kv_cache_manager.KVCacheManager``), for vLLM 0.33 and
0.34 alike (``version``: each call with the installed release's meaning).

``PagedKVCacheManager`` answers every call vLLM's v1 ``Scheduler`` makes of its manager, each decision a
transition of the core (docs/vllm.md has the table): a lookup is ``find_hit``; a new request's allocation
``admit`` (keeping the watermark and the reserve back) then ``cache_ahead``; a running one's ``fill`` (the
ids that came back), ``commit`` (a window lets blocks go), ``append``, ``cache_ahead``; ``free`` is
``release``. Every call is all or nothing: its transitions run in a ``stream.Transaction`` on a value of the
state, kept only when the call completes; a refusal leaves the manager as it was and answers as vLLM (None
when short; ``ManagerError`` where vLLM's manager would have done what the core refused).

In a pool without windows a running request's call is cut to what moves blocks: the manager keeps each row
as vLLM sees it and tells the core what opens a block and what fills one in a queued batch (the section on
rows below). One class, in one file: its sections are what vLLM reads, the rows, and the Mamba
states cached in a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from returns.result import Failure

from pagedkv.core import (
    Placeholders,
    RequestSpec,
    RowSpec,
    admit,
    append,
    append_many,
    cache_ahead,
    cache_ahead_many,
    commit,
    fill,
    fill_many,
    initial_state,
    release,
    request_blocks,
    reset_prefix_cache,
)
from pagedkv.core.errors import ErrorCode, InvariantError, KVError
from pagedkv.core.outputs.effects import events_of
from pagedkv.core.rules.prefix import find_hit
from pagedkv.core.store.state import KVState, row_known
from pagedkv.integrations.vllm.geometry import translate, vllm_modules
from pagedkv.integrations.vllm.version import Unsupported
from pagedkv.integrations.vllm.requests import (
    RefusedRequest,
    block_keys,
    event_fields,
    hit_limit,
    is_waiting,
    reads_cache,
    release_reason,
    token_ids,
)
from pagedkv.integrations.vllm.stream import EventStream, ManagerError, Refused, Transaction


class PagedKVCacheManager:
    """vLLM's ``KVCacheManager`` surface over pagedkv's core (module docstring)."""

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        hash_algo: str = "sha256",
    ) -> None:
        kvm = vllm_modules()[0]
        refused = [
            why
            for bad, why in (
                (
                    num_prefill_lookahead > 1,
                    f"a prefill lookahead of {num_prefill_lookahead} tokens (multi-module MTP: "
                    "its last chunk's tokens are prefilled again)",
                ),
                (use_eagle and num_hash_lookahead_tokens, "EAGLE's block drop with lookahead hashes"),
                (dcp_world_size != 1 or pcp_world_size != 1, "decode / prefill context parallelism"),
                (enable_mamba_shared_prefix_checkpoint, "Mamba checkpoints"),
                (
                    hash_block_size != scheduler_block_size,
                    f"a hash block size ({hash_block_size}) other than the block size ({scheduler_block_size})",
                ),
                (not 0.0 <= watermark < 1.0, f"watermark {watermark} (must be in [0, 1))"),
            )
            if bad
        ]
        geometry = translate(
            kv_cache_config,
            max_model_len=max_model_len,
            block_size=scheduler_block_size,
            in_flight=max_in_flight_tokens if max_in_flight_tokens is not None else max_model_len,
            caching=enable_caching,
            hash_algo=hash_algo,
            hash_lookahead=num_hash_lookahead_tokens,
            kv_events=enable_kv_cache_events,
            refused=refused,
        )
        self.geometry = geometry
        self.config = geometry.config
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.block_size = scheduler_block_size
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.log_stats = log_stats
        self.use_eagle = use_eagle  # EAGLE's block drop: a hit matches one block past it and gives it back
        self.num_kv_cache_groups = len(geometry.caps)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.metrics_collector = metrics_collector
        self._state: KVState = initial_state(self.config)
        self._stream = EventStream(
            self.config,
            enable_kv_cache_events,
            caching=enable_caching,
            metrics=metrics_collector,
            blocks=kv_cache_config.num_blocks,
        )
        # each admitted request's row as vLLM sees it: its length (the core's may lag inside the open block), the
        # blocks of it the core has hashed, and the request (its ids, for the core's row to catch up)
        self._len: dict[str, int] = {}
        self._hashed: dict[str, int] = {}
        self._requests: dict[str, Any] = {}
        # each request's ids and vLLM's hashes as tuples, made once while they stay the same: (tokens, ids, hashes)
        self._seen: dict[str, tuple[int, Sequence[int] | None, tuple[bytes, ...] | None]] = {}
        # (a window, or an align-mode Mamba group, lets blocks go at each commit: every call is applied)
        self._lag = not any(geometry.windows) and not any(geometry.aligned)
        self._aligned = [g for g, a in enumerate(geometry.aligned) if a]
        self._cached_now: set[tuple[int, bytes]] = set()  # Mamba states cached this step: (group, hash)
        self._queue: list[tuple[Any, int, int, Any]] = []  # blocks to cache: (request, through, known tokens, place)
        self._queued: set[str] = set()  # the requests in it
        # rows that opened blocks, in order: (request, its known tokens then, its length, the blocks handed out, place);
        # their blocks, read off the free queue's head, are the ones the core's pops will give (one group, no host tier)
        self._opening: list[tuple[Any, int, int, tuple[int, ...], Any]] = []
        self._opened: set[str] = set()  # the requests in it
        self._ahead = 0  # the blocks handed out ahead of the core's pops
        self._defer = self.config.opening_blocks == 1 and len(self.config.rules) == 1 and not self.config.host_blocks
        self._blocks_cls = kvm.KVCacheBlocks
        self._block = self._stream.blocks
        self.empty_kv_cache_blocks = kvm.KVCacheBlocks(tuple(() for _ in geometry.caps))
        from vllm.v1.metrics.stats import PrefixCacheStats

        self._stats_cls = PrefixCacheStats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()

    # -- lookup and allocation -------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None) -> tuple[Any, int, int]:
        """The longest prefix hit (whole blocks, at most ``num_tokens - 1`` tokens): its blocks and tokens; with
        ``kv_cache_report_mode="full"`` the hit's blocks are announced again (``BlockStored``), as vLLM does."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        cap = hit_limit(request, max_cache_hit_length)  # (vLLM 0.34's limit, prompt logprobs' start, or 0.33's)
        if cap < self.block_size:
            return self.empty_kv_cache_blocks, 0, 0
        self._flush()
        spec = self._spec(request, self._ids(request), cap)
        hit = find_hit(self._state, spec, drop_last_block=self.use_eagle)
        # (vLLM's shared-prefix boundary: where the full groups' hit ends, when a window or state group cut it)
        junction = hit.full_blocks * self.block_size if hit.full_blocks > hit.num_blocks else 0
        if not hit.num_blocks:
            return self.empty_kv_cache_blocks, 0, junction
        if self.enable_kv_cache_events and getattr(request, "kv_cache_report_mode", "incremental") == "full":
            self._stream.announce(hit, spec, event_fields(request))
        block = self._block
        return (
            self._blocks_cls(tuple([block[b] for b in ids] for ids in hit.ids[0])),
            hit.num_blocks * self.block_size,
            junction,
        )

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        """Slots for ``num_new_tokens`` more tokens (after the hit, for a new request): the new blocks, or None
        when the pool cannot hold them (nothing then changes but a window's blocks let go, as in vLLM)."""
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        if num_external_computed_tokens or delay_cache_blocks or num_encoder_tokens:
            raise Unsupported(
                "pagedkv's KV cache manager allocates no external (connector) or encoder slots; the "
                "scheduler was built with a feature it refuses"
            )
        rid = request.request_id
        n = self._len.get(rid)
        if n is not None and self._lag and not num_new_computed_tokens:
            return self._running(request, n, num_new_tokens + num_lookahead_tokens, num_new_tokens, reserved_blocks)
        self._flush()  # (an admission reads the cache, a window's commit frees blocks)
        txn = Transaction(self._state)
        try:
            new = self._allocate(
                txn,
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                full_sequence_must_fit,
                reserved_blocks,
                has_scheduled_reqs,
            )
        except Refused as r:
            raise r.manager_error() from None
        self._state = self._stream.keep(txn, request)
        if new is None:
            return None
        self._mirror(request)
        return self._blocks_cls(new) if any(new) else self.empty_kv_cache_blocks

    def _allocate(
        self,
        txn: Transaction,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: Any,
        num_lookahead_tokens: int,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> tuple[list[Any], ...] | None:
        """``allocate_slots``' transitions on ``txn``: the new blocks per group, or None when they do not fit.

        Slots past the request's known tokens (a step scheduled before the last one's tokens came back, draft
        and lookahead slots) grow the row by placeholders; their ids are filled in as they arrive, and only
        then can the blocks they complete be cached. Rejected drafts are not cut back: as vLLM's manager
        does, the row keeps its slots, and positions past the accepted tokens take their ids again later."""
        rid = request.request_id
        req = txn.state.requests.get(rid)
        computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        need_slot = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if req is None:  # a new (or resumed) request: admitted with its hit
            before = self._admit(
                txn,
                request,
                computed,
                need_slot,
                num_new_computed_tokens,
                new_computed_blocks,
                full_sequence_must_fit,
                reserved_blocks,
                has_scheduled_reqs,
            )
        else:
            before = self._extend(txn, request, req.slots[0], computed, need_slot, reserved_blocks)
        if before is None:
            return None
        slot = txn.state.requests[rid].slots[0]
        through = min(computed + num_new_tokens, request.num_tokens, txn.state.row_len[slot])
        if self.enable_caching and through > txn.state.row_computed[slot]:
            self._cache_ahead(txn, request, slot, through)
        block = self._block
        # (an align-mode Mamba group's new positions go out with the null block between its states, as vLLM's)
        new = [
            list(ids[len(old) :]) if aligned else [b for b in ids[len(old) :] if b]
            for ids, old, aligned in zip(request_blocks(txn.state, rid)[0], before, self.geometry.aligned)
        ]
        txn.allocated = [b for ids in new for b in ids if b]  # popped from the free queue, group by group
        return tuple([block[b] for b in ids] for ids in new)

    def _admit(
        self,
        txn: Transaction,
        request: Any,
        computed: int,
        need_slot: int,
        num_new_computed_tokens: int,
        new_computed_blocks: Any,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> tuple[tuple[int, ...], ...] | None:
        """A new (or resumed) request admitted with its hit: the hit's blocks per group, or None when it waits.
        One longer than ``max_model_len`` is refused, nothing allocated: vLLM's own manager would hold it a row
        cut at ``max_model_len`` that its scheduler then computes past (vLLM's input processing refuses such a
        prompt before it is scheduled, so no vLLM run sends one)."""
        rid = request.request_id
        if request.num_tokens > self.max_model_len:
            raise Refused(
                "admit",
                KVError(
                    ErrorCode.UNSCHEDULABLE,
                    f"request {rid!r} has {request.num_tokens} tokens, "
                    f"over max_model_len {self.max_model_len}; nothing was allocated",
                ),
            )
        watermark = self.watermark_blocks if has_scheduled_reqs and is_waiting(request) else 0
        if full_sequence_must_fit:  # (first: a request that waits for blocks is turned away before its spec is made)
            full = min(request.num_tokens, self.max_model_len)
            hit_ids = new_computed_blocks.get_block_ids() if new_computed_blocks is not None else ()
            if self.geometry.capped_need(txn.state, full, computed, hit_ids) + watermark > txn.state.free_blocks:
                return None
        lookup = self.prefix_cache_lookup_enabled(request)
        known = min(need_slot, request.num_tokens)  # slots past the tokens (draft padding, lookahead slots)
        spec = self._spec(
            request, self._ids(request, known), num_new_computed_tokens if lookup else 0, need_slot - known
        )
        if self._aligned and num_new_computed_tokens and self._state_cached_now(txn.state, spec):
            return None  # (vLLM's MambaManager: a state cached this step is written by this step's forward)
        admitted = admit(txn.state, spec, reserve=watermark + reserved_blocks)
        if isinstance(admitted, Failure) and admitted.failure().code is ErrorCode.NO_CAPACITY:
            return None
        step = txn.apply(admitted, "admit")
        if step.effect.cached_tokens[0] != num_new_computed_tokens:
            raise Refused(
                "admit",
                KVError(
                    ErrorCode.INVALID,
                    f"request {rid!r}: the core's hit is "
                    f"{step.effect.cached_tokens[0]} tokens, the scheduler's {num_new_computed_tokens}",
                ),
            )
        before: tuple[tuple[int, ...], ...] = tuple(
            ids[: step.effect.cached_tokens[0] // self.block_size] for ids in step.effect.blocks[0]
        )
        txn.touched = [b for ids in before for b in ids if b]  # the hit, group by group
        return before

    def _extend(
        self, txn: Transaction, request: Any, slot: int, computed: int, need_slot: int, reserved_blocks: int
    ) -> tuple[tuple[int, ...], ...] | None:
        """A running request: what its processed steps computed committed, its row grown to ``need_slot``; its
        blocks before the growth, or None when the pool cannot hold it."""
        rid = request.request_id
        self._catch_up(txn, request, slot)
        # what the scheduler's processed steps computed (steps in flight, rejected drafts not counted): a
        # window lets its blocks go on that basis, as vLLM's does
        done = max(computed - request.num_in_flight_tokens, 0)
        if done > txn.state.row_computed[slot]:
            txn.apply(commit(txn.state, rid, [done]), "commit")
        before = request_blocks(txn.state, rid)[0]
        if self.geometry.growth_need(before, need_slot) > txn.state.free_blocks - reserved_blocks:
            return None  # (counting what the window let go)
        length = txn.state.row_len[slot]
        if need_slot > length and not self._grow(txn, request, need_slot):
            return None
        return before

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        n = self._len.get(rid)
        if n is None:
            return
        if self._lag:
            self._to_cache(request, min(num_computed_tokens, n))
            return
        if self._full_blocks(request, min(num_computed_tokens, n)) <= self._hashed[rid]:
            return  # (no block to cache: nothing to apply)
        slot = self._state.requests[rid].slots[0]
        txn = Transaction(self._state)
        try:
            self._catch_up(txn, request, slot)  # (the tokens a step late, the accepted drafts)
            through = min(num_computed_tokens, txn.state.row_len[slot])
            if through > txn.state.row_computed[slot]:
                self._cache_ahead(txn, request, slot, through)
        except Refused as r:
            raise r.manager_error() from None
        self._state = self._stream.keep(txn, request)
        self._mirror(request)

    def free(self, request: Any) -> None:
        """The request's blocks go back (tail first, group by group), its cached blocks stay cached."""
        rid = request.request_id
        if rid in self._queued or self._opening:  # (its blocks cached before they go back, the openings' pops made
            self._flush()  # before a free moves the free queue's head; others' caching commutes with the frees)
        if rid in self._state.requests:
            txn = Transaction(self._state)
            try:
                txn.apply(release(self._state, rid, release_reason(request)), "release")
            except Refused as r:
                raise r.manager_error() from None
            self._state = self._stream.keep(txn, request)
        self._len.pop(rid, None)
        self._hashed.pop(rid, None)
        self._requests.pop(rid, None)
        self._seen.pop(rid, None)

    def reset_prefix_cache(self) -> bool:
        self._flush()
        result = reset_prefix_cache(self._state)
        if isinstance(result, Failure):
            err = result.failure()
            if err.code is ErrorCode.BLOCKS_IN_USE:
                return False
            raise ManagerError(f"reset_prefix_cache: {err.code.value}: {err.message}")
        txn = Transaction(self._state)
        txn.apply(result, "reset_prefix_cache")
        self._state = self._stream.keep(txn, None)
        self._stream.reset_metrics()
        if self.log_stats:
            if self.prefix_cache_stats is None:
                raise InvariantError("log_stats keeps prefix_cache_stats")
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[Any]:
        """The KV events since the last call, as vLLM's own event objects (as its block pool sends them)."""
        self._flush()
        return self._stream.take()

    # -- the core's steps ------------------------------------------------------------------------------------

    def _spec(self, request: Any, tokens: Any, max_hit: int | None, placeholders: int = 0) -> RequestSpec:
        """The core's spec of a vLLM request's row: its tokens (then the slots whose ids are not known yet) and
        the keys its blocks hash (vLLM's)."""
        try:
            every, content, first = block_keys(request)
        except RefusedRequest as e:
            raise Unsupported(str(e)) from None
        row = RowSpec.of_tokens(tokens, placeholders=placeholders)
        given = self._hashes(request)  # (vLLM hashed the full blocks already: the core takes its hashes)
        return RequestSpec(request.request_id, (row,), every, max_hit, first, content, given)

    def _ids(self, request: Any, upto: int | None = None) -> Sequence[int]:
        """The request's first ``upto`` token ids (all of them by default) as an ``array("Q")`` (which the core takes
        with no per-id check and packs at C speed), made once while its tokens stay the same (a request waiting for
        blocks is looked up and tried at every step)."""
        rid, n = request.request_id, request.num_tokens
        got = self._seen.get(rid)
        if got is None or got[0] != n or got[1] is None:
            got = (n, token_ids(request), got[2] if got is not None and got[0] == n else None)
            self._seen[rid] = got
        ids: Sequence[int] = got[1]  # type: ignore[assignment]
        return ids if upto is None or upto >= n else ids[:upto]

    def _hashes(self, request: Any) -> tuple[bytes, ...]:
        """vLLM's block hashes of the request as a tuple, made once while they stay the same."""
        rid, hashes = request.request_id, request.block_hashes
        got = self._seen.get(rid)
        if got is not None and got[2] is not None and len(got[2]) == len(hashes):
            return got[2]
        made = tuple(hashes)
        self._seen[rid] = (got[0], got[1], made) if got is not None else (-1, None, made)
        return made

    # -- what vLLM reads of the manager besides its decisions -----------------------------------------------------
    # What vLLM's scheduler reads of pagedkv's manager besides its decisions: a request's blocks and ids, the
    # cached-token estimate, usage and prefix-cache stats, and the hooks of features refused at construction (nothing to do, or never
    # reached). It reads the core's blocks and cache (never behind: only a row's length
    # inside its open block may be) and the block objects.

    @property
    def usage(self) -> float:
        """Blocks in use over usable blocks, as vLLM's block pool reports it (the null block not counted)."""
        usable = self.config.num_blocks - 1
        return (
            1.0 - (self._state.free_blocks - self._ahead) / usable if usable else 0.0
        )  # (a row's length kept by the manager takes no block; the blocks handed out ahead do)

    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, self._stats_cls()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and reads_cache(request)

    def get_num_cached_tokens(self, request: Any) -> int:
        """vLLM 0.34's cache-aware admission probe: the request's tokens a hit would hold now (the last one always
        recomputed, as vLLM's probe: its hit limit is not applied), taking no reference and making no event."""
        if not self.prefix_cache_lookup_enabled(request) or request.num_tokens - 1 < self.block_size:
            return 0
        self._flush()  # (the blocks queued to be cached: they are in the cache a lookup reads)
        spec = self._spec(request, self._ids(request), request.num_tokens - 1)
        return find_hit(self._state, spec, drop_last_block=self.use_eagle).num_blocks * self.block_size

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
        if request_id in self._opened:
            self._flush()
        if request_id not in self._state.requests:
            return self.empty_kv_cache_blocks
        block = self._block
        return self._blocks_cls(tuple([block[b] for b in ids] for ids in request_blocks(self._state, request_id)[0]))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if request_id in self._opened:
            self._flush()
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

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:  # (vLLM 0.33's scheduler only)
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

    # -- the rows as vLLM sees them, and what of them the core is told when ---------------------------------------
    # The rows of pagedkv's vLLM manager as vLLM sees them, and what of them the core is told when.
    #
    # In a pool without windows a running request's call is cut to what moves blocks (``_running``).
    # Slots inside a row's open block take none: the manager keeps the row's length itself (``_len``). A call that
    # opens a block answers with the blocks the core's pop will give (in a pool of one group without a host tier:
    # the free queue's next ones, read off its head, ``_ahead_blocks``) and is queued; elsewhere its ``append`` is
    # applied at once. A block to cache is queued too. Each queued call holds its place in the event stream, and
    # the queue is applied as one batch (``_flush``: the openings' growth in their order, each pop checked against
    # what was handed out, the other rows' catch-up, ``fill`` of the ids each call knew, ``cache_ahead``) before
    # anything reads the cache or the free queue or frees blocks: vLLM keeps every block that fills (duplicate
    # contents too), so caching a block in use commutes with the pops of other rows between.
    # A window lets blocks go at each commit: there every call is applied as it comes (``_catch_up``, ``_grow``).

    @property
    def state(self) -> KVState:
        """The core's state, every row at the length vLLM sees (a value: keep it, replay from it)."""
        self._flush()
        behind = [rid for rid, n in self._len.items() if n != self._state.row_len[self._state.requests[rid].slots[0]]]
        if behind:
            txn = Transaction(self._state)
            try:
                for rid in behind:
                    self._catch_up(txn, self._requests[rid], txn.state.requests[rid].slots[0])
            except Refused as r:  # (each growth was checked when vLLM asked for it: a bug)
                raise r.manager_error() from None
            self._state = self._stream.keep(txn, None)
        return self._state

    def _running(self, request: Any, n: int, slots: int, num_new_tokens: int, reserved_blocks: int) -> Any:
        """A running request's slots in a pool without windows (module docstring): the blocks its row opens,
        at once; the blocks it fills, queued to be cached."""
        rid = request.request_id
        computed = min(request.num_computed_tokens, self.max_model_len)
        length = max(min(computed + slots, self.max_model_len), n)
        bs, state = self.block_size, self._state
        opens = -(-length // bs) - -(-n // bs)
        if opens * self.num_kv_cache_groups > state.free_blocks - self._ahead - reserved_blocks:
            return None  # (as vLLM: even a call that takes no block, when the reserve is short)
        new = self.empty_kv_cache_blocks
        if opens and self._defer:
            if rid in self._opened:  # (a second growth in one batch: the first one's applied)
                self._flush()
                state = self._state
            blocks = self._ahead_blocks(opens)
            self._stream.allocated(blocks)
            self._opened.add(rid)
            self._opening.append((request, request.num_tokens, length, blocks, self._stream.hold_place()))
            block = self._block
            new = self._blocks_cls(([block[b] for b in blocks],))
        elif opens:
            slot = state.requests[rid].slots[0]
            txn = Transaction(state)
            try:
                txn.apply(
                    append(state, rid, [self._growth(request, request.num_tokens, state, slot, length)]), "append"
                )
            except Refused as r:
                raise r.manager_error() from None
            opened = [ids[-opens:] for ids in request_blocks(txn.state, rid)[0]]
            txn.allocated = [b for ids in opened for b in ids]
            self._state = self._stream.keep(txn, request)
            block = self._block
            new = self._blocks_cls(tuple([block[b] for b in ids] for ids in opened))
        self._len[rid] = length
        through = min(computed + num_new_tokens, length)
        if self.enable_caching and through // bs > self._hashed[rid]:  # (a decode inside its block: nothing to cache)
            self._to_cache(request, through)
        return new

    def _growth(self, request: Any, known: int, state: KVState, slot: int, target: int) -> Any:
        """The core's row's growth to ``target`` positions: the request's first ``known`` ids, where they
        cover it and follow the row's known ones, else placeholders (their ids filled when a block they
        complete is cached); a count without caching."""
        length = state.row_len[slot]
        if not self.enable_caching:
            return target - length
        if target <= known and row_known(state, slot) == length:
            return token_ids(request, length, target)
        return Placeholders(target - length)

    def _ahead_blocks(self, k: int) -> tuple[int, ...]:
        """The next ``k`` blocks the core's pops will give, after those handed out ahead: the free queue from its
        head (nothing else pops or frees while openings wait: every other call applies them first)."""
        after = self._state.free_next.values()
        b = after[self._opening[-1][3][-1]] if self._opening else after[0]
        out = []
        for _ in range(k):
            out.append(b)
            b = after[b]
        if 0 in out:
            raise InvariantError("blocks handed out past the free queue's tail: capacity was not checked")
        self._ahead += k
        return tuple(out)

    def _to_cache(self, request: Any, through: int) -> None:
        """The blocks before ``through`` whose ids (and the lookahead ids after them) are known, queued to be
        cached in this call's place in the event stream."""
        rid = request.request_id
        full = self._full_blocks(request, through)
        if full > self._hashed[rid]:
            self._queue.append((request, through, request.num_tokens, self._stream.hold_place()))
            self._queued.add(rid)
            self._hashed[rid] = full

    def _full_blocks(self, request: Any, through: int) -> int:
        """The request's blocks before ``through`` whose ids (and the lookahead ids after them) are known."""
        full: int = min(through, request.num_tokens - self.config.hash_lookahead) // self.block_size
        return full

    def _flush(self) -> None:
        """The queued calls applied, as one batch: the rows that opened blocks grown in their order (their pops give
        the blocks handed out), the other rows brought to vLLM's lengths (placeholders), the ids each call knew filled
        in, the blocks cached; each call's events in the place it held."""
        if not self._queue and not self._opening:
            return
        (items, self._queue), (openers, self._opening) = (self._queue, []), (self._opening, [])
        self._queued.clear()
        self._opened.clear()
        ahead, self._ahead = self._ahead, 0
        state = self._state
        txn = Transaction(state)
        places: list[tuple[Any, Any, Sequence[Any]]] = []  # (place, request, the core's events of its call)
        try:
            if openers:
                self._open(txn, openers, places)
            state = txn.state
            rids = list(dict.fromkeys(request.request_id for request, _, _, _ in items))
            slots = {rid: state.requests[rid].slots[0] for rid in rids}
            first = {request.request_id: (request, upto) for request, _, upto, _ in reversed(items)}  # (its first call)
            behind = [
                (rid, [self._growth(*first[rid], state, slots[rid], self._len[rid])])
                for rid in rids
                if self._len[rid] > state.row_len[slots[rid]]
            ]
            if behind:
                grown = txn.apply(append_many(state, behind), "append")
                if grown.effect.events:
                    raise InvariantError("a growth inside open blocks sends no events")
            known = {rid: row_known(txn.state, slots[rid]) for rid in rids}
            fills = []
            for request, _, upto, _ in items:
                rid = request.request_id
                start, upto = known[rid], min(upto, txn.state.row_len[slots[rid]])
                fills.append((rid, [token_ids(request, start, upto) if upto > start else []]))
                known[rid] = max(start, upto)
            filled = None
            if items and any(ids for _, (ids,) in fills):
                filled = txn.apply(fill_many(txn.state, fills), "fill").effect
            if items:
                cached = txn.apply(
                    cache_ahead_many(
                        txn.state,
                        [(r.request_id, [through]) for r, through, _, _ in items],
                        hashes={r.request_id: r.block_hashes for r, _, _, _ in items},
                    ),
                    "cache_ahead",
                ).effect
                for k, (request, _, _, place) in enumerate(items):
                    events = events_of(cached[k]) if filled is None else events_of((filled[k], cached[k]))
                    places.append((place, request, events))
        except Refused as r:  # (each call was checked when it came: a bug, and nothing is lost by raising)
            self._queue, self._opening, self._ahead = items + self._queue, openers + self._opening, ahead
            self._queued.update(r.request_id for r, _, _, _ in items)
            self._opened.update(o[0].request_id for o in self._opening)
            raise r.manager_error() from None
        self._state = self._stream.keep_queued(txn, places)
        for rid in rids:
            self._hashed[rid] = self._state.rows[slots[rid]].num_hashed

    def _open(self, txn: Transaction, openers: list[Any], places: list[tuple[Any, Any, Sequence[Any]]]) -> None:
        """The rows that opened blocks grown in their order, in one ``append_many``: each pop gives the blocks its
        call handed out (checked), each call's evictions go in its place."""
        state = txn.state
        slots = [state.requests[request.request_id].slots[0] for request, _, _, _, _ in openers]
        grown = txn.apply(
            append_many(
                state,
                [
                    (request.request_id, [self._growth(request, known, state, slot, length)])
                    for (request, known, length, _, _), slot in zip(openers, slots)
                ],
            ),
            "append",
        )
        rows = txn.state.rows
        for (request, _, _, blocks, _), slot in zip(openers, slots):
            if rows[slot].blocks[0][-len(blocks) :] != blocks:
                raise InvariantError(f"request {request.request_id!r}: the core's pop is not the blocks handed out")
        events: list[list[Any]] = [[] for _ in openers]
        if grown.effect.events:  # (a pop's evictions: BlockRemoved of a block handed out, in its call's place)
            whose = {b: k for k, (_, _, _, blocks, _) in enumerate(openers) for b in blocks}
            for ev in grown.effect.events:
                events[whose[ev.block_id]].append(ev)
        places.extend((place, request, evs) for (request, _, _, _, place), evs in zip(openers, events))

    def _mirror(self, request: Any) -> None:
        """The manager's view of a request's row, after a call the core applied."""
        rid, state = request.request_id, self._state
        slot = state.requests[rid].slots[0]
        self._len[rid] = state.row_len[slot]
        self._hashed[rid] = state.rows[slot].num_hashed
        self._requests[rid] = request

    def _grow(self, txn: Transaction, request: Any, need_slot: int) -> bool:
        """The row grown to ``need_slot`` positions, by the request's tokens while they are known and
        then by placeholders, in one growth (every group's new blocks in turn, as vLLM allocates them); False
        when the pool cannot hold them."""
        rid = request.request_id
        growth = self._growth(request, request.num_tokens, txn.state, txn.state.requests[rid].slots[0], need_slot)
        grown = append(txn.state, rid, [growth])
        if isinstance(grown, Failure) and grown.failure().code is ErrorCode.NO_CAPACITY:
            return False
        txn.apply(grown, "append")
        if type(growth) is Placeholders:  # (the known ones among them filled in next)
            self._fill(txn, request, txn.state.requests[rid].slots[0])
        return True

    def _fill(self, txn: Transaction, request: Any, slot: int) -> None:
        """The row's ids that came back since it grew past them (sampled tokens, accepted drafts), in order."""
        if not self.enable_caching:
            return
        state = txn.state
        known, upto = row_known(state, slot), min(request.num_tokens, state.row_len[slot])
        if known < upto:
            txn.apply(fill(state, request.request_id, [token_ids(request, known, upto)]), "fill")

    def _catch_up(self, txn: Transaction, request: Any, slot: int) -> None:
        """The core's row brought to the length vLLM sees: the ids that came back filled in, then the growth
        inside its open block the manager kept (no block taken)."""
        self._fill(txn, request, slot)
        length = txn.state.row_len[slot]
        target = self._len.get(request.request_id, length)
        if target > length:
            self._grow(txn, request, target)

    # -- the Mamba states cached in this step (vLLM's align mode) -------------------------------------------------
    # The manager's part of vLLM's ``mamba_cache_mode="align"`` that is a step's, not the core's: the Mamba states
    # cached in the current scheduler step (vLLM's ``MambaManager.cached_blocks_this_step``). A new request whose hit
    # ends on one of them waits a step: its state is written by this step's forward, which has not run.

    def new_step_starts(self) -> None:
        self._cached_now.clear()

    def _cache_ahead(self, txn: Transaction, request: Any, slot: int, through: int) -> None:
        """``cache_ahead`` through ``through`` tokens (vLLM's block hashes taken); the Mamba states it caches noted
        as cached this step."""
        hashed = txn.state.rows[slot].num_hashed
        rid = request.request_id
        txn.apply(cache_ahead(txn.state, rid, [through], hashes=request.block_hashes), "cache_ahead")
        if self._aligned:
            record = txn.state.rows[slot]
            self._cached_now.update(
                (g, record.hash_at(j))
                for j in range(hashed, record.num_hashed)
                for g in self._aligned
                if record.blocks[g][j]
            )

    def _state_cached_now(self, state: KVState, spec: RequestSpec) -> bool:
        """Does the hit of ``spec`` end on a Mamba state cached this step? (A lookup of its own: the admission that
        follows finds the same hit, but the wait must come before anything is taken.)"""
        hit = find_hit(state, spec, drop_last_block=self.use_eagle)
        return bool(hit.num_blocks) and any((g, hit.hashes[0][-1]) in self._cached_now for g in self._aligned)
