"""The invariants every reachable state keeps, as one pure check.

Used by the state-machine tests after every step and by the model checker in
every state it explores. Returns what is broken (empty when all hold); it never
raises on a broken state, so a checker can report it with its trace.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.config import GroupSpec
from pagedkv.core.outputs.effects import events_of
from pagedkv.core.outputs.events import BlockOffloaded, BlockOnloaded, BlockRemoved, BlockStored
from pagedkv.core.errors import shown
from pagedkv.core.rules.kinds import HOSTED, GroupKind
from pagedkv.core.rules.prefix import find_hit
from pagedkv.core.spec import RequestSpec, check_request_spec
from pagedkv.core.store.state import KVState, Request
from pagedkv.core.store.tails import CHUNK, Awaiting, known_ids


def _lowest_visible(group: GroupSpec, future: int) -> int:
    """The first position a query at ``future`` or later reads. Written out here on purpose,
    apart from ``KindRules.first_visible_block``, so that a bug there cannot hide from this check."""
    if group.kind is GroupKind.SLIDING_WINDOW and group.window is not None:
        return future - group.window + 1
    if group.kind is GroupKind.CHUNKED_LOCAL and group.chunk is not None:
        return future // group.chunk * group.chunk
    if group.kind is GroupKind.MAMBA_ALIGN:  # the state the next token's forward reads
        return future - 1
    return 0


def check_invariants(state: KVState) -> list[str]:
    """Violations of the pool, cache and window invariants; ``[]`` when all hold.

    >>> from pagedkv.core import CacheConfig, initial_state
    >>> check_invariants(initial_state(CacheConfig(block_size=4, num_blocks=9)))
    []
    """
    bad: list[str] = []
    held = [0] * state.config.num_blocks  # references the rows hold, per block
    for rid, req in state.requests.items():
        for i, slot in enumerate(req.slots):
            where = f"request {shown(rid)} row {i}"
            length, computed = state.row_len[slot], state.row_computed[slot]
            if not 0 <= computed <= length:
                bad.append(f"{where}: computed {computed} outside [0, {length}]")
            layout = req.layouts[i]
            future = min(computed, layout.prefix_len) if layout.prefix_len is not None else computed
            _token_ids(state, slot, where, bad)
            _hashed(state, req, i, slot, where, bad)
            _row_blocks(state, slot, where, future, held, bad)
    _free_queue(state, held, bad)
    _cache_index(state, bad)
    _host_tier(state, bad)
    return bad


def _host_tier(s: KVState, bad: list[str]) -> None:
    """The host tier: within its capacity, each entry its own slot among those handed out, its LRU order the
    entries' ticks one for one, no tick below ``oldest`` nor from the future; empty without a tier. Its use table
    (``host_store_threshold``) likewise: within its size, counts up to the threshold, its own ticks."""
    tier, cap = s.host, s.config.host_blocks
    slots = [slot for slot, _ in tier.entries.values()]
    ticks = {tick: key for key, (_, tick) in tier.entries.items()}
    if len(tier) > cap or not 0 <= tier.next_slot <= cap:
        bad.append(f"host tier: {len(tier)} entries, {tier.next_slot} slots handed out, capacity {cap}")
    held = [*slots, *tier.spare]
    if len(set(held)) != len(held) or any(not 0 <= x < tier.next_slot for x in held):
        bad.append("host tier: two entries (or an entry and a spare slot) share a slot, or one was never handed out")
    if dict(tier.by_tick.items()) != ticks or any(not tier.oldest <= t < tier.next_tick for t in ticks):
        bad.append("host tier: its LRU order is not its entries' ticks")
    uses, threshold = tier.uses, s.config.host_store_threshold
    use_ticks = {tick: h for h, (_, tick) in uses.items()}
    if uses and (threshold < 2 or len(uses) > s.config.host_tracker_size):
        bad.append(f"host tier: {len(uses)} contents in the use table (threshold {threshold}, size "
                   f"{s.config.host_tracker_size})")  # fmt: skip
    if any(not 1 <= n <= threshold for n, _ in uses.values()) or (
        dict(tier.uses_by_tick.items()) != use_ticks
        or any(not tier.uses_oldest <= t < tier.next_tick for t in use_ticks)
        or set(use_ticks) & set(ticks)
    ):
        bad.append("host tier: a use count outside [1, threshold], or the use table's LRU order not its ticks")


def _token_ids(s: KVState, slot: int, where: str, bad: list[str]) -> None:
    """A row's token ids and hashes: whole, and no more ids than tokens."""
    record, tail, length = s.rows[slot], s.row_tail[slot], s.row_len[slot]
    if (
        record.hw != s.config.hash_width
        or len(record.hashes) % record.hw
        or (record.ids is not None and any(len(c) % 8 for c in record.ids))
    ):
        bad.append(f"{where}: ids or hashes that are not whole")
    if record.ids and (any(len(c) != CHUNK for c in record.ids[:-1]) or not record.ids[-1]):
        bad.append(f"{where}: ids in chunks of other sizes than {CHUNK} bytes, the last one short and not empty")
    if tail is not None and (record.ids is None or len(tail) % 8):
        bad.append(f"{where}: a token tail without token ids, or not whole ids")
    elif record.ids is not None:
        known = record.chunked + (len(tail) // 8 if tail is not None else 0)
        if known > length:
            bad.append(f"{where}: {known} known token ids for {length} tokens")
        elif tail is not None and (known < length) != (type(tail) is Awaiting):
            bad.append(
                f"{where}: {known} known ids of {length}, but the tail says "
                f"{'positions await ids' if type(tail) is Awaiting else 'none await'}"
            )
        elif tail and (known - 1) // s.config.block_size != record.chunked // s.config.block_size:
            bad.append(f"{where}: the token tail reaches past the row's last block")
        ahead = s.config.hash_lookahead if record.num_hashed else 0  # (and the ids after its block)
        if record.num_hashed * s.config.block_size + ahead > known:  # a hash covers only ids it was computed over
            bad.append(f"{where}: {record.num_hashed} blocks hashed, but only {known} positions have known ids")


def _hashed(s: KVState, req: Request, i: int, slot: int, where: str, bad: list[str]) -> None:
    """Every full block a caching row has computed, with its ids known (and the lookahead's), is hashed (a row
    whose KV arrives from elsewhere, ``pending_tokens``, caches on its own terms: not judged here)."""
    cfg, record = s.config, s.rows[slot]
    given = req.given[i] if req.given else ()
    if not cfg.enable_prefix_caching or req.cache_epoch != s.cache_epoch or record.pending[0]:
        return
    if record.ids is None and not given:
        return
    if record.ids is None and record.num_hashed > len(given):
        bad.append(f"{where}: {record.num_hashed} blocks hashed, past the {len(given)} its caller's hashes key")
    layout = req.layouts[i]
    cacheable = layout.prefix_len if layout.prefix_len is not None else s.row_len[slot]
    # (a row of a count: where its caller's hashes reach)
    known = known_ids(record, s.row_tail[slot]) if record.ids is not None else len(given) * cfg.block_size
    ahead = cfg.hash_lookahead  # (a block hashes once its lookahead ids are known, at the next commit or fill)
    full = min(s.row_computed[slot] - ahead, cacheable, known - ahead) // cfg.block_size
    if record.num_hashed < full:
        bad.append(f"{where}: {full} full computed blocks, only {record.num_hashed} hashed")


def _row_blocks(s: KVState, slot: int, where: str, future: int, held: list[int], bad: list[str]) -> None:
    """A row's block lists: one block a ``block_size`` tokens, the null block exactly where no query
    sees, and every cached block carrying the hash this row computed there."""
    cfg, record, length = s.config, s.rows[slot], s.row_len[slot]
    hashes = [record.hash_at(j) for j in range(record.num_hashed)]
    for g, ids in enumerate(record.blocks):
        if len(ids) != cfg.blocks_for(length):
            bad.append(f"{where} group {g}: {len(ids)} blocks for {length} tokens")
        if cfg.groups[g].kind is GroupKind.MAMBA:
            _state_blocks(s, ids, g, where, held, bad)
            continue
        lowest = _lowest_visible(cfg.groups[g], future)
        aligned = cfg.groups[g].kind is GroupKind.MAMBA_ALIGN  # (null between its state blocks; one at the last)
        for j, b in enumerate(ids):
            if not 0 <= b < cfg.num_blocks:
                bad.append(f"{where} group {g}: block id {b} out of range")
                continue
            if aligned and (b or j == len(ids) - 1) and (b != 0) != ((j + 1) * cfg.block_size - 1 >= lowest):
                what = "no state block at its last position" if b == 0 else "a state no forward reads again"
                bad.append(f"{where} group {g} position {j}: {what}")
            elif not aligned and (b != 0) != ((j + 1) * cfg.block_size - 1 >= lowest):
                what = "the null block in its live range" if b == 0 else "a block no query can see"
                bad.append(f"{where} group {g} position {j}: {what}")
            if b:
                held[b] += 1
                key = s.cache.key_of(b)
                if j >= len(hashes) and key is not None:
                    bad.append(
                        f"{where} group {g} position {j}: block {b} carries a hash its row never computed "
                        "(a stale cache entry)"
                    )
                elif j < len(hashes) and key is not None and key != (g, hashes[j]):
                    bad.append(f"{where} group {g} position {j}: block {b} carries another prefix's hash")


def _state_blocks(s: KVState, ids: tuple[int, ...], g: int, where: str, held: list[int], bad: list[str]) -> None:
    """A state group's list: the row's one state block at its last position, the null block before it, the
    block held by this row alone and in no cache entry (a live state is rewritten, so never hit)."""
    if not ids:
        return
    for j, b in enumerate(ids[:-1]):
        if b:
            bad.append(f"{where} group {g} position {j}: a state group holds block {b} before its last position")
            if 0 <= b < s.config.num_blocks:
                held[b] += 1
    b = ids[-1]
    if not 0 < b < s.config.num_blocks:
        bad.append(f"{where} group {g}: no state block at its last position (block {b})")
        return
    held[b] += 1
    if s.refcount[b] != 1:
        bad.append(f"{where} group {g}: state block {b} has refcount {s.refcount[b]}; a state is never shared")
    if s.cache.key_of(b) is not None:
        bad.append(f"{where} group {g}: live state block {b} carries a cache hash (a hit would read a moving state)")


def _free_queue(s: KVState, held: list[int], bad: list[str]) -> None:
    """The free queue: no cycle, each block once, its count kept, and free exactly when unreferenced."""
    n = s.config.num_blocks
    free: list[int] = []
    b = s.free_next[0]
    while b and len(free) < n:
        free.append(b)
        b = s.free_next[b]
    if b:
        bad.append("the free queue has a cycle")
    in_free = set(free)
    if len(in_free) != len(free):
        bad.append("a block is in the free queue twice")
    if len(free) != s.free_blocks:
        bad.append(f"free_blocks is {s.free_blocks} but the free queue holds {len(free)}")
    if 0 in in_free or s.refcount[0] != 0:
        bad.append("the null block is free or referenced")
    for blk in range(1, n):
        if s.refcount[blk] != held[blk]:
            bad.append(f"block {blk}: refcount {s.refcount[blk]}, {held[blk]} references held")
        if (blk in in_free) == (held[blk] > 0):
            bad.append(f"block {blk} is {'both free and referenced' if held[blk] else 'neither free nor referenced'}")


def _cache_index(s: KVState, bad: list[str]) -> None:
    """The prefix index and the blocks' own keys agree, both ways."""
    entries = 0
    for key, blk in s.cache.items():
        entries += 1
        if s.cache.key_of(blk) != key:
            bad.append(f"cached hash of group {key[0]} maps to block {blk}, which does not carry it")
    if entries != len(s.cache):
        bad.append(f"the cache index counts {len(s.cache)} entries but holds {entries}")
    if s.cache.cached_blocks() != entries:
        bad.append("a block carries a hash the cache index lost")


def admission_violations(
    before: KVState, spec: RequestSpec, after: KVState | None, refused: str | None, *, checked: bool = False
) -> list[str]:
    """An admission's outcome judged by a count written out here, apart from admission's own: the blocks
    the request holds alone (every group of every row, from the first position it computes on: its hit or
    the KV that arrives from elsewhere; a hit block shared by rows once, one of the host tier's a fresh block)
    and those it takes from the free
    queue. A refusal for good (``UNSCHEDULABLE``) must mean it cannot run alone in the pool; a refusal for
    capacity, that the free blocks are too few; a success, that it took exactly those blocks. ``checked``: the
    spec is known well formed (the checker's alphabet checks each once), as admit's.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> spec = RequestSpec("a", (RowSpec(12),))
    >>> admission_violations(s, spec, admit(s, spec).unwrap().state, None)
    []
    """
    if not checked and check_request_spec(spec) is not None:
        return []  # malformed: INVALID, judged by the spec's own checks
    cfg, rid, bs = before.config, spec.request_id, before.config.block_size
    hit = find_hit(before, spec)  # (the lookup itself is judged by the cache invariants)
    cached = hit.num_blocks * bs
    own, shared = 0, set()
    for row, ids in zip(spec.rows, hit.ids):
        start = max(cached, row.pending_tokens)
        start = min(start, row.prefix_len) if row.prefix_len is not None else start
        for g, group in enumerate(cfg.groups):
            if group.kind is GroupKind.MAMBA:
                own += 1  # its state: fresh, or a saved one taken over
                continue
            lowest = _lowest_visible(group, start)
            nb = -(-row.num_tokens // bs)
            for j in range(nb):
                if group.kind is GroupKind.MAMBA_ALIGN and hit.num_blocks <= j < nb - 1:
                    continue  # (an align-mode state group takes a block at the last position only)
                if (j + 1) * bs - 1 >= lowest:  # a query from ``start`` on sees a position of block j
                    if j < len(ids[g]) and ids[g][j] != HOSTED:  # (one the host tier holds: into a fresh one)
                        shared.add(ids[g][j])
                    else:
                        own += 1
    alone = own + len(shared)
    taken = own + sum(1 for b in shared if before.refcount[b] == 0)
    within = (
        (cfg.max_rows_per_request is None or len(spec.rows) <= cfg.max_rows_per_request)
        and all(r.num_tokens <= cfg.length_limit for r in spec.rows)
        and rid not in before.requests
    )
    who = f"admit {shown(rid)}"
    if refused == "UNSCHEDULABLE" and within and alone <= cfg.usable_blocks:
        return [f"{who} refused for good, though alone it holds {alone} of {cfg.usable_blocks} usable blocks"]
    if refused == "NO_CAPACITY" and within and taken <= before.free_blocks:
        return [f"{who} refused for capacity, though it takes {taken} blocks and {before.free_blocks} are free"]
    if refused is None and after is not None:
        req = after.requests.get(rid)
        if req is None:
            return [f"{who} succeeded, but the request is not admitted"]
        held = {b for slot in req.slots for ids in after.rows[slot].blocks for b in ids if b}
        took = before.free_blocks - after.free_blocks
        if len(held) != alone or took != taken:
            return [f"{who} holds {len(held)} blocks, {took} from the free queue; the count says {alone} and {taken}"]
    return []


def copy_violations(state: KVState, effect: Any, after: KVState) -> list[str]:
    """A transition's host-tier copies (core/store/host.py) done in the order recorded, over what ``state`` held: each
    store reads a device block that holds the content it names (cached under it or cached earlier in the list, as a
    window's block a decode step caches, lets go and reuses; not loaded over nor evicted earlier), each load a slot
    that holds the content it names (the tier's entry, not written over earlier) into a block that a row of ``after``
    (the state the transition made) holds in the load's group, that row's alone; under ``host_store_threshold`` each
    store a content seen in that many uses (the new state's count; one a full use table dropped is passed over). A
    pool that reports no events shows no block cached in the transition: a store of a block not cached before is taken
    as it says there."""
    device: dict[int, Any] = {}  # block -> content, as the events so far left it
    slots: dict[int, Any] = {}  # slot -> content
    bad = []
    held_in: dict[int, set[int]] | None = None  # per group, the blocks the rows of ``after`` hold (made at a load)
    threshold, uses = state.config.host_store_threshold, after.host.uses
    for e in events_of(effect):
        if isinstance(e, BlockStored):
            device[e.block_id] = (e.group, e.block_hash)
        elif isinstance(e, BlockRemoved):
            device[e.block_id] = None
        elif isinstance(e, BlockOffloaded):
            held = device.get(e.block_id, state.cache.key_of(e.block_id))
            if held is None and e.block_id not in device and not state.config.kv_events:
                held = (e.group, e.block_hash)  # (cached in this transition, unseen where no events are reported)
            if held != (e.group, e.block_hash):
                bad.append(f"a store of block {e.block_id} to slot {e.host_slot}: the block holds {held}")
            slots[e.host_slot] = (e.group, e.block_hash)
            if threshold > 1:  # (a content the tier keeps was seen in that many uses: the new state's count)
                seen = uses.get(e.block_hash)
                if (seen[0] if seen else 0) < threshold and (seen or len(uses) < state.config.host_tracker_size):
                    bad.append(f"a store of block {e.block_id}: its content was seen in {seen[0] if seen else 0} "
                               f"uses, fewer than host_store_threshold {threshold}")  # fmt: skip
        elif isinstance(e, BlockOnloaded):
            was = state.host.entries.get((e.group, e.block_hash))
            held = slots.get(e.host_slot, (e.group, e.block_hash) if was and was[0] == e.host_slot else None)
            if held != (e.group, e.block_hash):
                bad.append(f"a load of slot {e.host_slot} into block {e.block_id}: the slot holds {held}")
            if held_in is None:
                held_in = {}
                for req in after.requests.values():
                    for x in req.slots:
                        for g, ids in enumerate(after.rows[x].blocks):
                            held_in.setdefault(g, set()).update(ids)
            if e.block_id not in held_in.get(e.group, ()) or after.refcount[e.block_id] != 1 or not e.block_id:
                bad.append(f"a load into block {e.block_id}: no row holds it alone in group {e.group}")
            device[e.block_id] = (e.group, e.block_hash)
    return bad
