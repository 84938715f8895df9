"""Commit: tokens whose KV the forward wrote.

With prefix caching, each newly full computed block is hashed (chained, with
the request's extra keys) and enters the index once per content; in windowed
groups, blocks no future query can see are let go (the null block takes their
place) and the request takes a generation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from returns.result import Failure, Result, Success

import pagedkv.core.rules.pool as pool
from pagedkv.core.outputs.effects import Committed
from pagedkv.core.errors import (
    ErrorCode,
    GivenHashError,
    KVError,
    RequestId,
    invalid,
    is_int,
    is_request_id,
    is_seq,
    pairs_of,
    shown,
)
from pagedkv.core.rules.caching import cache_full_blocks, cache_rows
from pagedkv.core.store.state import SLOT_SHIFT, KVState, Request, Step
from pagedkv.core.store.txn import Txn, each


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
    return commit_many(state, ((request_id, computed),)).map(lambda step: Step(step.state, step.effect[0]))


def cache_ahead(
    state: KVState, request_id: RequestId, through: Sequence[int], *, hashes: Sequence[bytes] | None = None
) -> Result[Step[Committed], KVError]:
    """vLLM's caching point (``CacheConfig.caching_point="schedule"``): each row's full blocks before
    ``through[i]`` (with known token ids) enter the prefix cache now, when the step that computes them is
    planned, so a request admitted later in the same step can hit them (its forward reads them as the same
    forward writes them). Nothing is computed; ``commit`` later hashes nothing twice. A request that ends
    with reason ``error`` takes these entries out again (their KV may never have been written). ``hashes``:
    the row's block hashes as the caller computed them (``cache_ahead_many``).

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True,
    ...                               caching_point="schedule"))
    >>> s = admit(s, RequestSpec("a", (RowSpec.of_tokens(list(range(10))),))).unwrap().state
    >>> len(cache_ahead(s, "a", [10]).unwrap().state.cache)
    2
    """
    given = None if hashes is None else {request_id: hashes}
    result = cache_ahead_many(state, ((request_id, through),), hashes=given)
    return result.map(lambda step: Step(step.state, step.effect[0]))


def cache_ahead_many(
    state: KVState,
    items: Iterable[tuple[RequestId, Sequence[int]]],
    *,
    hashes: Mapping[RequestId, Sequence[bytes]] | None = None,
) -> Result[Step[tuple[Committed, ...]], KVError]:
    """Several ``cache_ahead`` as one transition (the blocks a step's decode tokens fill): all, in order, or none.
    ``hashes``: a one-row request's chain hashes of its leading full blocks as the caller computed them (vLLM's
    ``request.block_hashes``), taken instead of hashing those blocks again (checked under
    ``CacheConfig(check_given_hashes=True)``)."""
    if state.config.caching_point != "schedule":
        return Failure(invalid('cache_ahead needs CacheConfig(caching_point="schedule")', field="op"))
    if hashes is None:
        return each(state, items, _ahead_one, "cache_ahead_many")
    if not isinstance(hashes, Mapping):
        return Failure(invalid(f"hashes must map request ids to block hashes, got {shown(hashes):.80}", field="hashes"))
    return each(
        state, items, lambda txn, rid, through: _ahead_one(txn, rid, through, hashes.get(rid)), "cache_ahead_many"
    )


def _ahead_one(
    txn: Txn, request_id: RequestId, through: Sequence[int], given: Sequence[bytes] | None = None
) -> KVError | Committed:
    req = txn.admitted(request_id, through, "cache_ahead", "one count", "through")
    if isinstance(req, KVError):
        return req
    for i, (slot, t) in enumerate(zip(req.slots, through)):
        if not is_int(t) or not txn.row_computed[slot] <= t <= txn.row_len[slot]:
            return invalid(
                f"request {shown(request_id)} row {i}: through must be an integer in "
                f"[{txn.row_computed[slot]}, {txn.row_len[slot]}], got {shown(t)}",
                request=request_id,
                field="through",
            )
    if given is not None and (len(req.slots) != 1 or not is_seq(given)):  # (each hash is checked as it is taken)
        return invalid(
            f"cache_ahead of request {shown(request_id)}: hashes must be one row's {txn.config.hash_width}-byte "
            "block hashes",
            request=request_id,
            field="hashes",
        )
    first = len(txn.events)
    try:
        for i, (slot, t) in enumerate(zip(req.slots, through)):
            cache_full_blocks(txn, req, i, slot, t, given)
    except GivenHashError as e:
        return e.refusal(request_id)
    return Committed(request_id, None, 0, tuple(txn.events[first:]))


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
                    pool.evict(txn, b)


def commit_many(
    state: KVState,
    items: Iterable[tuple[RequestId, Sequence[int]]],
    *,
    hashes: Mapping[RequestId, Sequence[bytes]] | None = None,
) -> Result[Step[tuple[Committed, ...]], KVError]:
    """Several commits as one transition (a step's outputs): all of them, in order, or none. ``hashes``: a one-row
    request's chain hashes of its leading full blocks as the caller computed them (a scheduler's, at submit:
    ``caching.chain_of``), taken instead of hashing those blocks again (``cache_ahead_many``'s rule)."""
    pairs = pairs_of(items, "commit_many")
    if isinstance(pairs, KVError):
        return Failure(pairs)
    if hashes is not None and not isinstance(hashes, Mapping):
        return Failure(invalid(f"hashes must map request ids to block hashes, got {shown(hashes):.80}", field="hashes"))
    ids, counts = pairs
    txn = Txn(state)
    effects: list[Committed] = []
    done = commit_each(txn, ids, counts, effects, hashes)  # type: ignore[arg-type]
    if isinstance(done, KVError):
        return Failure(done)
    return Success(Step(txn.done(), tuple(effects)))


def commit_each(
    txn: Txn,
    ids: Sequence[RequestId],
    counts: Sequence[Sequence[int]] | None,
    effects: list[Committed] | None = None,
    hashes: Mapping[RequestId, Sequence[bytes]] | None = None,
) -> tuple[list[tuple[int, int]], int] | KVError:
    """The commit loop every commit runs (``commit``, ``commit_many``, ``commit_decode``, ``decode_step``):
    request ``ids[k]`` committed through ``counts[k]`` (a count a row), or through each row's length
    (``counts`` None), in order on ``txn``. Each request's ``Committed`` goes to ``effects`` when given.
    ``hashes``: one-row requests' leading block hashes as their caller computed them (``commit_many``).
    Returns (batch index, generation) for each request whose layout changed, and the blocks freed.

    A one-row request in a pool without a lookahead is judged here when no group's first visible block
    moves (a decode token inside a window's block): its count changes one number, and the blocks it
    completes go through the caching rule (``cache_full_blocks``). Everything else (a window that lets
    blocks go, several rows, a lookahead, a refusal) is ``_commit_one``'s."""
    cfg = txn.config
    bs, mask = cfg.block_size, (1 << SLOT_SHIFT) - 1
    quick = not cfg.hash_lookahead  # (a lookahead block waits for later ids, not a count)
    moving = cfg.letting_go  # the groups whose first visible block a commit may move
    get = txn.base.requests.get
    lens = txn.row_len.leaves  # (read only)
    done = txn.row_computed.own_for(len(ids))
    generations: list[tuple[int, int]] = []
    freed = 0
    # the rows that fill blocks, cached together (``cache_rows``) once nothing else caches in between; where the
    # pool reports events, each row's go with its effect: cached at once
    filled: list[tuple[Request, int, int, int, Sequence[bytes] | None]] | None = (
        None if cfg.kv_events or not cfg.enable_prefix_caching else []
    )
    for k, rid in enumerate(ids):
        try:
            req = get(rid) if type(rid) is str or type(rid) is int else None
        except TypeError:
            req = None
        if quick and req is not None and (slot := req.decode_slot) >= 0:
            hi, o = slot >> SLOT_SHIFT, slot & mask
            leaf = done[hi]
            before = leaf[o]
            if counts is None:
                c = lens[hi][o]  # (never below what is computed)
            else:
                row = counts[k]
                c = row[0] if (type(row) is list or type(row) is tuple) and len(row) == 1 else None
                if type(c) is not int or not before <= c <= lens[hi][o]:
                    c = None  # (refused by the general rule, with the reason)
            if c is not None and moving:  # a window that moves lets blocks go: the general rule
                for r in moving:
                    if r.first_visible_block(c, bs) != r.first_visible_block(before, bs):
                        c = None
                        break
            if c is not None:
                leaf[o] = c
                first = len(txn.events)
                if before // bs != c // bs:  # blocks completed: the caching rule
                    if filled is not None:
                        filled.append((req, 0, slot, c, hashes.get(rid) if hashes else None))
                    else:
                        try:
                            cache_full_blocks(txn, req, 0, slot, c, hashes.get(rid) if hashes else None)
                        except GivenHashError as e:  # (a hash the core's own differs from: check_given_hashes)
                            return e.refusal(rid)
                if effects is not None:
                    effects.append(Committed(rid, None, 0, tuple(txn.events[first:])))
                continue
        if filled:  # (the general rule caches too: the rows before it first)
            refused = cache_rows(txn, filled)
            if refused is not None:
                return refused
            filled.clear()
        if counts is None:
            got = _commit_one(
                txn,
                rid,
                [txn.row_len[s] for s in req.slots] if req is not None else (),
                hashes.get(rid) if hashes else None,
            )
        else:
            got = _commit_one(txn, rid, counts[k], hashes.get(rid) if hashes else None)
        if isinstance(got, KVError):
            return got
        if got.generation is not None:
            generations.append((k, got.generation))
        freed += got.freed_blocks
        if effects is not None:
            effects.append(got)
    if filled:
        refused = cache_rows(txn, filled)
        if refused is not None:
            return refused
    return generations, freed


def _commit_one(
    txn: Txn, request_id: RequestId, computed: Sequence[int], given: Sequence[bytes] | None = None
) -> KVError | Committed:
    if not is_request_id(request_id):
        return invalid(f"request id must be a string or a 64-bit integer, got {shown(request_id)}", field="request")
    base = txn.base
    req = base.requests.get(request_id)
    if req is None:
        return KVError(ErrorCode.UNKNOWN_REQUEST, f"request {shown(request_id)} is not admitted", request=request_id)
    if not is_seq(computed) or len(computed) != len(req.slots):
        return invalid(
            f"commit of request {shown(request_id)} must give one count per row ({len(req.slots)})",
            request=request_id,
            field="computed",
        )
    for i, (slot, c) in enumerate(zip(req.slots, computed)):
        before, seq_len = txn.row_computed[slot], txn.row_len[slot]
        if not is_int(c) or not before <= c <= seq_len:
            return invalid(
                f"request {shown(request_id)} row {i}: computed must be an integer in [{before}, {seq_len}], got {shown(c)}",
                request=request_id,
                field="computed",
            )
    if given is not None and (len(req.slots) != 1 or not is_seq(given)):  # (each hash is checked as it is taken)
        return invalid(
            f"commit of request {shown(request_id)}: hashes must be one row's block hashes",
            request=request_id,
            field="hashes",
        )
    first_event = len(txn.events)
    windowed = base.config.has_windows
    dropped: list[tuple[int, int, int, int]] = []  # (position, row, group, block) a window let go
    for i, (slot, c) in enumerate(zip(req.slots, computed)):
        previous = txn.row_computed[slot]
        txn.row_computed[slot] = c
        try:
            cache_full_blocks(txn, req, i, slot, c, given)
        except GivenHashError as e:  # (a hash the core's own differs from: check_given_hashes)
            return e.refusal(request_id)
        if windowed:
            _drop_invisible(txn, req, i, slot, c, dropped, previous)
    gen = None
    before_free = txn.free_blocks
    if dropped:
        if base.config.free_queue != "tail":  # group by group, as vLLM's coordinator lets them go
            for g in sorted({d[2] for d in dropped}):
                pool.unref_many(txn, [d[3] for d in sorted(dropped, key=lambda d: (-d[0], d[1])) if d[2] == g])
        else:
            dropped.sort(key=lambda d: (-d[0], d[1], d[2]))  # tail first, as release does
            pool.unref_many(txn, [b for _, _, _, b in dropped])
        gen = txn.new_layout(req.slots[0])
    return Committed(request_id, gen, txn.free_blocks - before_free, tuple(txn.events[first_event:]))


def _drop_invisible(
    txn: Txn,
    req: Request,
    i: int,
    slot: int,
    computed: int,
    dropped: list[tuple[int, int, int, int]],
    previous: int = 0,
) -> None:
    """Null the blocks of row i that no future query of a windowed group can see (``KindRules.let_go``).

    Future queries start at ``computed`` (a diffusion row: at ``prefix_len``
    too, since every denoising step recomputes its target); ``previous`` is
    the last commit's count.
    """
    cfg = txn.config
    bs = cfg.block_size
    layout = req.layouts[i]
    future = min(computed, layout.prefix_len) if layout.prefix_len is not None else computed
    record = txn.rows[slot]
    groups = list(record.blocks)
    changed = False
    for g, rules in enumerate(cfg.rules):
        ids = groups[g]
        held = rules.let_go(ids, future, previous, bs)
        if held:
            dropped.extend((k, i, g, ids[k]) for k in held)
            first = rules.first_visible_block(future, bs)
            groups[g] = (0,) * first + ids[first:]
            changed = True
    if changed:
        txn.rows[slot] = record.with_blocks(tuple(groups))
