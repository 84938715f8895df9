"""A stable digest of the whole core state.

Equal states give equal digests in any process on any machine: the canonical
form is built from ints, strings, tuples and None only, rendered with ``repr``
and hashed with BLAKE2b (never Python's salted ``hash()``). Row slot numbers
are internal and left out; the free queue's order is in.
"""

from __future__ import annotations

import hashlib

from pagedkv.core.store.state import KVState, free_queue, row_token_ids


def canonical(state: KVState) -> tuple[object, ...]:
    cfg = state.config
    config = (
        cfg.block_size,
        cfg.num_blocks,
        tuple((g.name, g.kind.value, g.window, g.chunk) for g in cfg.groups),
        cfg.enable_prefix_caching,
        cfg.max_rows_per_request,
        cfg.max_model_len,
        cfg.hash_namespace,
    )
    requests = []
    for rid in sorted(state.requests.keys(), key=lambda r: (type(r).__name__, r)):
        req = state.requests[rid]
        rows = tuple(
            (
                state.row_len[slot],
                state.row_computed[slot],
                layout.prefix_len,
                layout.target_len,
                layout.spans,
                (record := state.rows[slot]).blocks,
                row_token_ids(state, slot),
                tuple(record.hash_at(j).hex() for j in range(record.num_hashed)),
                (record.pending[0], tuple(sorted(record.pending[1]))),
            )
            for slot, layout in zip(req.slots, req.layouts)
        )
        generation = state.row_generation[req.slots[0]]
        keys = req.extra_keys if not req.keys.varies else (req.extra_keys, req.keys.first, req.keys.content)
        entry: tuple[object, ...] = (type(rid).__name__, rid, keys, generation, req.cache_epoch, rows)
        if req.given:  # (rows keyed by their caller's hashes; absent otherwise, so other states name as before)
            entry += (tuple(tuple(h.hex() for h in row) for row in req.given),)
        requests.append(entry)
    cache = tuple(sorted((g, h.hex(), b) for (g, h), b in state.cache.items()))
    tier = state.host  # (absent without a host tier, so other states name as before)
    host = (
        (tuple(sorted((g, h.hex(), slot, tick) for (g, h), (slot, tick) in tier.entries.items())), tier.next_slot)
        + ((tier.spare,) if tier.spare else ())  # (spare slots: forget_host's; absent otherwise, as before)
        + (  # (the use table: host_store_threshold's; absent otherwise, as before)
            (tuple(sorted((h.hex(), n, tick) for h, (n, tick) in tier.uses.items())),)
            if state.config.host_store_threshold > 1
            else ()
        )
        if state.config.host_blocks
        else ()
    )
    return (
        "pagedkv-state/1",
        config,
        state.generation,
        state.epoch,
        tuple(state.refcount),
        tuple(free_queue(state)),
        tuple(requests),
        cache,
        state.cache_epoch,
        state.prefix_queries,
        state.prefix_hits,
    ) + ((host,) if host else ())


def digest(state: KVState) -> str:
    """32 hex digits that name the state.

    >>> from pagedkv.core import CacheConfig, initial_state
    >>> a = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> digest(a) == digest(initial_state(CacheConfig(block_size=4, num_blocks=9)))
    True
    """
    return hashlib.blake2b(repr(canonical(state)).encode(), digest_size=16).hexdigest()
