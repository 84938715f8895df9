"""Prefix-cache lookup at admission.

The hit of a request is a whole number of blocks, common to all its rows (CFG
rows share one boundary). A row's hit is at most ``(seq_len - 1) // block_size``
blocks, so at least its last token is computed (a diffusion row: at most
``prefix_len // block_size``, only its stable prefix is cacheable); a row with
no token ids never hits. With full-attention groups the hit is the longest run
of blocks every full group has cached, scanned left to right; windowed groups
then cut it back, right to left, until each also holds every block a query at
the hit boundary can see, and state groups until a state was saved where it ends
(a row that ended on that boundary). Last, the hit is cut back until every row keeps the
same segment structure from the boundary on (CFG rows of different prefix
lengths stay one batched forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.hashing import BlockHash, BlockKeys
from pagedkv.core.metadata import segments_of
from pagedkv.core.spec import RequestSpec
from pagedkv.core.state import KVState
from pagedkv.core.tails import pack_ids


@dataclass(frozen=True, slots=True)
class Hit:
    num_blocks: int  # common hit length in blocks
    hashes: tuple[tuple[BlockHash, ...], ...]  # per row: chain hashes of the hit blocks
    ids: tuple[tuple[tuple[int, ...], ...], ...]  # per row, per group: hit block ids (0 = null)


def find_hit(state: KVState, spec: RequestSpec) -> Hit:
    """The longest hit of ``spec`` in the prefix cache, common to all its rows (module docstring)."""
    cfg = state.config
    rows = spec.rows
    ngroups = len(cfg.groups)
    if not cfg.enable_prefix_caching or any(r.tokens is None for r in rows) or spec.max_hit == 0:
        return Hit(0, ((),) * len(rows), (((),) * ngroups,) * len(rows))
    try:
        chains = _full_chains(state, spec)
    except (OverflowError, TypeError, ValueError):  # ids, keys or lengths no admission takes: no hit
        return Hit(0, ((),) * len(rows), (((),) * ngroups,) * len(rows))
    hit = len(chains[-1])  # each row's chain stops at the shortest before it
    if not hit:  # the common case: the first block already misses
        return Hit(0, ((),) * len(rows), (((),) * ngroups,) * len(rows))
    bs, cache = cfg.block_size, state.cache
    windowed = [g for g, gs in enumerate(cfg.groups) if gs.is_windowed]
    states = [g for g, gs in enumerate(cfg.groups) if gs.is_state]

    def windows_hold(n: int) -> bool:
        for g in windowed:
            first = cfg.groups[g].first_visible_block(n * bs, bs)
            if any((g, chain[j]) not in cache for chain in chains for j in range(first, n)):
                return False
        for g in states:  # a state saved where the hit ends, a different one for each row (it is taken over)
            saved = [cache.get((g, chain[n - 1])) for chain in chains]
            if None in saved or len(set(saved)) < len(saved):
                return False
        return True

    while hit and not windows_hold(hit):
        hit -= 1
    # A hit never splits a request's rows into different segment structures: rows
    # that could share one forward from position 0 (CFG branches) still can.
    def structure(row_index: int, n: int) -> tuple[bool, ...]:
        row = rows[row_index]
        return tuple(seg.causal for seg in segments_of(row.spans, row.num_tokens, n * bs))

    if len(rows) > 1 and len({structure(r, 0) for r in range(len(rows))}) == 1:
        while hit and len({structure(r, hit) for r in range(len(rows))}) > 1:
            hit -= 1
    ids = []
    for chain in chains:
        per_group = []
        for g, gs in enumerate(cfg.groups):
            if gs.is_state:  # the state after the hit's last block, at its position
                per_group.append((0,) * (hit - 1) + (cache[(g, chain[hit - 1])],) if hit else ())
                continue
            first = gs.first_visible_block(hit * bs, bs)
            per_group.append(tuple(cache[(g, chain[j])] if j >= first else 0 for j in range(hit)))
        ids.append(tuple(per_group))
    return Hit(hit, tuple(tuple(c[:hit]) for c in chains), tuple(ids))


def _full_chains(state: KVState, spec: RequestSpec) -> list[list[BlockHash]]:
    """Per row, the hashes of its leading blocks that every full-attention group has cached; a
    row's chain is never longer than the one before it (the hit is common to all rows)."""
    cfg, cache = state.config, state.cache
    bs = cfg.block_size
    full = [g for g, gs in enumerate(cfg.groups) if not (gs.is_windowed or gs.is_state)]  # full attention, MLA
    chains: list[list[BlockHash]] = []
    limit: int | None = None if spec.max_hit is None else spec.max_hit // bs
    keys = BlockKeys.of(spec.extra_keys, content=spec.content, first=spec.first_block_keys, kind=cfg.block_hash)
    plain = None if keys.varies else keys.plain  # (most requests: every block hashes the same keys)
    hash_packed = cfg.hash_fn
    width = bs << 3  # bytes of one block's packed ids
    for row in spec.rows:
        assert row.tokens is not None
        cap = (row.prefix_len if row.prefix_len is not None else row.num_tokens - 1) // bs
        if limit is not None:
            cap = min(cap, limit)  # the common boundary is never past the shortest row's hit
        chain: list[BlockHash] = []
        parent = cache.root
        packed = pack_ids(row.tokens[: cap * bs])
        for j in range(cap):
            h = hash_packed(parent, packed[j * width : (j + 1) * width], keys.at(j, bs) if plain is None else plain)
            if any((g, h) not in cache for g in full):
                break
            chain.append(h)
            parent = h
        chains.append(chain)
        limit = len(chain)
    return chains
