"""Commit: tokens whose KV the forward wrote.

With prefix caching, each newly full computed block is hashed (chained, with
the request's extra keys) and enters the index once per content; in windowed
groups, blocks no future query can see are let go (the null block takes their
place) and the request takes a generation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from returns.result import Failure, Result, Success

import pagedkv.core.pool as pool
from pagedkv.core.effects import Committed
from pagedkv.core.errors import ErrorCode, KVError, RequestId, invalid, is_int, is_request_id, shown
from pagedkv.core.events import BlockRemoved, BlockStored
from pagedkv.core.state import KVState, Request, Row, Step
from pagedkv.core.tails import unpack_ids, known_ids
from pagedkv.core.txn import Txn


def commit(state: KVState, request_id: RequestId, computed: Sequence[int]) -> Result[Step[Committed], KVError]:
    """Mark tokens computed: ``computed[i]`` is row i's absolute count, never decreasing.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(6),))).unwrap().state
    >>> commit(s, "a", [6]).unwrap().effect.generation is None
    True
    >>> commit(s, "a", [7]).failure().code.value
    'INVALID'
    """
    txn = Txn(state)
    result = _commit_one(txn, request_id, computed)
    if isinstance(result, KVError):
        return Failure(result)
    return Success(Step(txn.done(), result))


def cache_ahead(state: KVState, request_id: RequestId, through: Sequence[int]) -> Result[Step[Committed], KVError]:
    """vLLM's caching point (``CacheConfig.caching_point="schedule"``): each row's full blocks before
    ``through[i]`` (with known token ids) enter the prefix cache now, when the step that computes them is
    planned, so a request admitted later in the same step can hit them (its forward reads them as the same
    forward writes them). Nothing is computed; ``commit`` later hashes nothing twice. A request that ends
    with reason ``error`` takes these entries out again (their KV may never have been written).

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True,
    ...                               caching_point="schedule"))
    >>> s = admit(s, RequestSpec("a", (RowSpec.of_tokens(list(range(10))),))).unwrap().state
    >>> len(cache_ahead(s, "a", [10]).unwrap().state.cache)
    2
    """
    result = cache_ahead_many(state, ((request_id, through),))
    return result.map(lambda step: Step(step.state, step.effect[0]))


def cache_ahead_many(
    state: KVState, items: Iterable[tuple[RequestId, Sequence[int]]]
) -> Result[Step[tuple[Committed, ...]], KVError]:
    """Several ``cache_ahead`` as one transition (the blocks a step's decode tokens fill): all, in order, or none."""
    if state.config.caching_point != "schedule":
        return Failure(invalid('cache_ahead needs CacheConfig(caching_point="schedule")', field="op"))
    txn = Txn(state)
    effects = []
    for rid, through in items:
        first = len(txn.events)
        err = _ahead_one(txn, rid, through)
        if err is not None:
            return Failure(err)
        effects.append(Committed(rid, None, 0, tuple(txn.events[first:])))
    return Success(Step(txn.done(), tuple(effects)))


def _ahead_one(txn: Txn, request_id: RequestId, through: Sequence[int]) -> KVError | None:
    base = txn.base
    req = base.requests.get(request_id) if is_request_id(request_id) else None
    if req is None:
        return KVError(ErrorCode.UNKNOWN_REQUEST, f"request {shown(request_id)} is not admitted", request=request_id)
    if not isinstance(through, (list, tuple)) or len(through) != len(req.slots):
        return invalid(f"cache_ahead of request {shown(request_id)} must give one count per row "
                       f"({len(req.slots)})", request=request_id, field="through")  # fmt: skip
    for i, (slot, t) in enumerate(zip(req.slots, through)):
        if not is_int(t) or not txn.row_computed[slot] <= t <= txn.row_len[slot]:
            return invalid(f"request {shown(request_id)} row {i}: through must be an integer in "
                           f"[{txn.row_computed[slot]}, {txn.row_len[slot]}], got {shown(t)}",
                           request=request_id, field="through")  # fmt: skip
    if base.config.enable_prefix_caching and req.cache_epoch == base.cache_epoch:
        for i, (slot, t) in enumerate(zip(req.slots, through)):
            _cache_full_blocks(txn, req, i, slot, t)
    return None


def forget_ahead(txn: Txn, req: Request) -> None:
    """A request that ends with reason ``error`` under the ``schedule`` caching point: the cache entries of
    its blocks past what it computed go (the failed step may never have written their KV)."""
    bs = txn.config.block_size
    for slot in req.slots:
        record = txn.rows[slot]
        for j in range(txn.row_computed[slot] // bs, record.num_hashed):
            h = record.hash_at(j)
            for g, ids in enumerate(record.blocks):
                b = ids[j] if j < len(ids) else 0
                if b and txn.index.key_of(b) == (g, h):
                    txn.index.evict(b)
                    txn.events.append(BlockRemoved(h, g, b))


def commit_many(
    state: KVState, items: Iterable[tuple[RequestId, Sequence[int]]]
) -> Result[Step[tuple[Committed, ...]], KVError]:
    """Several commits as one transition (a step's outputs): all of them, in order, or none."""
    txn = Txn(state)
    effects = []
    for rid, computed in items:
        result = _commit_one(txn, rid, computed)
        if isinstance(result, KVError):
            return Failure(result)
        effects.append(result)
    return Success(Step(txn.done(), tuple(effects)))


def _commit_one(txn: Txn, request_id: RequestId, computed: Sequence[int]) -> KVError | Committed:
    if not is_request_id(request_id):
        return invalid(f"request id must be a string or a 64-bit integer, got {shown(request_id)}", field="request")
    base = txn.base
    req = base.requests.get(request_id)
    if req is None:
        return KVError(ErrorCode.UNKNOWN_REQUEST, f"request {shown(request_id)} is not admitted", request=request_id)
    if not isinstance(computed, (list, tuple)) or len(computed) != len(req.slots):
        return invalid(f"commit of request {shown(request_id)} must give one count per row ({len(req.slots)})",
                       request=request_id, field="computed")  # fmt: skip
    for i, (slot, c) in enumerate(zip(req.slots, computed)):
        before, seq_len = txn.row_computed[slot], txn.row_len[slot]
        if not is_int(c) or not before <= c <= seq_len:
            return invalid(
                f"request {shown(request_id)} row {i}: computed must be an integer in [{before}, {seq_len}], got {shown(c)}",
                request=request_id, field="computed")  # fmt: skip
    first_event = len(txn.events)
    caching = base.config.enable_prefix_caching and req.cache_epoch == base.cache_epoch
    windowed = any(g.is_windowed for g in base.config.groups)
    dropped: list[tuple[int, int, int, int]] = []  # (position, row, group, block) a window let go
    for i, (slot, c) in enumerate(zip(req.slots, computed)):
        txn.row_computed[slot] = c
        if caching:
            _cache_full_blocks(txn, req, i, slot, c)
        if windowed:
            _drop_invisible(txn, req, i, slot, c, dropped)
    gen = None
    before_free = txn.free_blocks
    if dropped:
        if base.config.free_queue == "vllm":  # group by group, as vLLM's coordinator lets them go
            for g in sorted({d[2] for d in dropped}):
                pool.unref_many(txn, [d[3] for d in sorted(dropped, key=lambda d: (-d[0], d[1])) if d[2] == g])
        else:
            dropped.sort(key=lambda d: (-d[0], d[1], d[2]))  # tail first, as release does
            pool.unref_many(txn, [b for _, _, _, b in dropped])
        gen = txn.next_generation()
        txn.row_generation[req.slots[0]] = gen
    return Committed(request_id, gen, txn.free_blocks - before_free, tuple(txn.events[first_event:]))


def _token_span(record: Row, tail: bytes | None, start: int, end: int) -> bytes:
    """The packed token ids of positions ``[start, end)`` of a row, from its ids and its tail."""
    assert record.ids is not None
    c = record.chunked
    if end <= c:
        blob = record.ids[start << 3 : end << 3]
    elif start >= c:
        blob = (tail or b"")[(start - c) << 3 : (end - c) << 3]
    else:
        blob = record.ids[start << 3 :] + (tail or b"")[: (end - c) << 3]
    return blob


def _cache_full_blocks(txn: Txn, req: Request, i: int, slot: int, computed: int) -> None:
    """Put row i's newly full computed blocks into the cache index (once per content)."""
    record = txn.rows[slot]
    new = _hash_full_blocks(txn, req, i, slot, computed, record, txn.row_tail[slot])
    if new is not record:
        txn.rows[slot] = new


def _hash_full_blocks(txn: Txn, req: Request, i: int, slot: int, computed: int, record: Row,
                      tail: bytes | None) -> Row:  # fmt: skip
    """Hash row i's full computed blocks not hashed yet, cache each content once; the new record."""
    if record.ids is None:
        return record
    cfg = txn.config
    bs = cfg.block_size
    ahead = cfg.hash_lookahead  # ids after a block its hash covers: they must be known too
    known = known_ids(record, tail)  # a block is hashed only over known ids (placeholders await theirs)
    layout = req.layouts[i]
    cacheable = layout.prefix_len if layout.prefix_len is not None else txn.row_len[slot]
    full = min(computed, cacheable, known - ahead) // bs
    done = record.num_hashed
    if full <= done:
        return record
    if ahead:
        return _hash_ahead(txn, req, record, tail, done, full)
    blocks = record.blocks
    states = cfg.state_group_set
    parent = record.hashes[-record.hw :] if done else txn.base.cache.root
    hash_packed = cfg.hash_fn
    new = [record.hashes]
    add = txn.index.add
    events = txn.events
    keys = req.keys
    plain = None if keys.varies else keys.plain  # (most requests: every block hashes the same keys)
    span = _token_span(record, tail, done * bs, full * bs)  # the packed ids of every block to hash
    ids = unpack_ids(span)  # (the events carry them as ints)
    width = bs << 3
    for j in range(done, full):
        i = j - done
        h = hash_packed(parent, span[i * width : (i + 1) * width], keys.at(j, bs) if plain is None else plain)
        for g, group_blocks in enumerate(blocks):
            b = group_blocks[j]
            # not let go already, not cached already, and no other block holds the same content; a state
            # group's block is the row's live state (cached only when the row ends on this boundary)
            if b and (not states or g not in states) and add(g, h, b):
                events.append(BlockStored(h, parent if j else None, ids[i * bs : (i + 1) * bs], g, b,
                                          keys.every if plain is not None else keys.raw(j, bs)))  # fmt: skip
        new.append(h)
        parent = h
    return record.with_hashes(b"".join(new))


def _hash_ahead(txn: Txn, req: Request, record: Row, tail: bytes | None, done: int, full: int) -> Row:
    """``_hash_full_blocks`` when each hash also covers the ``hash_lookahead`` ids after its block (vLLM's
    EAGLE lookahead hashes: a drafter's KV at a block's last position depends on them)."""
    cfg = txn.config
    bs, ahead = cfg.block_size, cfg.hash_lookahead
    blocks = record.blocks
    parent = record.hashes[-record.hw :] if done else txn.base.cache.root
    hash_packed = cfg.hash_fn
    new = [record.hashes]
    add = txn.index.add
    keys = req.keys
    span = _token_span(record, tail, done * bs, full * bs + ahead)
    ids = unpack_ids(span)
    width = bs << 3
    for j in range(done, full):
        i = j - done
        following = ids[(i + 1) * bs : (i + 1) * bs + ahead]
        h = hash_packed(parent, span[i * width : (i + 1) * width], keys.ahead(j, bs, following))
        for g, group_blocks in enumerate(blocks):
            b = group_blocks[j]
            if b and add(g, h, b):
                txn.events.append(BlockStored(h, parent if j else None, ids[i * bs : (i + 1) * bs], g, b,
                                              keys.raw(j, bs, ahead), following))  # fmt: skip
        new.append(h)
        parent = h
    return record.with_hashes(b"".join(new))


def save_states(txn: Txn, req: Request) -> None:
    """A request that ends (not by error) leaves each row's state cached where it stands, when its computed
    tokens end on a block boundary whose hash the row knows: under that block's chain hash, for a later
    request with the same leading tokens to take over (``prefix.find_hit``). Call before its blocks go."""
    cfg = txn.config
    states = cfg.state_group_set
    if not states or not cfg.enable_prefix_caching or req.cache_epoch != txn.base.cache_epoch:
        return
    bs = cfg.block_size
    for slot in req.slots:
        computed, record = txn.row_computed[slot], txn.rows[slot]
        j = computed // bs - 1
        if computed % bs or j < 0 or record.num_hashed <= j:
            continue
        h = record.hash_at(j)
        parent = record.hash_at(j - 1) if j else None
        ids = unpack_ids(_token_span(record, txn.row_tail[slot], j * bs, (j + 1) * bs))
        for g in sorted(states):
            b = record.blocks[g][-1]
            if b and txn.index.add(g, h, b):
                txn.events.append(BlockStored(h, parent, ids, g, b, req.keys.raw(j, bs)))


def _drop_invisible(txn: Txn, req: Request, i: int, slot: int, computed: int,
                    dropped: list[tuple[int, int, int, int]]) -> None:  # fmt: skip
    """Null the blocks of row i that no future query of a windowed group can see.

    Future queries start at ``computed`` (a diffusion row: at ``prefix_len``
    too, since every denoising step recomputes its target). The null positions
    of a group are always a prefix of its list, so the scan walks back from the
    new boundary only over blocks still held.
    """
    cfg = txn.config
    layout = req.layouts[i]
    future = min(computed, layout.prefix_len) if layout.prefix_len is not None else computed
    record = txn.rows[slot]
    groups = list(record.blocks)
    changed = False
    for g, gs in enumerate(cfg.groups):
        first = gs.first_visible_block(future, cfg.block_size)
        ids = groups[g]
        j = first - 1
        while j >= 0 and ids[j]:
            dropped.append((j, i, g, ids[j]))
            j -= 1
        if j < first - 1:
            groups[g] = (0,) * first + ids[first:]
            changed = True
    if changed:
        txn.rows[slot] = record.with_blocks(tuple(groups))
