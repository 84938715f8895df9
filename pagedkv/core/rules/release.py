"""Release and reset: blocks go back.

A release drops every reference of a request tail first (positions descending
over all its rows and groups), so a request's prefix outlives its suffix in the
free queue; it always takes a generation. ``reset`` starts a new epoch;
``reset_prefix_cache`` drops every hash while requests run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from returns.result import Failure, Result, Success

import pagedkv.core.rules.pool as pool
from pagedkv.core.rules.caching import save_states
from pagedkv.core.rules.commit import forget_ahead
from pagedkv.core.outputs.effects import HostForgotten, PrefixCacheReset, Released, ReleaseReason, WasReset
from pagedkv.core.errors import (
    ErrorCode,
    KVError,
    RequestId,
    fail,
    ids_problem,
    invalid,
    is_int,
    is_request_id,
    ordered_ids,
    shown,
)
from pagedkv.core.store.host import HostTier
from pagedkv.core.outputs.events import AllBlocksCleared, HostBlockRemoved, KVEvent
from pagedkv.core.store.index import PrefixIndex
from pagedkv.core.store.state import KVState, Request, Step, initial_state
from pagedkv.core.store.txn import Txn


def release(state: KVState, request_id: RequestId, reason: ReleaseReason | str) -> Result[Step[Released], KVError]:
    """Drop every block reference of a request, tail first; the request is gone.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(8),))).unwrap().state
    >>> step = release(s, "a", "finished").unwrap()
    >>> step.effect.freed_blocks, step.effect.generation
    (2, 2)
    """
    if not isinstance(reason, str) or reason not in _REASONS:
        return Failure(
            invalid(f"release reason must be one of {sorted(_REASONS)}, got {shown(reason)}", field="reason")
        )
    if not is_request_id(request_id):
        return Failure(
            invalid(f"request id must be a string or a 64-bit integer, got {shown(request_id)}", field="request")
        )
    req = state.requests.get(request_id)
    if req is None:
        return fail(ErrorCode.UNKNOWN_REQUEST, f"request {shown(request_id)} is not admitted", request_id)
    txn = Txn(state)
    before = txn.free_blocks
    _leave_cache(txn, req, reason == "error")
    pool.free_tail_first(txn, req)
    del txn.requests[request_id]
    gen = txn.next_generation()
    freed = txn.free_blocks - before
    events = tuple(txn.events) if txn.events else ()
    return Success(Step(txn.done(), Released(request_id, ReleaseReason(reason), gen, freed, events)))


def release_many(
    state: KVState, request_ids: Iterable[RequestId], reason: ReleaseReason | str
) -> Result[Step[tuple[Released, ...]], KVError]:
    """Several releases as one transition, in order (the requests a step ended): all, or none.

    The same as releasing them one after another: each takes its own generation.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(admit(s, RequestSpec("a", (RowSpec(8),))).unwrap().state, RequestSpec("b", (RowSpec(2),))).unwrap().state
    >>> [(r.request_id, r.generation, r.freed_blocks) for r in release_many(s, ["a", "b"], "finished").unwrap().effect]
    [('a', 3, 2), ('b', 4, 1)]
    """
    if not isinstance(reason, str) or reason not in _REASONS:
        return Failure(
            invalid(f"release reason must be one of {sorted(_REASONS)}, got {shown(reason)}", field="reason")
        )
    bad = ids_problem(request_ids, "release_many")
    if bad is not None:
        return Failure(bad)
    why = ReleaseReason(reason)
    txn = Txn(state)
    out = []
    gone: set[RequestId] = set()
    for rid in request_ids:
        if not is_request_id(rid):
            return Failure(
                invalid(f"request id must be a string or a 64-bit integer, got {shown(rid)}", field="request")
            )
        req = state.requests.get(rid)
        if req is None or rid in gone:
            return fail(ErrorCode.UNKNOWN_REQUEST, f"request {shown(rid)} is not admitted", rid)
        gone.add(rid)
        before, first_event = txn.free_blocks, len(txn.events)
        _leave_cache(txn, req, why is ReleaseReason.ERROR)
        pool.free_tail_first(txn, req)
        del txn.requests[rid]
        out.append(Released(rid, why, txn.next_generation(), txn.free_blocks - before, tuple(txn.events[first_event:])))
    return Success(Step(txn.done(), tuple(out)))


_REASONS = frozenset(r.value for r in ReleaseReason)


def _leave_cache(txn: Txn, req: Request, failed: bool) -> None:
    """What an ending request leaves in the prefix cache besides its computed blocks: its states, saved
    where a row ends on a block boundary; after a failed step (its KV may be half written) no state, and the
    entries it cached ahead of its computation taken back."""
    cfg = txn.config
    if not failed:
        if cfg.state_group_set:
            save_states(txn, req)
    elif cfg.caching_point == "schedule":
        forget_ahead(txn, req)


def reset(state: KVState) -> Result[Step[WasReset], KVError]:
    """Reinitialise: every request dropped, the pool empty, a new epoch.

    Generations go on from where they were (they are never reused), so a
    worker can tell every snapshot of the old epoch from the new ones.
    """
    nxt = initial_state(
        state.config, generation=state.generation, epoch=state.epoch + 1, cache_epoch=state.cache_epoch + 1
    )
    released = tuple(ordered_ids(list(state.requests.keys())))
    events: tuple[KVEvent, ...] = (AllBlocksCleared(),) if len(state.cache) and state.config.kv_events else ()
    return Success(Step(nxt, WasReset(nxt.epoch, released, events)))


def reset_prefix_cache(state: KVState) -> Result[Step[PrefixCacheReset], KVError]:
    """Drop every hash (after a weight update, say); works while requests run (under the ``when_idle``
    policy it is refused, ``BLOCKS_IN_USE``, while any block is held, as vLLM's reset returns False).

    Cached blocks nobody holds become plain free blocks where they stand in the
    free queue; held ones stay with their owners but can no longer be hit. The
    requests running now never insert again: their KV may predate the reset.
    Costs O(sqrt(pool)): the index is replaced by an empty one (whose leaves are shared). Its effect carries
    ``AllBlocksCleared`` every time it succeeds, as vLLM's reset does, whether or not anything was cached.

    >>> from pagedkv.core import CacheConfig, initial_state
    >>> reset_prefix_cache(initial_state(CacheConfig(block_size=4, num_blocks=9))).unwrap().effect.dropped
    0
    """
    if state.config.reset_prefix_cache == "when_idle" and state.free_blocks != state.config.usable_blocks:
        held = state.config.usable_blocks - state.free_blocks
        return fail(
            ErrorCode.BLOCKS_IN_USE,
            f"reset_prefix_cache waits until no block is held ({held} are; "
            'reset_prefix_cache is "when_idle", as vLLM\'s)',
            None,
            requested=held,
            available=0,
        )
    dropped = len(state.cache)
    empty = PrefixIndex.empty(state.config.num_blocks, len(state.config.groups), state.cache.root)
    nxt = replace(state, cache=empty, cache_epoch=state.cache_epoch + 1, host=HostTier.empty())  # (the host tier's too)
    # every successful reset says so, an empty cache's too: vLLM's block pool does, and a router counts on it
    return Success(Step(nxt, PrefixCacheReset(dropped, (AllBlocksCleared(),) if state.config.kv_events else ())))


def forget_host(state: KVState, slots: object) -> Result[Step[HostForgotten], KVError]:
    """Drop the host tier's entries in ``slots``: the shell could not write them (a store that failed), so no
    hit may load them. Each dropped entry's ``HostBlockRemoved``; its slot is taken again first. A slot no entry
    holds is passed over; one outside the tier is ``INVALID`` (nothing changed).

    >>> from pagedkv.core import CacheConfig, initial_state
    >>> cfg = CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True, host_blocks=2)
    >>> forget_host(initial_state(cfg), [1]).unwrap().effect.forgotten
    0
    """
    cap = state.config.host_blocks
    asked = tuple(slots) if isinstance(slots, (list, tuple)) else None
    if asked is None or any(not is_int(x) or not 0 <= x < cap for x in asked):
        return Failure(
            invalid(
                f"forget_host takes a list of host slots in [0, {cap}) (host_blocks), got {shown(slots):.80}",
                field="slots",
            )
        )
    wanted = set(asked)
    gone = sorted((slot, key) for key, (slot, _) in state.host.entries.items() if slot in wanted)
    txn = Txn(state)
    txn.host.forget(gone)
    for slot, (group, block_hash) in gone:
        txn.events.append(HostBlockRemoved(block_hash, group, slot))
    return Success(Step(txn.done(), HostForgotten(asked, len(txn.events), tuple(txn.events))))
