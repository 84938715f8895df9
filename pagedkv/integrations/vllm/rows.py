"""The rows of pagedkv's vLLM manager as vLLM sees them, and what of them the core is told when.

In a pool without windows a running request's call is cut to what moves blocks (``RunningRows._running``).
Slots inside a row's open block take none: the manager keeps the row's length itself (``_len``) and the
core's row catches up when it next opens a block (one ``append``, at once: its new blocks are the answer)
or when ``state`` is read. A block to cache is queued with its place in the event stream, and the queue is
applied as one batch (``_flush``: the rows' catch-up, ``fill`` of the ids each call knew, ``cache_ahead``)
before anything reads the cache or frees a queued row's blocks: vLLM keeps every block that fills
(duplicate contents too), so caching a block in use commutes with the pops and frees of other rows between.
A window lets blocks go at each commit: there every call is applied as it comes (``_catch_up``, ``_grow``).
A base of ``PagedKVCacheManager``.
"""

from __future__ import annotations

from typing import Any

from returns.result import Failure

from pagedkv.core import Placeholders, append, append_many, cache_ahead_many, fill, fill_many, request_blocks
from pagedkv.core.errors import ErrorCode
from pagedkv.core.state import KVState, row_known
from pagedkv.integrations.vllm.reads import ManagerReads
from pagedkv.integrations.vllm.stream import EventStream, Refused, Transaction


class RunningRows(ManagerReads):
    """Each admitted request's row as vLLM sees it, and the core's catching up (module docstring)."""

    max_model_len: int
    _stream: EventStream
    _len: dict[str, int]  # each admitted request's row length as vLLM sees it (the core's may lag in the open block)
    _hashed: dict[str, int]  # the blocks of it the core has hashed (or will, once the queue is applied)
    _requests: dict[str, Any]  # the vLLM request of each admitted row (its ids, for the core's row to catch up)
    _queue: list[tuple[Any, int, int]]  # blocks to cache: (request, through, its known tokens then)
    _queued: set[str]  # the requests in it

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
        if opens * self.num_kv_cache_groups > state.free_blocks - reserved_blocks:
            return None  # (as vLLM: even a call that takes no block, when the reserve is short)
        new = self.empty_kv_cache_blocks
        if opens:
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
        full = self._full_blocks(request, through)
        if full > self._hashed[rid]:
            self._queue.append((request, through, request.num_tokens))
            self._queued.add(rid)
            self._stream.hold_place()
            self._hashed[rid] = full

    def _full_blocks(self, request: Any, through: int) -> int:
        """The request's blocks before ``through`` whose ids (and the lookahead ids after them) are known."""
        full: int = min(through, request.num_tokens - self.config.hash_lookahead) // self.block_size
        return full

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
            behind = [
                (rid, [self._growth(*first[rid], state, slots[rid], self._len[rid])])
                for rid in rids
                if self._len[rid] > state.row_len[slots[rid]]
            ]
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
            txn.apply(
                cache_ahead_many(
                    txn.state,
                    [(r.request_id, [through]) for r, through, _ in items],
                    hashes={r.request_id: r.block_hashes for r, _, _ in items},
                ),
                "cache_ahead",
            )
        except Refused as r:  # (each item was checked when queued: a bug, and nothing is lost by raising)
            self._queue = items + self._queue
            self._queued.update(r.request_id for r, _, _ in items)
            raise r.manager_error() from None
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
            txn.apply(fill(state, request.request_id, [request.all_token_ids[known:upto]]), "fill")

    def _catch_up(self, txn: Transaction, request: Any, slot: int) -> None:
        """The core's row brought to the length vLLM sees: the ids that came back filled in, then the growth
        inside its open block the manager kept (no block taken)."""
        self._fill(txn, request, slot)
        length = txn.state.row_len[slot]
        target = self._len.get(request.request_id, length)
        if target > length:
            self._grow(txn, request, target)
