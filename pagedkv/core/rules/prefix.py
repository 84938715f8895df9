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

from pagedkv.core.errors import GivenHashError, InvariantError
from pagedkv.core.rules.hashing import BlockHash, BlockKeys
from pagedkv.core.store.index import PrefixIndex
from pagedkv.core.rules.kinds import HOSTED, Cached
from pagedkv.core.outputs.metadata import segments_of
from pagedkv.core.spec import RequestSpec
from pagedkv.core.store.state import KVState
from pagedkv.core.store.tails import pack_ids


@dataclass(frozen=True, slots=True)
class Hit:
    num_blocks: int  # common hit length in blocks
    hashes: tuple[tuple[BlockHash, ...], ...]  # per row: chain hashes of the hit blocks
    ids: tuple[tuple[tuple[int, ...], ...], ...]  # per row, per group: hit block ids (0 = null)
    full_blocks: int = 0  # the full-attention groups' hit alone, before window and state groups cut it back


def find_hit(state: KVState, spec: RequestSpec, *, drop_last_block: bool = False) -> Hit:
    """The longest hit of ``spec`` in the prefix cache, common to all its rows (module docstring).

    ``drop_last_block``: vLLM's lookup for an EAGLE drafter (its ``use_eagle`` block drop, for a drafter
    whose KV at a block's last position depends on the token after it, which a later request need not
    share): the full-attention groups match up to one block past the limit and give the last block back;
    each window group, the first time it searches a candidate, holds one block past it too and gives it back.
    """
    cfg = state.config
    rows = spec.rows
    ngroups = len(cfg.groups)
    if not cfg.enable_prefix_caching or any(r.tokens is None and not r.block_hashes for r in rows) or spec.max_hit == 0:
        return Hit(0, ((),) * len(rows), (((),) * ngroups,) * len(rows))
    try:
        chains, on_device = _full_chains(state, spec, drop_last_block)
    except (OverflowError, TypeError, ValueError):  # ids, keys or lengths no admission takes: no hit
        return Hit(0, ((),) * len(rows), (((),) * ngroups,) * len(rows))
    hit = len(chains[-1])  # each row's chain stops at the shortest before it
    if drop_last_block and hit:
        hit -= 1
    if not hit:  # the common case: the first block already misses
        return Hit(0, ((),) * len(rows), (((),) * ngroups,) * len(rows))
    full_blocks = hit
    hit = _reconcile(state, chains, hit, spec, drop_last_block)
    bs, cache = cfg.block_size, state.cache

    # A hit never splits a request's rows into different segment structures: rows
    # that could share one forward from position 0 (CFG branches) still can.
    def structure(row_index: int, n: int) -> tuple[bool, ...]:
        row = rows[row_index]
        return tuple(seg.causal for seg in segments_of(row.spans, row.num_tokens, n * bs))

    if len(rows) > 1 and len({structure(r, 0) for r in range(len(rows))}) == 1:
        while hit and len({structure(r, hit) for r in range(len(rows))}) > 1:
            hit -= 1
    ids = []
    for chain, device in zip(chains, on_device):
        beyond = frozenset(chain[device:hit]) if device < hit else None  # (the full groups' past the device's end)
        per_group = []
        for g, rules in enumerate(cfg.rules):
            view = _beyond(cache, g, beyond) if rules.full_hit and beyond else _cached_in(state, g)
            per_group.append(rules.hit_ids(view, chain, hit, bs))
        ids.append(tuple(per_group))
    return Hit(hit, tuple(tuple(c[:hit]) for c in chains), tuple(ids), full_blocks)


