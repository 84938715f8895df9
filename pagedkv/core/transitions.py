"""The transitions of the block pool: admit, append, commit, release, reset.

Each is a module-level function ``(state, event) -> Result[Step, KVError]``.
A ``Failure`` means the caller still holds the old state, untouched; a
``Success`` carries the next state and the effect the shell needs. The old
state stays valid either way: states are values.

Allocation order is part of the contract (traces pin block ids): rows in
order, then groups in order, then positions ascending, each block popped from
the head of the free queue. Release pushes a request's blocks to the tail
positions descending over all its rows and groups (rows, then groups, in order
within one position), so a prefix outlives its suffix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from returns.result import Failure, Result, Success

from pagedkv.core.errors import (
    ErrorCode, KVError, RequestId, are_token_ids, invalid, is_int, is_request_id, is_token_id,
)  # fmt: skip
from pagedkv.core.events import AllBlocksCleared, BlockStored, KVEvent
from pagedkv.core.hashing import extra_blob, hash_packed
from pagedkv.core.index import PrefixIndex
from pagedkv.core.prefix import find_hit
from pagedkv.core.spec import RequestSpec, check_request_spec
from pagedkv.core.state import (
    NO_PENDING, SLOT_SHIFT, Blocks, KVState, Pending, Request, Row, RowLayout, Step, Txn, initial_state, pack_ids,
    unpack_ids,
)  # fmt: skip
from pagedkv.core.vec import VecEdit

# One row's growth in an append: a token count, or the token ids themselves.
Growth = int | Sequence[int]


class ReleaseReason(StrEnum):
    FINISHED = "finished"
    CANCELLED = "cancelled"
    ERROR = "error"
    PREEMPTED = "preempted"


@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: RequestId
    generation: int
    cached_tokens: tuple[int, ...]  # per row: tokens whose KV came from the prefix cache
    blocks: tuple[Blocks, ...]  # per row, per group
    events: tuple[KVEvent, ...] = ()  # evictions its allocation caused


@dataclass(frozen=True, slots=True)
class Appended:
    # (request, generation it took) for every request that got new blocks, in order
    allocations: tuple[tuple[RequestId, int], ...]
    events: tuple[KVEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class Committed:
    request_id: RequestId
    generation: int | None  # taken only when the block layout changed (a windowed group let blocks go)
    freed_blocks: int = 0
    events: tuple[KVEvent, ...] = ()  # blocks stored in the prefix cache


@dataclass(frozen=True, slots=True)
class Released:
    request_id: RequestId
    reason: ReleaseReason
    generation: int
    freed_blocks: int  # blocks that went back to the free queue


@dataclass(frozen=True, slots=True)
class WasReset:
    epoch: int
    released: tuple[RequestId, ...]
    events: tuple[KVEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefixCacheReset:
    dropped: int  # hashes dropped from the cache index
    events: tuple[KVEvent, ...] = ()


def _fail(code: ErrorCode, message: str, rid: RequestId | None, **numbers: int) -> Failure[KVError]:
    return Failure(KVError(code, message, request=rid, **numbers))  # type: ignore[arg-type]


# -- admit -------------------------------------------------------------------


def admit(state: KVState, spec: RequestSpec) -> Result[Step[Admitted], KVError]:
    """Reserve every block of every row and group of ``spec``, or nothing.

    >>> from pagedkv.core import CacheConfig, RowSpec, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> rows = (RowSpec(8, prefix_len=4, target_len=4),) * 2  # two CFG rows
    >>> step = admit(s, RequestSpec("img", rows)).unwrap()
    >>> step.effect.generation, step.effect.blocks, step.state.free_blocks
    (1, (((1, 2),), ((3, 4),)), 4)
    """
    err = check_request_spec(spec)
    if err is not None:
        return Failure(err)
    cfg = state.config
    rid = spec.request_id
    rows = spec.rows
    limit = cfg.max_rows_per_request
    if limit is not None and len(rows) > limit:
        return _fail(
            ErrorCode.UNSCHEDULABLE,
            f"request {rid!r} has {len(rows)} rows, over max_rows_per_request {limit}",
            rid, requested=len(rows), available=limit,
        )  # fmt: skip
    if cfg.max_model_len is not None:
        for i, row in enumerate(rows):
            if row.num_tokens > cfg.max_model_len:
                return _fail(
                    ErrorCode.UNSCHEDULABLE,
                    f"request {rid!r} row {i} has {row.num_tokens} tokens, over max_model_len {cfg.max_model_len}",
                    rid, requested=row.num_tokens, available=cfg.max_model_len,
                )  # fmt: skip
    per_row = [cfg.blocks_for(row.num_tokens) for row in rows]
    need = len(cfg.groups) * sum(per_row)
    if need > cfg.usable_blocks:
        return _fail(
            ErrorCode.UNSCHEDULABLE,
            f"request {rid!r} needs {need} blocks; the pool has {cfg.usable_blocks} usable blocks in all",
            rid, requested=need, available=cfg.usable_blocks,
        )  # fmt: skip
    if rid in state.requests:
        return _fail(ErrorCode.DUPLICATE_REQUEST, f"request {rid!r} is already admitted", rid)
    hit = find_hit(state, spec)
    held = {b for row in hit.ids for group in row for b in group if b and state.refcount[b] == 0}
    need = len(cfg.groups) * sum(nb - hit.num_blocks for nb in per_row) + len(held)
    if need > state.num_free:
        return _fail(
            ErrorCode.NO_CAPACITY,
            f"request {rid!r} needs {need} blocks; {state.num_free} are free",
            rid, requested=need, available=state.num_free,
        )  # fmt: skip

    txn = Txn(state)
    for row_ids in hit.ids:  # hits first, so popping new blocks never evicts one of them
        for group_ids in row_ids:
            for b in group_ids:
                if b:
                    txn.take_hit(b)
    caching = cfg.enable_prefix_caching
    cached = hit.num_blocks * cfg.block_size
    slots = []
    blocks = []
    for row, nb, row_ids, hashes in zip(rows, per_row, hit.ids, hit.hashes):
        fresh = nb - hit.num_blocks
        rb = tuple(group_ids + txn.pop_blocks(fresh) for group_ids in row_ids)
        p = row.pending_tokens
        # destination blocks: what the prefix cache already holds is present; the rest arrives
        pending: Pending = (p, frozenset(range(hit.num_blocks, cfg.blocks_for(p)))) if p else NO_PENDING
        if caching and row.tokens is not None:  # the ids stay known while the row grows by ids
            record, tail = Row(rb, pack_ids(row.tokens), b"".join(hashes), pending), b""
        else:
            record, tail = Row(rb, None, b"".join(hashes), pending), None
        slots.append(txn.new_slot(row.num_tokens, max(cached, p), record, tail))
        blocks.append(rb)
    if caching:
        txn.prefix_queries += sum(row.num_tokens for row in rows)
        txn.prefix_hits += cached * len(rows)
    gen = txn.next_generation()
    layouts = tuple(RowLayout(r.prefix_len, r.target_len, r.spans) for r in rows)
    # the decode fast path serves one-row requests that may grow
    decode_slot = slots[0] if len(slots) == 1 and not layouts[0].is_diffusion else -1
    txn.requests[rid] = Request(rid, tuple(slots), layouts, spec.extra_keys, decode_slot, state.cache_epoch,
                                extra_blob(spec.extra_keys))  # fmt: skip
    txn.row_generation[slots[0]] = gen
    effect = Admitted(rid, gen, (cached,) * len(rows), tuple(blocks), tuple(txn.events))
    return Success(Step(txn.done(), effect))


# -- append ------------------------------------------------------------------


def append(state: KVState, request_id: RequestId, rows: Sequence[Growth]) -> Result[Step[Appended], KVError]:
    """Grow each row of one request: ``rows[i]`` is a token count or the token ids.

    Blocks are allocated only when a row's last block fills; the request then
    takes the next generation.

    >>> from pagedkv.core import CacheConfig, RowSpec, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(4),))).unwrap().state
    >>> step = append(s, "a", [[17]]).unwrap()  # position 4 opens a second block
    >>> step.effect.allocations, step.state.free_blocks
    ((('a', 2),), 6)
    """
    return append_many(state, ((request_id, rows),))


def append_many(
    state: KVState, items: Iterable[tuple[RequestId, Sequence[Growth]]]
) -> Result[Step[Appended], KVError]:
    """Several appends as one transition: all of them, in order, or none."""
    txn = Txn(state)
    allocations: list[tuple[RequestId, int]] = []
    for rid, rows in items:
        result = _grow(txn, rid, rows)
        if isinstance(result, KVError):
            return Failure(result)
        if result:
            allocations.append((rid, result))
    return Success(Step(txn.done(), Appended(tuple(allocations), tuple(txn.events))))


def append_decode(
    state: KVState, request_ids: Iterable[RequestId], tokens: Sequence[int] | None = None
) -> Result[Step[Appended], KVError]:
    """One decode step's growth: every row of every named request grows by one token.

    ``tokens[k]``, when given, is the id of request k's new token (every row of
    it gets that id, as CFG branches do); without ids the rows grow by a count.
    Equivalent to ``append_many`` with one token per row (a test holds them
    equal), at the cost of a dict update a request for the common case: a
    one-row request whose new token neither opens nor fills a block. Every
    group list holds exactly ceil(len / block_size) ids, so a row of length L
    needs a new block for token L + 1 exactly when L % block_size == 0.

    >>> from pagedkv.core import CacheConfig, RowSpec, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(3),))).unwrap().state
    >>> step = append_decode(s, ["a"], [42]).unwrap()
    >>> step.effect.allocations, step.state.row_len[0]
    ((), 4)
    """
    batch = _batch(request_ids, tokens)
    if isinstance(batch, KVError):
        return Failure(batch)
    ids, toks = batch
    txn = Txn(state)
    cfg = state.config
    bs, limit = cfg.block_size, cfg.length_limit
    get = state.requests.get
    lens = _batch_leaves(txn.row_len, len(ids))
    tails = _batch_leaves(txn.row_tail, len(ids)) if cfg.enable_prefix_caching else None
    mask = (1 << SLOT_SHIFT) - 1
    ngroups = len(cfg.groups)
    allocations: list[tuple[RequestId, int]] = []
    for k, rid in enumerate(ids):
        try:
            req = get(rid)
        except TypeError:  # an unhashable id: the general path says INVALID
            req = None
        if req is not None and (slot := req.decode_slot) >= 0:
            hi, o = slot >> SLOT_SHIFT, slot & mask
            leaf = lens[hi]
            n = leaf[o]
            if n % bs and n < limit:  # no block opens: one integer, maybe eight bytes
                if tails is None:
                    leaf[o] = n + 1
                    continue
                tail_leaf = tails[hi]
                tail = tail_leaf[o]
                if tail is None or toks is not None:  # (a count stops a row's ids: the general path)
                    leaf[o] = n + 1
                    if tail is not None:  # the open block's ids: the tail
                        tail_leaf[o] = tail + toks[k].to_bytes(8, "little")  # type: ignore[index]
                    continue
            elif n < limit and ngroups <= txn.num_free and (tails is None or toks is not None):
                # position n opens a block in every group
                record = txn.rows[slot]
                token = None if toks is None else toks[k]
                tail_leaf = tails[hi] if tails is not None else None
                allocations.append((rid, _open_block(txn, slot, n, token, record, record.hashes, leaf, tail_leaf)))
                continue
        result = _grow(txn, rid, None if toks is None else [[toks[k]]] * _num_rows(req))
        if isinstance(result, KVError):
            return Failure(result)
        if result:
            allocations.append((rid, result))
    return Success(Step(txn.done(), Appended(tuple(allocations), tuple(txn.events))))


class _OwnOnRead:
    """Leaves owned one at a time, when a batch is too small to be worth owning them all."""

    __slots__ = ("own",)

    def __init__(self, edit: VecEdit[Any]) -> None:
        self.own = edit.own

    def __getitem__(self, k: int) -> Any:
        return self.own(k)


def _batch_leaves(edit: VecEdit[Any], batch: int) -> Any:
    """Writable leaves for a batch loop: all of them at once for a large batch (a decode step
    writes every row), else each on first use."""
    return edit.own_all() if batch * 2 >= len(edit.leaves) else _OwnOnRead(edit)


def _num_rows(req: Request | None) -> int:
    return len(req.slots) if req is not None else 1


def _batch(request_ids: Iterable[RequestId], tokens: Sequence[int] | None,
           ) -> tuple[Sequence[RequestId], Sequence[int] | None] | KVError:  # fmt: skip
    """A decode batch's ids and token ids, the token ids checked once for the whole call."""
    ids = request_ids if isinstance(request_ids, (list, tuple)) else list(request_ids)
    if tokens is None:
        return ids, None
    toks = tokens if isinstance(tokens, (list, tuple)) else list(tokens)
    if len(toks) != len(ids):
        return invalid(f"a decode step needs one token id per request: {len(ids)} requests, {len(toks)} ids",
                       field="tokens")  # fmt: skip
    if not are_token_ids(toks):
        bad = next(t for t in toks if not is_token_id(t))
        return invalid(f"token ids must be non-negative integers below 2**64, got {bad!r}", field="tokens")
    return ids, toks


