"""pagedkv's pure core as vLLM 0.33's KV cache manager (``vllm.v1.core.kv_cache_manager.KVCacheManager``).

``PagedKVCacheManager`` answers every call vLLM's v1 ``Scheduler`` makes of its manager, each decision a
transition of the core (docs/vllm.md has the table): a lookup is ``find_hit``; a new request's allocation
``admit`` (keeping the watermark and the reserve back) then ``cache_ahead``; a running one's ``fill`` (the
ids that came back), ``commit`` (a window lets blocks go), ``append``, ``cache_ahead``; ``free`` is
``release``. Every call is all or nothing: its transitions run in a ``stream.Transaction`` on a value of the
state, kept only when the call completes; a refusal leaves the manager as it was and answers as vLLM (None
when short; ``ManagerError`` where vLLM's manager would have done what the core refused).

In a pool without windows a running request's call is cut to what moves blocks. Slots inside a row's open
block take none: the manager keeps the row's length itself (``_len``) and the core's row catches up when it
next opens a block (one ``append``, at once: its new blocks are the answer) or when ``state`` is read. A block
to cache is queued with its place in the event stream, and the queue is applied as one batch (``fill`` the
ids that call knew, ``cache_ahead``) before anything reads the cache or frees a queued row's blocks: vLLM
keeps every block that fills (duplicate contents too), so caching a block in use commutes with the pops and
frees of other rows between. A window lets
blocks go at each commit: there every call is applied as it comes. The configuration is translated (and what is not served refused) in ``geometry``,
a request's hash keys are read in ``requests``, events and metrics go out through ``stream``, the
read-only surface is ``reads``. ``PagedKVScheduler`` is vLLM's ``Scheduler`` with this manager installed.
"""

from __future__ import annotations

from typing import Any

from returns.result import Failure

from pagedkv.core import RequestSpec, RowSpec, initial_state
from pagedkv.core import Placeholders, admit, append, append_many, cache_ahead, cache_ahead_many, commit, fill
from pagedkv.core import fill_many
from pagedkv.core import release, request_blocks, reset_prefix_cache
from pagedkv.core.errors import ErrorCode, KVError
from pagedkv.core.prefix import find_hit
from pagedkv.core.state import KVState, row_known
from pagedkv.integrations.vllm.geometry import Unsupported, translate, vllm_modules
from pagedkv.integrations.vllm.reads import ManagerReads
from pagedkv.integrations.vllm.requests import RefusedRequest, block_keys, event_fields, is_waiting, release_reason
from pagedkv.integrations.vllm.stream import EventStream, Refused, Transaction

class ManagerError(RuntimeError):
    """The core refused what vLLM's scheduler asked, where vLLM's own manager would have done it; the manager
    is left as it was before the call."""


