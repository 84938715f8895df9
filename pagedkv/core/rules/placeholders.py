"""Placeholders: the ids of positions a row grew by without them arrive
(``fill``), and a row's unverified tail is cut back to what was accepted (``truncate``).

A row grows by ``growth.Placeholders`` when a step is planned before the last one's tokens are known
(async scheduling) or for draft tokens. Its known ids stay a prefix; ``fill`` gives the next ones, in
order, and only then are the blocks they complete hashed and cached (under either caching point: no
cached block ever holds an unknown id). ``truncate`` cuts rows back (rejected drafts): never below what
is computed or cached, so nothing cached or shared is touched; blocks that held only cut positions go
back to the free queue and the request takes a new generation (a worker accepts the shorter lists).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from returns.result import Failure, Result, Success

import pagedkv.core.rules.pool as pool
from pagedkv.core.rules.caching import caches, hash_full_blocks
from pagedkv.core.outputs.effects import Filled, Truncated
from pagedkv.core.errors import (
    InvariantError,
    KVError,
    RequestId,
    are_packed_ids,
    are_token_ids,
    invalid,
    is_int,
    is_token_id,
    pairs_of,
    shown,
)
from pagedkv.core.store.state import SLOT_SHIFT, KVState, Row, Step
from pagedkv.core.store.tails import Awaiting, as_tail, ids_count, ids_cut, known_ids, pack_ids, with_more_ids
from pagedkv.core.store.txn import Txn, each


def fill(state: KVState, request_id: RequestId, rows: Sequence[Sequence[int]]) -> Result[Step[Filled], KVError]:
    """The ids of the next positions that await theirs, per row (``rows[i]``, maybe empty); the blocks they
    complete and that are computed enter the prefix cache.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, commit, initial_state
    >>> from pagedkv.core.rules.growth import Placeholders, append
    >>> s = initial_state(CacheConfig(block_size=2, num_blocks=9, enable_prefix_caching=True))
    >>> s = admit(s, RequestSpec("a", (RowSpec.of_tokens([1]),))).unwrap().state
    >>> s = append(s, "a", [Placeholders(2)]).unwrap().state      # two positions, ids unknown
    >>> s = commit(s, "a", [3]).unwrap().state                     # computed: nothing cached over them
    >>> len(s.cache), len(fill(s, "a", [[7, 8]]).unwrap().state.cache)
    (0, 1)
    """
    return fill_many(state, ((request_id, rows),)).map(lambda step: Step(step.state, step.effect[0]))


def fill_many(
    state: KVState, items: Iterable[tuple[RequestId, Sequence[Sequence[int]]]], *, awaiting_only: bool = False
) -> Result[Step[tuple[Filled, ...]], KVError]:
    """Several ``fill`` as one transition (a step's sampled tokens, a step late): all, in order, or none.

    ``awaiting_only``: a row with no position awaiting its id (it did not grow since, or keeps no ids) takes
    nothing of its entry, where ``fill`` refuses one (``on_tokens``: the request was not scheduled in the step
    after the one that sampled it).

    The fill loop judges the common row itself (one id for a one-row request's first awaited position, which is
    not computed: no block can be hashed by it; no lookahead hashes, whose ids a computed block may await),
    reading and writing the rows' leaves directly, and hands every other case to the general rule
    (``_fill_one``)."""
    pairs = pairs_of(items, "fill_many")
    if isinstance(pairs, KVError):
        return Failure(pairs)
    txn = Txn(state)
    out: list[Filled] = []
    cfg = txn.config
    bs, mask, common = cfg.block_size, (1 << SLOT_SHIFT) - 1, not cfg.hash_lookahead
    get = txn.base.requests.get
    if common:
        records, tails = txn.rows.own_for(len(pairs[0])), txn.row_tail.own_for(len(pairs[0]))
        lens, computed = txn.row_len.leaves, txn.row_computed.leaves
    for rid, rows in zip(*pairs):
        req = get(rid) if type(rid) is str or type(rid) is int else None
        if (
            common
            and (type(rows) is list or type(rows) is tuple)
            and len(rows) == 1
            and (type(ids := rows[0]) is list or type(ids) is tuple)
            and len(ids) == 1
            and is_token_id(ids[0])
            and req is not None
            and (slot := req.decode_slot) >= 0
        ):
            hi, o = slot >> SLOT_SHIFT, slot & mask
            tail, record, length = tails[hi][o], records[hi][o], lens[hi][o]
            if type(tail) is Awaiting and (held := record.ids) is not None:
                chunked = ids_count(held)  # (counted once, for both)
                known = known_ids(record, tail, chunked)
                if known < length and computed[hi][o] <= known:
                    more, tails[hi][o] = with_more_ids(
                        held, tail, ids[0].to_bytes(8, "little"), bs, awaiting=known + 1 < length, chunked=chunked
                    )
                    if more is not record.ids:
                        records[hi][o] = Row(record.blocks, more, record.hashes, record.pending, record.hw)
                    out.append(Filled(rid, ()))
                    continue
        if (  # (a row awaiting nothing takes nothing)
            awaiting_only
            and (type(rows) is list or type(rows) is tuple)
            and req is not None
            and len(req.slots) == len(rows)
        ):
            rows = [
                ids if 0 < known_ids(txn.rows[s], txn.row_tail[s]) < txn.row_len[s] else ()
                for s, ids in zip(req.slots, rows)
            ]
        got = _fill_one(txn, rid, rows)  # type: ignore[arg-type]
        if isinstance(got, KVError):
            return Failure(got)
        out.append(got)
    return Success(Step(txn.done(), tuple(out)))


def _fill_one(txn: Txn, rid: RequestId, rows: Sequence[Sequence[int]]) -> KVError | Filled:
    req = txn.admitted(rid, rows, "fill", "one entry", "tokens")
    if isinstance(req, KVError):
        return req
    cfg = txn.config
    first = len(txn.events)
    for i, (slot, ids) in enumerate(zip(req.slots, rows)):
        if not are_packed_ids(ids) and (not isinstance(ids, (list, tuple)) or not are_token_ids(ids)):
            return invalid(
                f"fill of request {shown(rid)} row {i}: ids must be a list of token ids below 2**64",
                request=rid,
                field="tokens",
            )
        if not ids:
            continue
        record, tail, length = txn.rows[slot], txn.row_tail[slot], txn.row_len[slot]
        if tail is None:
            return invalid(
                f"request {shown(rid)} row {i} keeps no token ids (it grew by a count, or prefix caching "
                "is off): there is nothing to fill",
                request=rid,
                field="tokens",
            )
        known = known_ids(record, tail)
        if known + len(ids) > length:
            return invalid(
                f"request {shown(rid)} row {i}: {len(ids)} ids for the {length - known} positions that await theirs",
                request=rid,
                field="tokens",
            )
        if record.ids is None:
            raise InvariantError("a row with a token tail has token ids")
        more, tail = with_more_ids(record.ids, tail, pack_ids(ids), cfg.block_size, awaiting=known + len(ids) < length)
        if more is not record.ids:
            record = Row(record.blocks, more, record.hashes, record.pending, record.hw)
        txn.row_tail[slot] = tail
        if caches(txn, req):
            record = hash_full_blocks(txn, req, i, slot, txn.row_computed[slot], record, tail)
        txn.rows[slot] = record
    return Filled(rid, tuple(txn.events[first:]))


def truncate(state: KVState, request_id: RequestId, lengths: Sequence[int]) -> Result[Step[Truncated], KVError]:
    """Cut each row back to ``lengths[i]`` positions (rejected drafts): never below what is computed or cached
    (``INVALID``), the known ids past it dropped, the blocks that held only cut positions back to the free
    queue (tail first); a new generation when one went back.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> from pagedkv.core.rules.growth import append
    >>> s = initial_state(CacheConfig(block_size=2, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(2),))).unwrap().state
    >>> s = append(s, "a", [3]).unwrap().state                     # three drafts: positions 2, 3, 4
    >>> step = truncate(s, "a", [3]).unwrap()                      # one accepted
    >>> step.effect.freed_blocks, step.state.row_len[0], step.state.free_blocks
    (1, 3, 6)
    """
    txn = Txn(state)
    got = _truncate_one(txn, request_id, lengths)
    if isinstance(got, KVError):
        return Failure(got)
    return Success(Step(txn.done(), got))


def truncate_many(
    state: KVState, items: Iterable[tuple[RequestId, Sequence[int]]]
) -> Result[Step[tuple[Truncated, ...]], KVError]:
    """Several ``truncate`` as one transition (a step's verified drafts): all, in order, or none."""
    return each(state, items, _truncate_one, "truncate_many")


def _truncate_one(txn: Txn, rid: RequestId, lengths: Sequence[int]) -> Truncated | KVError:
    req = txn.admitted(rid, lengths, "truncate", "one entry", "lengths")
    if isinstance(req, KVError):
        return req
    cfg = txn.config
    bs = cfg.block_size
    if cfg.recurrent:
        return invalid(
            f"request {shown(rid)}: a pool with state (Mamba) groups cannot cut a row back (its state is past the cut)",
            request=rid,
            field="op",
        )
    for i, (slot, n) in enumerate(zip(req.slots, lengths)):
        floor = cut_floor(txn, slot)
        if not is_int(n) or not floor <= n <= txn.row_len[slot]:
            return invalid(
                f"truncate of request {shown(rid)} row {i}: a length in [{floor}, {txn.row_len[slot]}] "
                f"(not below what is computed or cached), got {shown(n)}",
                request=rid,
                field="lengths",
            )
        if req.layouts[i].is_diffusion or txn.rows[slot].pending[1]:
            return invalid(
                f"request {shown(rid)} row {i}: a diffusion row or one awaiting KV has a fixed length",
                request=rid,
                field="lengths",
            )
    gone: list[int] = []
    for slot, n in zip(req.slots, lengths):
        record, tail = txn.rows[slot], txn.row_tail[slot]
        keep = -(-n // bs)
        if keep < len(record.blocks[0]):
            gone += [b for ids in record.blocks for b in reversed(ids[keep:]) if b]
            record = record.with_blocks(tuple(ids[:keep] for ids in record.blocks))
        record, tail = _cut_ids(record, tail, n)
        txn.rows[slot], txn.row_tail[slot], txn.row_len[slot] = record, tail, n
    if not gone:
        return Truncated(rid, None, 0)
    before = txn.free_blocks
    pool.unref_many(txn, gone)  # (positions descending, rows in order: the last cut block reused last)
    gen = txn.new_layout(req.slots[0])
    return Truncated(rid, gen, txn.free_blocks - before)


def cut_floor(txn: Txn, slot: int) -> int:
    """The shortest a row may be cut to: what it computed, every block it cached (ahead of the forward, under the
    ``schedule`` caching point) kept whole with the ids after it its hash covers (``hash_lookahead``), and one
    token at least."""
    hashed = txn.rows[slot].num_hashed
    cached = hashed * txn.config.block_size + (txn.config.hash_lookahead if hashed else 0)
    return max(1, txn.row_computed[slot], cached)  # (a row keeps a token)


def _cut_ids(record: Row, tail: bytes | None, n: int) -> tuple[Row, bytes | None]:
    """A row's known ids cut to the first ``n`` positions (those past them go with the cut)."""
    if tail is None:
        if record.ids is not None and record.chunked > n:
            record = Row(record.blocks, ids_cut(record.ids, n), record.hashes, record.pending, record.hw)
        return record, tail
    known = known_ids(record, tail)
    if known > n:
        if n >= record.chunked:
            tail = tail[: (n - record.chunked) << 3]
        else:
            if record.ids is None:
                raise InvariantError("a row with a token tail has token ids")
            record, tail = Row(record.blocks, ids_cut(record.ids, n), record.hashes, record.pending, record.hw), b""
        known = n
    return record, as_tail(tail, known < n)