_ONES = [(1,) * n for n in range(9)]


def _grow(txn: Txn, rid: RequestId, rows: Sequence[Growth] | None) -> KVError | int:
    """Apply one request's growth to ``txn``; the generation taken, 0 if none, or the error."""
    if not is_request_id(rid):
        return invalid(f"request id must be a string or an integer, got {rid!r}", field="request")
    req = txn.base.requests.get(rid)
    if req is None:
        return KVError(ErrorCode.UNKNOWN_REQUEST, f"request {rid!r} is not admitted", request=rid)
    if rows is None:  # append_decode: one token per row
        rows = _ONES[len(req.slots)] if len(req.slots) < len(_ONES) else (1,) * len(req.slots)
    if not isinstance(rows, (list, tuple)) or len(rows) != len(req.slots):
        return invalid(f"append to request {rid!r} must give one entry per row ({len(req.slots)})",
                       request=rid, field="tokens")  # fmt: skip
    cfg = txn.config
    bs = cfg.block_size
    row_len, records = txn.row_len, txn.rows
    need = 0
    grown: list[tuple[int, int, int, Growth]] = []  # (slot, new length, new blocks per group, growth)
    for i, item in enumerate(rows):
        if type(item) is int:
            n = item
            if n < 0:
                return invalid(f"request {rid!r} row {i}: cannot append {n} tokens", request=rid, field="num_tokens")
        elif isinstance(item, (list, tuple)):
            for t in item:
                if not is_token_id(t):
                    return invalid(f"request {rid!r} row {i}: token ids must be non-negative integers below 2**64, got {t!r}",
                                   request=rid, field="tokens")  # fmt: skip
            n = len(item)
        else:
            return invalid(f"request {rid!r} row {i}: growth must be a count or a list of token ids, got {item!r}",
                           request=rid, field="tokens")  # fmt: skip
        if n == 0:
            continue
        if req.layouts[i].is_diffusion:
            return invalid(f"request {rid!r} row {i} is a diffusion row; its length is fixed at admission",
                           request=rid, field="tokens")  # fmt: skip
        slot = req.slots[i]
        new_len = row_len[slot] + n
        if cfg.max_model_len is not None and new_len > cfg.max_model_len:
            return invalid(f"request {rid!r} row {i} would reach {new_len} tokens, over max_model_len {cfg.max_model_len}",
                           request=rid, field="tokens")  # fmt: skip
        extra = -(-new_len // bs) - len(records[slot].blocks[0])
        need += extra
        grown.append((slot, new_len, extra, item))
    need *= len(cfg.groups)
    if need > txn.num_free:
        return KVError(ErrorCode.NO_CAPACITY, f"request {rid!r} needs {need} more blocks; {txn.num_free} are free",
                       request=rid, requested=need, available=txn.num_free)  # fmt: skip
    tails = txn.row_tail
    for slot, new_len, extra, item in grown:
        record = records[slot]
        tail = tails[slot]
        if tail is not None:  # the row's ids are known so far: keep them known, or stop at a count
            if isinstance(item, (list, tuple)):
                tail += pack_ids(item)
                last_block = (record.chunked + (len(tail) >> 3) - 1) // bs * bs
                if last_block > record.chunked:  # ids reached a new block: the blocks before join the chunks
                    cut = (last_block - record.chunked) << 3
                    record = record.with_ids(tail[:cut])
                    tail = tail[cut:]
                tails[slot] = tail
            else:
                if tail:
                    record = record.with_ids(tail)
                tails[slot] = None
        row_len[slot] = new_len
        if extra:
            record = record.with_blocks(tuple(g + txn.pop_blocks(extra) for g in record.blocks))
        if record is not records[slot]:
            records[slot] = record
    if not need:
        return 0
    gen = txn.next_generation()
    txn.row_generation[req.slots[0]] = gen
    return gen


# -- commit ------------------------------------------------------------------


def commit(state: KVState, request_id: RequestId, computed: Sequence[int]) -> Result[Step[Committed], KVError]:
    """Mark tokens computed: ``computed[i]`` is row i's absolute count, never decreasing.

    >>> from pagedkv.core import CacheConfig, RowSpec, initial_state
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


@dataclass(frozen=True, slots=True)
class Decoded:
    """What a batch decode transition (``commit_decode``, ``decode_step``) did."""

    # (request, generation it took) for every request whose block layout changed, in order
    allocations: tuple[tuple[RequestId, int], ...]
    freed_blocks: int = 0  # blocks windowed groups let go
    events: tuple[KVEvent, ...] = ()  # blocks stored in the prefix cache, evictions


def commit_decode(state: KVState, request_ids: Iterable[RequestId]) -> Result[Step[Decoded], KVError]:
    """The forward computed every position of the named requests: each row is
    committed through its length (full blocks enter the prefix cache).

    Equivalent to ``commit_many`` with each row's length (a test holds them
    equal); costs a dict update a request unless a block completes.

    >>> from pagedkv.core import CacheConfig, RowSpec, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(3),))).unwrap().state
    >>> commit_decode(s, ["a"]).unwrap().state.row_computed[0]
    3
    """
    return decode_step(state, request_ids, None, append_tokens=False)


def decode_step(
    state: KVState, request_ids: Iterable[RequestId], tokens: Sequence[int] | None, *, append_tokens: bool = True
) -> Result[Step[Decoded], KVError]:
    """One decode step as one transition: the forward computed every position of
    the named requests, and ``tokens[k]`` was sampled for request k.

    Each row is committed through its length (blocks that fill are hashed and
    enter the prefix cache, so prefix caching stays exact), then grows by its
    request's sampled token (``None``: by a count), opening a block when the
    last one is full. The same as ``commit_many`` then ``append_many`` (a test
    holds them equal), at the cost of a dict update a request in the common
    case. All of it, or nothing.

    >>> from pagedkv.core import CacheConfig, RowSpec, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True))
    >>> s = admit(s, RequestSpec("a", (RowSpec.of_tokens([1, 2, 3]),))).unwrap().state
    >>> s = decode_step(s, ["a"], [4]).unwrap().state   # 1 2 3 computed; 4 appended
    >>> step = decode_step(s, ["a"], [5]).unwrap()      # block [1 2 3 4] fills and is cached; 5 opens a block
    >>> len(step.state.cache), step.effect.allocations, step.state.row_len[0]
    (1, (('a', 2),), 5)
    """
    batch = _batch(request_ids, tokens)
    if isinstance(batch, KVError):
        return Failure(batch)
    ids, toks = batch
    txn = Txn(state)
    cfg = state.config
    bs, limit = cfg.block_size, cfg.length_limit
    fast = not any(g.is_windowed for g in cfg.groups)  # full attention only: no window logic at all
    ngroups = len(cfg.groups)
    get = state.requests.get
    lens = _batch_leaves(txn.row_len, len(ids))
    done = _batch_leaves(txn.row_computed, len(ids))
    # token tails: written when ids arrive; a count stops a row's ids (the general path does that)
    tails = _batch_leaves(txn.row_tail, len(ids)) if append_tokens and cfg.enable_prefix_caching else None
    mask = (1 << SLOT_SHIFT) - 1
    allocations: list[tuple[RequestId, int]] = []
    freed = 0
    for k, rid in enumerate(ids):
        try:
            req = get(rid)
        except TypeError:  # an unhashable id: the general path says INVALID
            req = None
        if fast and req is not None and (slot := req.decode_slot) >= 0:
            hi, o = slot >> SLOT_SHIFT, slot & mask
            leaf, done_leaf = lens[hi], done[hi]
            n = leaf[o]
            if done_leaf[o] // bs == n // bs:  # committing through n completes no block
                if not append_tokens:
                    done_leaf[o] = n
                    continue
                if n % bs and n < limit:  # and the new token goes into the open block
                    if tails is None:
                        done_leaf[o] = n
                        leaf[o] = n + 1
                        continue
                    tail_leaf = tails[hi]
                    tail = tail_leaf[o]
                    if tail is None or toks is not None:  # (a count stops a row's ids: the general path)
                        done_leaf[o] = n
                        leaf[o] = n + 1
                        if tail is not None:  # the open block's ids: the tail
                            tail_leaf[o] = tail + toks[k].to_bytes(8, "little")  # type: ignore[index]
                        continue
            elif not append_tokens:  # a block filled: hash it
                done_leaf[o] = n
                record = txn.rows[slot]
                hashes = _hash_filled(txn, req, slot, n, record, txn.row_tail[slot])
                if hashes is not record.hashes:
                    txn.rows[slot] = record.with_hashes(hashes)
                continue
            elif n % bs == 0 and n < limit and ngroups <= txn.num_free and (tails is None or toks is not None):
                # a block boundary: the block that filled is hashed, the token opens the next one
                done_leaf[o] = n
                record = txn.rows[slot]
                tail_leaf = tails[hi] if tails is not None else None
                hashes = _hash_filled(txn, req, slot, n, record, tail_leaf[o] if tail_leaf is not None else None)
                token = None if toks is None else toks[k]
                allocations.append((rid, _open_block(txn, slot, n, token, record, hashes, leaf, tail_leaf)))
                continue
        # the general path: errors, block boundaries, windows, several rows
        if req is None or not is_request_id(rid):
            return Failure(_unknown(rid))
        committed = _commit_one(txn, rid, [txn.row_len[s] for s in req.slots])
        if isinstance(committed, KVError):
            return Failure(committed)
        freed += committed.freed_blocks
        gen = committed.generation
        if append_tokens:
            grown = _grow(txn, rid, None if toks is None else [[toks[k]]] * len(req.slots))
            if isinstance(grown, KVError):
                return Failure(grown)
            gen = grown or gen
        if gen:
            allocations.append((rid, gen))
    return Success(Step(txn.done(), Decoded(tuple(allocations), freed, tuple(txn.events))))


def _hash_filled(txn: Txn, req: Request, slot: int, n: int, record: Row, tail: bytes | None) -> bytes:
    """A one-row decode request commits through ``n``: its hashes once the blocks that filled are
    hashed and cached. The common case costs one hash: the tail holds exactly the block that
    filled (block n / block_size - 1) and every block before it is hashed."""
    base = txn.base
    hashes = record.hashes
    if record.ids is None or not base.config.enable_prefix_caching or req.cache_epoch != base.cache_epoch:
        return hashes
    bs = base.config.block_size
    j = n // bs - 1
    if tail is None or len(tail) != bs << 3 or len(hashes) != j << 4:
        return _hash_full_blocks(txn, req, 0, slot, n, record, tail).hashes
    parent = hashes[-16:] if j else base.cache.root
    h = hash_packed(parent, tail, req.extra)
    add = txn.index.add
    for g, group_blocks in enumerate(record.blocks):
        b = group_blocks[j]
        if b and add(g, h, b):
            txn.events.append(BlockStored(h, parent if j else None, unpack_ids(tail), g, b))
    return hashes + h


def _open_block(txn: Txn, slot: int, n: int, token: int | None, record: Row, hashes: bytes, leaf: Any,
                tail_leaf: Any) -> int:  # fmt: skip
    """A one-row full-attention row grows to n + 1 where position n opens a block in every group
    (n % block_size == 0, the blocks are free): the tail's ids join the row's, the token starts
    the new tail. What ``_grow`` does for it, in one record; returns the generation taken.
    ``leaf`` and ``tail_leaf`` are the row's writable leaves of the length and tail vectors
    (``tail_leaf`` None without prefix caching)."""
    o = slot & ((1 << SLOT_SHIFT) - 1)
    ids = record.ids
    tail = tail_leaf[o] if tail_leaf is not None else None
    if tail is not None:
        assert ids is not None, "a row with a token tail has token ids"
        ids += tail
        tail_leaf[o] = None if token is None else token.to_bytes(8, "little")
    blocks = record.blocks
    if len(blocks) == 1:
        new_blocks: Blocks = (blocks[0] + txn.pop_blocks(1),)
    else:
        new_blocks = tuple(g + txn.pop_blocks(1) for g in blocks)
    txn.rows[slot] = Row(new_blocks, ids, hashes, record.pending)
    leaf[o] = n + 1
    gen = txn.next_generation()
    txn.row_generation[slot] = gen
    return gen


def _unknown(rid: object) -> KVError:
    if not is_request_id(rid):
        return invalid(f"request id must be a string or an integer, got {rid!r}", field="request")
    return KVError(ErrorCode.UNKNOWN_REQUEST, f"request {rid!r} is not admitted", request=rid)  # type: ignore[arg-type]


def _commit_one(txn: Txn, request_id: RequestId, computed: Sequence[int]) -> KVError | Committed:
    if not is_request_id(request_id):
        return invalid(f"request id must be a string or an integer, got {request_id!r}", field="request")
    base = txn.base
    req = base.requests.get(request_id)
    if req is None:
        return KVError(ErrorCode.UNKNOWN_REQUEST, f"request {request_id!r} is not admitted", request=request_id)
    if not isinstance(computed, (list, tuple)) or len(computed) != len(req.slots):
        return invalid(f"commit of request {request_id!r} must give one count per row ({len(req.slots)})",
                       request=request_id, field="computed")  # fmt: skip
    for i, (slot, c) in enumerate(zip(req.slots, computed)):
        before, seq_len = txn.row_computed[slot], txn.row_len[slot]
        if not is_int(c) or not before <= c <= seq_len:
            return invalid(
                f"request {request_id!r} row {i}: computed must be an integer in [{before}, {seq_len}], got {c!r}",
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
    before_free = txn.num_free
    if dropped:
        dropped.sort(key=lambda d: (-d[0], d[1], d[2]))  # tail first, as release does
        for _, _, _, b in dropped:
            txn.unref(b)
        gen = txn.next_generation()
        txn.row_generation[req.slots[0]] = gen
    return Committed(request_id, gen, txn.num_free - before_free, tuple(txn.events[first_event:]))


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
    known = record.chunked + (len(tail) >> 3 if tail is not None else 0)
    layout = req.layouts[i]
    cacheable = layout.prefix_len if layout.prefix_len is not None else txn.row_len[slot]
    full = min(computed, cacheable, known) // bs
    done = record.num_hashed
    if full <= done:
        return record
    blocks = record.blocks
    parent = record.hashes[-16:] if done else txn.base.cache.root
    new = [record.hashes]
    add = txn.index.add
    events = txn.events
    extra = req.extra
    span = _token_span(record, tail, done * bs, full * bs)  # the packed ids of every block to hash
    ids = unpack_ids(span)  # (the events carry them as ints)
    width = bs << 3
    for j in range(done, full):
        i = j - done
        h = hash_packed(parent, span[i * width : (i + 1) * width], extra)
        for g, group_blocks in enumerate(blocks):
            b = group_blocks[j]
            # not let go already, not cached already, and no other block holds the same content
            if b and add(g, h, b):
                events.append(BlockStored(h, parent if j else None, ids[i * bs : (i + 1) * bs], g, b))
        new.append(h)
        parent = h
    return record.with_hashes(b"".join(new))


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


# -- release -----------------------------------------------------------------


def release(state: KVState, request_id: RequestId, reason: ReleaseReason | str) -> Result[Step[Released], KVError]:
    """Drop every block reference of a request, tail first; the request is gone.

    >>> from pagedkv.core import CacheConfig, RowSpec, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(8),))).unwrap().state
    >>> step = release(s, "a", "finished").unwrap()
    >>> step.effect.freed_blocks, step.effect.generation
    (2, 2)
    """
    if not isinstance(reason, str) or reason not in _REASONS:
        return Failure(invalid(f"release reason must be one of {sorted(_REASONS)}, got {reason!r}", field="reason"))
    if not is_request_id(request_id):
        return Failure(invalid(f"request id must be a string or an integer, got {request_id!r}", field="request"))
    req = state.requests.get(request_id)
    if req is None:
        return _fail(ErrorCode.UNKNOWN_REQUEST, f"request {request_id!r} is not admitted", request_id)
    txn = Txn(state)
    before = txn.num_free
    _free_tail_first(txn, req)
    del txn.requests[request_id]
    gen = txn.next_generation()
    freed = txn.num_free - before
    return Success(Step(txn.done(), Released(request_id, ReleaseReason(reason), gen, freed)))


def release_many(
    state: KVState, request_ids: Iterable[RequestId], reason: ReleaseReason | str
) -> Result[Step[tuple[Released, ...]], KVError]:
    """Several releases as one transition, in order (the requests a step ended): all, or none.

    The same as releasing them one after another: each takes its own generation.

    >>> from pagedkv.core import CacheConfig, RowSpec, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(admit(s, RequestSpec("a", (RowSpec(8),))).unwrap().state, RequestSpec("b", (RowSpec(2),))).unwrap().state
    >>> [(r.request_id, r.generation, r.freed_blocks) for r in release_many(s, ["a", "b"], "finished").unwrap().effect]
    [('a', 3, 2), ('b', 4, 1)]
    """
    if not isinstance(reason, str) or reason not in _REASONS:
        return Failure(invalid(f"release reason must be one of {sorted(_REASONS)}, got {reason!r}", field="reason"))
    why = ReleaseReason(reason)
    txn = Txn(state)
    out = []
    gone: set[RequestId] = set()
    for rid in request_ids:
        if not is_request_id(rid):
            return Failure(invalid(f"request id must be a string or an integer, got {rid!r}", field="request"))
        req = state.requests.get(rid)
        if req is None or rid in gone:
            return _fail(ErrorCode.UNKNOWN_REQUEST, f"request {rid!r} is not admitted", rid)
        gone.add(rid)
        before = txn.num_free
        _free_tail_first(txn, req)
        del txn.requests[rid]
        out.append(Released(rid, why, txn.next_generation(), txn.num_free - before))
    return Success(Step(txn.done(), tuple(out)))


_REASONS = frozenset(r.value for r in ReleaseReason)


def _free_tail_first(txn: Txn, req: Request) -> None:
    """Drop one reference to each block, positions descending over all rows and
    groups (rows, then groups, in order within one position); a block whose
    last reference goes joins the tail of the free queue."""
    records = txn.rows
    rows = [records[s].blocks for s in req.slots]
    if len(rows) == 1 and len(rows[0]) == 1:
        order: Sequence[int] = rows[0][0][::-1]
    else:
        longest = max(len(g) for r in rows for g in r)
        order = [g[pos] for pos in range(longest - 1, -1, -1) for r in rows for g in r if pos < len(g)]
    refcount, nxt, prv = txn.refcount, txn.nxt, txn.prv
    sh, m = refcount.shift, refcount.mask  # (every per-block vector has the same leaves)
    counts = refcount.own_many({b >> sh for b in order})  # each leaf copied once, then written in place
    freed: list[int] = []
    for b in order:
        if not b:
            continue  # the null block stands for a position a windowed group let go
        leaf = counts[b >> sh]
        rc = leaf[b & m] - 1
        assert rc >= 0, f"block {b} released more often than it was referenced"
        leaf[b & m] = rc
        if not rc:
            freed.append(b)
    if freed:  # the freed blocks, in this order, go after the tail of the free queue
        prev = prv[0]
        ks = {b >> sh for b in freed}
        after = prv.own_many(ks)
        ks.add(prev >> sh)
        before = nxt.own_many(ks)
        for b in freed:
            before[prev >> sh][prev & m] = b
            after[b >> sh][b & m] = prev
            prev = b
        before[prev >> sh][prev & m] = 0
        prv[0] = prev
        txn.num_free += len(freed)
    for s in req.slots:
        txn.free_slot(s)


# -- destination blocks (AR -> DiT) ---------------------------------------------


@dataclass(frozen=True, slots=True)
class MarkedReady:
    request_id: RequestId
    row: int
    ready: tuple[int, ...]  # block positions that became ready
    pending: tuple[int, ...]  # block positions still pending


def mark_ready(state: KVState, request_id: RequestId, row: int, start: int, end: int) -> Result[Step[MarkedReady], KVError]:
    """KV of tokens ``[start, end)`` of a row arrived: its pending blocks covered by it are ready.

    A block is covered when the range holds all of its arriving tokens (the last pending block
    may be partial: it holds tokens up to the row's ``pending_tokens``). Marking again is a no-op.
    """
    if not is_request_id(request_id):
        return Failure(invalid(f"request id must be a string or an integer, got {request_id!r}", field="request"))
    req = state.requests.get(request_id)
    if req is None:
        return _fail(ErrorCode.UNKNOWN_REQUEST, f"request {request_id!r} is not admitted", request_id)
    if not is_int(row) or not 0 <= row < len(req.slots):
        return Failure(invalid(f"request {request_id!r} has no row {row!r}", request=request_id, field="row"))
    slot = req.slots[row]
    record = state.rows[slot]
    arriving, pending = record.pending
    if not (is_int(start) and is_int(end) and 0 <= start < end <= arriving):
        return Failure(invalid(f"request {request_id!r} row {row}: [{start!r}, {end!r}) is not inside the "
                               f"arriving range [0, {arriving})", request=request_id, field="range"))  # fmt: skip
    bs = state.config.block_size
    ready = frozenset(j for j in pending if start <= j * bs and min((j + 1) * bs, arriving) <= end)
    txn = Txn(state)
    txn.rows[slot] = record.with_pending((arriving, pending - ready))
    effect = MarkedReady(request_id, row, tuple(sorted(ready)), tuple(sorted(pending - ready)))
    return Success(Step(txn.done(), effect))


# -- reset -------------------------------------------------------------------


def reset(state: KVState) -> Result[Step[WasReset], KVError]:
    """Reinitialise: every request dropped, the pool empty, a new epoch.

    Generations go on from where they were (they are never reused), so a
    worker can tell every snapshot of the old epoch from the new ones.
    """
    nxt = initial_state(state.config, generation=state.generation, epoch=state.epoch + 1,
                        cache_epoch=state.cache_epoch + 1)  # fmt: skip
    released = tuple(sorted(state.requests.keys(), key=_id_order))
    events: tuple[KVEvent, ...] = (AllBlocksCleared(),) if len(state.cache) else ()
    return Success(Step(nxt, WasReset(nxt.epoch, released, events)))


def reset_prefix_cache(state: KVState) -> Result[Step[PrefixCacheReset], KVError]:
    """Drop every hash (after a weight update, say); works while requests run.

    Cached blocks nobody holds become plain free blocks where they stand in the
    free queue; held ones stay with their owners but can no longer be hit. The
    requests running now never insert again: their KV may predate the reset.
    Costs O(sqrt(pool)): the index is replaced by an empty one (whose leaves are shared).

    >>> from pagedkv.core import CacheConfig, initial_state
    >>> reset_prefix_cache(initial_state(CacheConfig(block_size=4, num_blocks=9))).unwrap().effect.dropped
    0
    """
    dropped = len(state.cache)
    empty = PrefixIndex.empty(state.config.num_blocks, len(state.config.groups), state.cache.root)
    nxt = replace(state, cache=empty, cache_epoch=state.cache_epoch + 1)
    return Success(Step(nxt, PrefixCacheReset(dropped, (AllBlocksCleared(),) if dropped else ())))


def _id_order(rid: RequestId) -> tuple[str, str | int]:
    return (type(rid).__name__, rid)