class PagedKVCacheManager(ManagerReads):
    """vLLM's ``KVCacheManager`` surface over pagedkv's core (module docstring)."""

    def __init__(self, kv_cache_config: Any, max_model_len: int, scheduler_block_size: int, hash_block_size: int,
                 max_in_flight_tokens: int | None = None, enable_caching: bool = True, use_eagle: bool = False,
                 num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, dcp_world_size: int = 1, pcp_world_size: int = 1,
                 metrics_collector: Any = None, watermark: float = 0.0,
                 enable_mamba_shared_prefix_checkpoint: bool = False, hash_algo: str = "sha256") -> None:  # fmt: skip
        kvm = vllm_modules()[0]
        refused = [why for bad, why in (
            (num_prefill_lookahead > 1, f"a prefill lookahead of {num_prefill_lookahead} tokens (multi-module MTP: "
                                        "its last chunk's tokens are prefilled again)"),
            (use_eagle and num_hash_lookahead_tokens, "EAGLE's block drop with lookahead hashes"),
            (dcp_world_size != 1 or pcp_world_size != 1, "decode / prefill context parallelism"),
            (enable_mamba_shared_prefix_checkpoint, "Mamba checkpoints"),
            (hash_block_size != scheduler_block_size, f"a hash block size ({hash_block_size}) other than the "
                                                      f"block size ({scheduler_block_size})"),
            (not 0.0 <= watermark < 1.0, f"watermark {watermark} (must be in [0, 1))"),
        ) if bad]  # fmt: skip
        geometry = translate(kv_cache_config, max_model_len=max_model_len, block_size=scheduler_block_size,
                             in_flight=max_in_flight_tokens if max_in_flight_tokens is not None else max_model_len,
                             caching=enable_caching, hash_algo=hash_algo, hash_lookahead=num_hash_lookahead_tokens,
                             refused=refused)  # fmt: skip
        self.geometry = geometry
        self.config = geometry.config
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.block_size = scheduler_block_size
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.log_stats = log_stats
        self.use_eagle = use_eagle  # EAGLE's block drop: a hit matches one block past it and gives it back
        self._ahead = num_hash_lookahead_tokens  # (a block is cached once the ids after it its hash covers are known)
        self.num_kv_cache_groups = len(geometry.caps)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.metrics_collector = metrics_collector
        self._state: KVState = initial_state(self.config)
        self._stream = EventStream(self.config, enable_kv_cache_events, caching=enable_caching,
                                   metrics=metrics_collector, blocks=kv_cache_config.num_blocks)  # fmt: skip
        # each admitted request's row as vLLM sees it: its length (the core's may lag inside the open block), the
        # blocks of it the core has hashed, and the request (its ids, for the core's row to catch up)
        self._len: dict[str, int] = {}
        self._hashed: dict[str, int] = {}
        self._requests: dict[str, Any] = {}
        self._lag = not any(geometry.windows)  # (a window lets blocks go at each commit: every call is applied)
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

    # -- the state the scheduler reads ---------------------------------------------------------------------
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
                raise ManagerError(f"the core refused {r.what}: {r.error.code.value}: {r.error.message}") from None
            self._state = self._stream.keep(txn, None)
        return self._state

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
        if not hit.num_blocks:
            return self.empty_kv_cache_blocks, 0, 0
        if self.enable_kv_cache_events and getattr(request, "kv_cache_report_mode", "incremental") == "full":
            self._stream.announce(hit, spec, event_fields(request))
        block = self._block
        return self._blocks_cls(tuple([block[b] for b in ids] for ids in hit.ids[0])), hit.num_blocks * self.block_size, 0

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True, skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:  # fmt: skip
        """Slots for ``num_new_tokens`` more tokens (after the hit, for a new request): the new blocks, or None
        when the pool cannot hold them (nothing then changes but a window's blocks let go, as in vLLM)."""
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        if num_external_computed_tokens or delay_cache_blocks or num_encoder_tokens:
            raise Unsupported("pagedkv's KV cache manager allocates no external (connector) or encoder slots; the "
                              "scheduler was built with a feature it refuses")  # fmt: skip
        rid = request.request_id
        n = self._len.get(rid)
        if n is not None and self._lag and not num_new_computed_tokens:
            return self._running(request, n, num_new_tokens + num_lookahead_tokens, num_new_tokens, reserved_blocks)
        self._flush()  # (an admission reads the cache, a window's commit frees blocks)
        txn = Transaction(self._state)
        try:
            new = self._allocate(txn, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                 num_lookahead_tokens, full_sequence_must_fit, reserved_blocks,
                                 has_scheduled_reqs)  # fmt: skip
        except Refused as r:
            raise ManagerError(f"the core refused {r.what}: {r.error.code.value}: {r.error.message}") from None
        self._state = self._stream.keep(txn, request)
        if new is None:
            return None
        self._mirror(request)
        return self._blocks_cls(new) if any(new) else self.empty_kv_cache_blocks

    def _running(self, request: Any, n: int, slots: int, num_new_tokens: int, reserved_blocks: int) -> Any:
        """A running request's slots in a pool without windows (module docstring): the blocks its row opens,
        at once; the blocks it fills, queued to be cached."""
        rid = request.request_id
        computed = min(request.num_computed_tokens, self.max_model_len)
        length = max(min(computed + slots, self.max_model_len), n)
        bs, state = self.block_size, self._state
        opens = -(-length // bs) - -(-n // bs)
        if opens * self.num_kv_cache_groups > state.free_blocks - reserved_blocks:
            return None  # (as vLLM: even a call that takes no block, when the reserve is short)
        new = self.empty_kv_cache_blocks
        if opens:
            slot = state.requests[rid].slots[0]
            txn = Transaction(state)
            try:
                txn.apply(append(state, rid, [self._growth(request, request.num_tokens, state, slot, length)]),
                          "append")  # fmt: skip
            except Refused as r:
                raise ManagerError(f"the core refused {r.what}: {r.error.code.value}: {r.error.message}") from None
            opened = [ids[-opens:] for ids in request_blocks(txn.state, rid)[0]]
            txn.allocated = [b for ids in opened for b in ids]
            self._state = self._stream.keep(txn, request)
            block = self._block
            new = self._blocks_cls(tuple([block[b] for b in ids] for ids in opened))
        self._len[rid] = length
        if self.enable_caching:
            self._to_cache(request, min(computed + num_new_tokens, length))
        return new

    def _growth(self, request: Any, known: int, state: KVState, slot: int, target: int) -> Any:
        """The core's row's growth to ``target`` positions: the request's first ``known`` ids, where they
        cover it and follow the row's known ones, else placeholders (their ids filled when a block they
        complete is cached); a count without caching."""
        length = state.row_len[slot]
        if not self.enable_caching:
            return target - length
        if target <= known and row_known(state, slot) == length:
            return request.all_token_ids[length:target]
        return Placeholders(target - length)

    def _to_cache(self, request: Any, through: int) -> None:
        """The blocks before ``through`` whose ids (and the lookahead ids after them) are known, queued to be
        cached in this call's place in the event stream."""
        rid = request.request_id
        known = request.num_tokens
        full = min(through, known - self._ahead) // self.block_size
        if full > self._hashed[rid]:
            self._queue.append((request, through, known))
            self._queued.add(rid)
            self._stream.hold_place()
            self._hashed[rid] = full

    def _flush(self) -> None:
        """The queued blocks cached, as one batch: the rows brought to vLLM's lengths (placeholders), the ids
        each call knew filled in, the blocks cached, each call's events in the place it held."""
        if not self._queue:
            return
        items, self._queue = self._queue, []
        self._queued.clear()
        state = self._state
        txn = Transaction(state)
        rids = list(dict.fromkeys(request.request_id for request, _, _ in items))
        slots = {rid: state.requests[rid].slots[0] for rid in rids}
        try:
            first = {request.request_id: (request, upto) for request, _, upto in reversed(items)}  # (its first call)
            behind = [(rid, [self._growth(*first[rid], state, slots[rid], self._len[rid])]) for rid in rids
                      if self._len[rid] > state.row_len[slots[rid]]]  # fmt: skip
            if behind:
                txn.apply(append_many(state, behind), "append")
            known = {rid: row_known(txn.state, slots[rid]) for rid in rids}
            fills = []
            for request, _, upto in items:
                rid = request.request_id
                start, upto = known[rid], min(upto, txn.state.row_len[slots[rid]])
                fills.append((rid, [request.all_token_ids[start:upto] if upto > start else []]))
                known[rid] = max(start, upto)
            if any(ids for _, (ids,) in fills):
                txn.apply(fill_many(txn.state, fills), "fill")
            txn.apply(cache_ahead_many(txn.state, [(r.request_id, [through]) for r, through, _ in items]), "cache_ahead")
        except Refused as r:  # (each item was checked when queued: a bug, and nothing is lost by raising)
            self._queue = items + self._queue
            self._queued.update(r.request_id for r, _, _ in items)
            raise ManagerError(f"the core refused {r.what}: {r.error.code.value}: {r.error.message}") from None
        self._state = self._stream.keep_queued(txn, [request for request, _, _ in items])
        for rid in rids:
            self._hashed[rid] = self._state.rows[slots[rid]].num_hashed

    def _mirror(self, request: Any) -> None:
        """The manager's view of a request's row, after a call the core applied."""
        rid, state = request.request_id, self._state
        slot = state.requests[rid].slots[0]
        self._len[rid] = state.row_len[slot]
        self._hashed[rid] = state.rows[slot].num_hashed
        self._requests[rid] = request

    def _allocate(self, txn: Transaction, request: Any, num_new_tokens: int, num_new_computed_tokens: int,
                  new_computed_blocks: Any, num_lookahead_tokens: int, full_sequence_must_fit: bool,
                  reserved_blocks: int, has_scheduled_reqs: bool) -> tuple[list[Any], ...] | None:  # fmt: skip
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
            watermark = self.watermark_blocks if has_scheduled_reqs and is_waiting(request) else 0
            lookup = self.prefix_cache_lookup_enabled(request)
            known = min(need_slot, request.num_tokens)  # slots past the tokens (draft padding, lookahead slots)
            spec = self._spec(request, request.all_token_ids[:known], num_new_computed_tokens if lookup else 0,
                              need_slot - known)  # fmt: skip
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
                raise Refused("admit", KVError(ErrorCode.INVALID, f"request {rid!r}: the core's hit is "
                              f"{step.effect.cached_tokens[0]} tokens, the scheduler's {num_new_computed_tokens}"))
            before: tuple[tuple[int, ...], ...] = tuple(ids[: step.effect.cached_tokens[0] // self.block_size]
                                                        for ids in step.effect.blocks[0])  # fmt: skip
            txn.touched = [b for ids in before for b in ids if b]  # the hit, group by group
        else:
            slot = req.slots[0]
            self._catch_up(txn, request, slot)
            # what the scheduler's processed steps computed (steps in flight, rejected drafts not counted): a
            # window lets its blocks go on that basis, as vLLM's does
            done = max(computed - request.num_in_flight_tokens, 0)
            if done > txn.state.row_computed[slot]:
                txn.apply(commit(txn.state, rid, [done]), "commit")
            before = request_blocks(txn.state, rid)[0]
            need = sum(max(-(-need_slot // self.block_size) - len(ids), 0) for ids in before)
            if need > txn.state.free_blocks - reserved_blocks:  # (counting what the window let go)
                return None
            length = txn.state.row_len[slot]
            if need_slot > length and not self._grow(txn, request, length, need_slot):
                return None
        slot = txn.state.requests[rid].slots[0]
        through = min(computed + num_new_tokens, request.num_tokens, txn.state.row_len[slot])
        if self.enable_caching and through > txn.state.row_computed[slot]:
            txn.apply(cache_ahead(txn.state, rid, [through]), "cache_ahead")
        block = self._block
        new = [[b for b in ids[len(old):] if b] for ids, old in zip(request_blocks(txn.state, rid)[0], before)]
        txn.allocated = [b for ids in new for b in ids]  # popped from the free queue, group by group
        return tuple([block[b] for b in ids] for ids in new)

    def _grow(self, txn: Transaction, request: Any, length: int, need_slot: int) -> bool:
        """The row grown from ``length`` to ``need_slot`` positions, by the request's tokens while they are known and
        then by placeholders, in one growth (every group's new blocks in turn, as vLLM allocates them); False
        when the pool cannot hold them."""
        rid = request.request_id
        if not self.enable_caching:  # (no block is hashed: a count is all the row needs)
            growth: Any = need_slot - length
        elif need_slot <= request.num_tokens:
            growth = request.all_token_ids[length:need_slot]
        else:
            growth = Placeholders(need_slot - length)  # (the known ones among them filled in next)
        grown = append(txn.state, rid, [growth])
        if isinstance(grown, Failure) and grown.failure().code is ErrorCode.NO_CAPACITY:
            return False
        txn.apply(grown, "append")
        if type(growth) is Placeholders:
            self._fill(txn, request, txn.state.requests[rid].slots[0])
        return True

    def _fill(self, txn: Transaction, request: Any, slot: int) -> None:
        """The row's ids that came back since it grew past them (sampled tokens, accepted drafts), in order."""
        if not self.enable_caching:
            return
        state = txn.state
        known, upto = row_known(state, slot), min(request.num_tokens, state.row_len[slot])
        if known < upto:
            txn.apply(fill(state, request.request_id, [request.all_token_ids[known:upto]]), "fill")

    def _catch_up(self, txn: Transaction, request: Any, slot: int) -> None:
        """The core's row brought to the length vLLM sees: the ids that came back filled in, then the growth
        inside its open block the manager kept (no block taken)."""
        self._fill(txn, request, slot)
        length = txn.state.row_len[slot]
        target = self._len.get(request.request_id, length)
        if target > length:
            self._grow(txn, request, length, target)

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
        if min(num_computed_tokens, request.num_tokens - self._ahead, n) // self.block_size <= self._hashed[rid]:
            return  # (no block to cache: nothing to apply)
        slot = self._state.requests[rid].slots[0]
        txn = Transaction(self._state)
        try:
            self._catch_up(txn, request, slot)  # (the tokens a step late, the accepted drafts)
            through = min(num_computed_tokens, txn.state.row_len[slot])
            if through > txn.state.row_computed[slot]:
                txn.apply(cache_ahead(txn.state, rid, [through]), "cache_ahead")
        except Refused as r:
            raise ManagerError(f"the core refused {r.what}: {r.error.message}") from None
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
                raise ManagerError(f"the core refused release: {r.error.message}") from None
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
            assert self.prefix_cache_stats is not None
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
        return RequestSpec(request.request_id, (row,), every, max_hit, first, content)
