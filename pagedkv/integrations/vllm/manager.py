"""pagedkv's pure core as vLLM 0.33's KV cache manager (``vllm.v1.core.kv_cache_manager.KVCacheManager``).

``PagedKVCacheManager`` answers every call vLLM's v1 ``Scheduler`` makes of its manager, each decision a
transition of the core (docs/vllm.md has the table): a lookup is ``find_hit``; a new request's allocation
``admit`` (keeping the watermark and the reserve back) then ``cache_ahead``; a running one's ``fill`` (the
ids that came back), ``commit`` (a window lets blocks go), ``append``, ``cache_ahead``; ``free`` is
``release``. Every call is all or nothing: its transitions run in a ``stream.Transaction`` on a value of the
state, kept only when the call completes; a refusal leaves the manager as it was and answers as vLLM (None
when short; ``ManagerError`` where vLLM's manager would have done what the core refused).

In a pool without windows a running request's call is cut to what moves blocks: ``rows`` keeps each row
as vLLM sees it and tells the core what opens a block at once and what fills one in a queued batch.
"""

from __future__ import annotations

from typing import Any

from returns.result import Failure

from pagedkv.core import RequestSpec, RowSpec, admit, commit, initial_state, release, request_blocks
from pagedkv.core import reset_prefix_cache
from pagedkv.core.errors import ErrorCode, InvariantError, KVError
from pagedkv.core.prefix import find_hit
from pagedkv.core.state import KVState
from pagedkv.integrations.vllm.geometry import Unsupported, translate, vllm_modules
from pagedkv.integrations.vllm.requests import RefusedRequest, block_keys, event_fields, is_waiting, release_reason
from pagedkv.integrations.vllm.rows import RunningRows
from pagedkv.integrations.vllm.states import StepStates
from pagedkv.integrations.vllm.stream import EventStream, ManagerError, Refused, Transaction


class PagedKVCacheManager(StepStates, RunningRows):
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
        # (a window, or an align-mode Mamba group, lets blocks go at each commit: every call is applied)
        self._lag = not any(geometry.windows) and not any(geometry.aligned)
        self._aligned = [g for g, a in enumerate(geometry.aligned) if a]
        self._cached_now: set[tuple[int, bytes]] = set()  # Mamba states cached this step: (group, hash)
        self._queue: list[tuple[Any, int, int]] = []  # blocks to cache: (request, through, its known tokens then)
        self._queued: set[str] = set()  # the requests in it
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
        cap = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        if cap < self.block_size:
            return self.empty_kv_cache_blocks, 0, 0
        self._flush()
        spec = self._spec(request, request.all_token_ids, cap)
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
        lookup = self.prefix_cache_lookup_enabled(request)
        known = min(need_slot, request.num_tokens)  # slots past the tokens (draft padding, lookahead slots)
        spec = self._spec(
            request, request.all_token_ids[:known], num_new_computed_tokens if lookup else 0, need_slot - known
        )
        if self._aligned and num_new_computed_tokens and self._state_cached_now(txn.state, spec):
            return None  # (vLLM's MambaManager: a state cached this step is written by this step's forward)
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            hit_ids = new_computed_blocks.get_block_ids() if new_computed_blocks is not None else ()
            if self.geometry.capped_need(txn.state, full, computed, hit_ids) + watermark > txn.state.free_blocks:
                return None
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
        if rid in self._queued:  # (its blocks cached before they go back; others' commute with the frees)
            self._flush()
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
        given = tuple(request.block_hashes)  # (vLLM hashed the full blocks already: the core takes its hashes)
        return RequestSpec(request.request_id, (row,), every, max_hit, first, content, given)