def _reconcile(state: KVState, chains: list[list[BlockHash]], full: int, spec: RequestSpec, drop: bool) -> int:
    """The hit the window and state groups allow, at most the full groups' ``full`` blocks, as vLLM's
    coordinator finds it: each kind of group in turn takes the longest hit it holds within the candidate,
    until a pass shortens it no more (one pass beside a single kind). Under ``drop`` a window kind, the first
    time it searches a candidate, must hold the block after its hit too (vLLM's EAGLE drop, once per candidate
    length: a kind that shortens the candidate without it lets the others drop again)."""
    cfg = state.config
    bs = cfg.block_size
    kinds: dict[tuple[object, ...], list[int]] = {}  # groups of one spec are searched together, as vLLM's
    for g, rules in enumerate(cfg.rules):
        if not rules.full_hit:
            kinds.setdefault(rules.search_key, []).append(g)
    if not kinds:
        return full
    searches = list(kinds.values())
    simple = len(searches) == 1
    length = _cap_tokens(spec, bs)  # vLLM's candidate, in tokens (the scheduler's cap to start with)
    verified: set[int] = set()
    while True:
        curr = min(length, full * bs)
        for k, groups in enumerate(searches):
            peek = drop and k not in verified and cfg.rules[groups[0]].eagle_margin
            n = min(curr // bs, len(chains[-1]) - 1) if peek else curr // bs
            while n and not _holds(state, chains, groups, n, peek):
                n -= 1
            if peek:
                verified.add(k)
            elif n * bs < curr:
                verified.clear()
            curr = n * bs
        if curr >= length or simple:
            return curr // bs
        length = curr


def _cap_tokens(spec: RequestSpec, bs: int) -> int:
    """The longest hit any row allows, in tokens."""
    cap = min((r.prefix_len // bs * bs if r.prefix_len is not None else r.num_tokens - 1) for r in spec.rows)
    return cap if spec.max_hit is None else min(cap, spec.max_hit)


def _holds(state: KVState, chains: list[list[BlockHash]], groups: list[int], n: int, peek: bool) -> bool:
    """Do ``groups`` (one kind) hold a hit of ``n`` blocks for every row: a window group every block a query at
    the boundary can see (and the block after it, under ``peek``), a state group a state saved where the hit
    ends, a different one for each row (it is taken over)."""
    cfg = state.config
    return all(cfg.rules[g].holds(_cached_in(state, g), chains, n, peek, cfg.block_size) for g in groups)


def _cached_in(state: KVState, g: int) -> Cached:
    """Group ``g``'s view of the prefix cache: a chain hash's block on the device, else ``HOSTED`` where the host
    tier holds it, or None."""
    cache = state.cache
    if not state.config.host_blocks:
        get = cache.group_map(g).get  # (read while find_hit runs, which writes nothing)
        if not state.config.cache_duplicates:  # (one block a content: every value a block id)
            return get
        return lambda h: b[0] if type(b := get(h)) is tuple else b
    tier = state.host  # (read through the version: the closure may outlive a write to the tier)

    def cached(h: BlockHash) -> int | None:
        b = cache.get((g, h))
        return b if b is not None else HOSTED if (g, h) in tier else None

    return cached


def _beyond(cache: PrefixIndex, g: int, hosted: frozenset[BlockHash]) -> Cached:
    """A full group's view past a row's device hit: every position the full groups do not all hold on the device
    is loaded from the tier (``hosted``), whichever of them holds it."""
    return lambda h: HOSTED if h in hosted else cache.get((g, h))


def _full_chains(state: KVState, spec: RequestSpec, drop: bool = False) -> tuple[list[list[BlockHash]], list[int]]:
    """Per row, the hashes of its leading blocks that every full-attention group has cached (under ``drop``,
    one block past the limit when the row's ids fill it); a row's chain is never longer than the one before
    it (the hit is common to all rows). With a host tier a chain runs on through blocks the tier holds for every
    group, once the device's end; per row, how many of its chain's blocks are on the device."""
    cfg, cache = state.config, state.cache
    tier = state.host if cfg.host_blocks else None
    on_device: list[int] = []
    bs = cfg.block_size
    full = [g for g, rules in enumerate(cfg.rules) if rules.full_hit]  # full attention, MLA
    maps = [cache.group_map(g) for g in full]  # (read here only: nothing writes the index while the chain is walked)
    only = maps[0] if len(maps) == 1 else None
    chains: list[list[BlockHash]] = []
    limit: int | None = None if spec.max_hit is None else spec.max_hit // bs + drop
    keys = BlockKeys.of(spec.extra_keys, content=spec.content, first=spec.first_block_keys, kind=cfg.block_hash)
    plain = None if keys.varies else keys.plain  # (most requests: every block hashes the same keys)
    hash_packed = cfg.hash_fn
    width = bs << 3  # bytes of one block's packed ids
    ahead = cfg.hash_lookahead  # a block's hash covers the ids after it: a block before them only
    for row in spec.rows:
        if row.tokens is None and not row.block_hashes:
            raise InvariantError("a row hashed for a hit has token ids or its caller's hashes")
        # (placeholders have no ids to hash; a row of a count is keyed only where its caller's hashes reach)
        tokens = row.tokens if row.tokens is not None else ()
        known = row.known if row.tokens is not None else len(row.block_hashes) * bs
        cap = min((row.prefix_len if row.prefix_len is not None else row.num_tokens - 1), known) // bs
        if drop:  # the block the hit gives back, where the row's ids fill it
            cap = min(cap + 1, known // bs)
        if ahead:
            cap = min(cap, (known - ahead) // bs)
        if limit is not None:
            cap = min(cap, limit)  # the common boundary is never past the shortest row's hit
        chain: list[BlockHash] = []
        device: int | None = None  # the first position the host tier holds, once the device's end
        parent = cache.root
        given = spec.block_hashes if len(spec.rows) == 1 else ()  # (one row's, the caller's: taken or checked)
        taken = 0 if cfg.check_given_hashes else len(given)  # blocks whose hash is the caller's
        if row.block_hashes:  # (another scheme than the core's: taken, never checked)
            given, taken = row.block_hashes, len(row.block_hashes)
        packed = b""  # (the ids past the caller's hashes, packed as the chain first needs them: a block at a time)
        for j in range(cap):
            if j < taken:
                h = given[j]
            else:
                k = j - min(taken, cap)
                if (k + 1) * width > len(packed):  # (doubling: a chain that runs on costs its length, once)
                    start = min(taken, cap) * bs
                    packed = pack_ids(tokens[start : start + max(2 * (k + 1), 4) * bs + ahead])
                if ahead:
                    h = hash_packed(
                        parent,
                        packed[k * width : (k + 1) * width],
                        keys.ahead(j, bs, tuple(tokens[(j + 1) * bs : (j + 1) * bs + ahead])),
                    )
                else:
                    h = hash_packed(
                        parent, packed[k * width : (k + 1) * width], keys.at(j, bs) if plain is None else plain
                    )
            if taken <= j < len(given) and given[j] != h:  # (a given hash checked: check_given_hashes)
                raise GivenHashError(j, h)
            if device is None and (h in only if only is not None else all(h in m for m in maps)):
                pass
            elif tier is not None and all((g, h) in tier for g in full):  # (in the host tier: loaded at admission)
                device = len(chain) if device is None else device
            else:
                break
            chain.append(h)
            parent = h
        chains.append(chain)
        on_device.append(len(chain) if device is None else device)
        limit = len(chain)
    return chains, on_device
