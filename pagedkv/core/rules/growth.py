"""Growth: rows take new tokens (decode, or ids appended by any engine).

A block is allocated only when a row's last block fills (every group list holds
exactly ceil(len / block_size) ids); the request then takes a generation. A
row's token ids stay known while it grows by ids (its open block's ids in its
tail, the rest in its record) and stop at the first growth by a count.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from functools import partial
from typing import NamedTuple, cast

from returns.result import Failure, Result, Success

import pagedkv.core.rules.pool as pool
from pagedkv.core.outputs.effects import Appended
from pagedkv.core.errors import (
    INT_ID_LIMIT,
    ErrorCode,
    InvariantError,
    KVError,
    RequestId,
    are_packed_ids,
    are_token_ids,
    ids_problem,
    invalid,
    is_request_id,
    is_seq,
    is_token_id,
    pairs_of,
    shown,
)
from pagedkv.core.store.state import SLOT_SHIFT, Blocks, KVState, Request, Row, Step
from pagedkv.core.store.tails import Awaiting, as_tail, ids_plus, known_ids, pack_ids, with_more_ids
from pagedkv.core.store.txn import Txn


class Placeholders(NamedTuple):
    """Growth by ``n`` positions whose token ids are not known yet (a step planned before the last one's
    tokens came back, draft slots): the row's known ids stay a prefix, and ``placeholders.fill`` gives the rest, in
    order. No block is hashed over a position without its id."""

    n: int


# One row's growth in an append: a token count (the row's ids stop there), its token ids, or placeholders.
Growth = int | Sequence[int] | Placeholders  # (token ids: a list, a tuple or an array("Q"))


def append(state: KVState, request_id: RequestId, rows: Sequence[Growth]) -> Result[Step[Appended], KVError]:
    """Grow each row of one request: ``rows[i]`` is a token count or the token ids.

    Blocks are allocated only when a row's last block fills; the request then
    takes the next generation.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(4),))).unwrap().state
    >>> step = append(s, "a", [[17]]).unwrap()  # position 4 opens a second block
    >>> step.effect.allocations, step.state.free_blocks
    ((('a', 2),), 6)
    """
    return append_many(state, ((request_id, rows),))


def append_many(state: KVState, items: Iterable[tuple[RequestId, Sequence[Growth]]]) -> Result[Step[Appended], KVError]:
    """Several appends as one transition: all of them, in order, or none."""
    pairs = pairs_of(items, "append_many")
    if isinstance(pairs, KVError):
        return Failure(pairs)
    return _appended(state, pairs[0], None, pairs[1])  # type: ignore[arg-type]


def append_decode(
    state: KVState, request_ids: Iterable[RequestId], tokens: Sequence[int] | None = None
) -> Result[Step[Appended], KVError]:
    """One decode step's growth: every row of every named request grows by one token, ``tokens[k]``
    (every row of request k gets it, as CFG branches do) or, without ids, by a count. The same as
    ``append_many`` with one token per row.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(3),))).unwrap().state
    >>> step = append_decode(s, ["a"], [42]).unwrap()
    >>> step.effect.allocations, step.state.row_len[0]
    ((), 4)
    """
    batch = decode_batch(request_ids, tokens)
    if isinstance(batch, KVError):
        return Failure(batch)
    return _appended(state, *batch, None)


def _appended(
    state: KVState, ids: Sequence[RequestId], toks: Sequence[int] | None, rows: Sequence[Sequence[Growth]] | None
) -> Result[Step[Appended], KVError]:
    txn = Txn(state)
    grown = grow_each(txn, ids, toks, rows)
    if isinstance(grown, KVError):
        return Failure(grown)
    return Success(Step(txn.done(), Appended(tuple((ids[k], gen) for k, gen in grown), tuple(txn.events))))


def grow_each(
    txn: Txn, ids: Sequence[RequestId], toks: Sequence[int] | None, rows: Sequence[Sequence[Growth]] | None
) -> list[tuple[int, int]] | KVError:
    """The growth loop every append runs (``append``, ``append_many``, ``append_decode``, ``decode_step``):
    request ``ids[k]`` grows by ``rows[k]`` (a growth a row), or (``rows`` None) every row of it by one
    token, ``toks[k]`` or a count (``toks`` None), in order on ``txn``. Returns (batch index, generation)
    for each request that took blocks.

    A one-row request growing by one token is judged here (its token is checked with the batch's, it fits
    the length limit, the pool has its block): inside its open block it changes its length (and its
    tail, the open block's ids), and only that; opening a block, it goes through the row rule
    (``_grow_row``). Everything else (a count that stops the row's ids, placeholders, several rows, a
    refusal) is judged by the request's rule (``_planned``), then grown row by row. In a pool of one group, the
    one-row requests that open blocks are popped together (``_open_rows``: the blocks one pop at a time would
    give them), each judged against the blocks promised to those before it."""
    cfg = txn.config
    bs, limit, mask, paged = (cfg.block_size, cfg.length_limit, (1 << SLOT_SHIFT) - 1, cfg.opening_blocks)
    get = txn.base.requests.get
    lens = txn.row_len.own_for(len(ids))
    tails = txn.row_tail.own_for(len(ids)) if cfg.enable_prefix_caching else None
    generations: list[tuple[int, int]] = []
    # one-row requests that open blocks, popped together once nothing else pops in between (one group): the free
    # queue's head in their order, the blocks one pop at a time would give them; (batch index, slot, new length,
    # new blocks, growth)
    opening: list[tuple[int, int, int, int, Growth]] | None = [] if len(cfg.rules) == 1 and paged == 1 else None
    opened: set[int] = set()  # their slots
    popping = 0  # the blocks they take
    for k, rid in enumerate(ids):
        try:
            req = get(rid) if type(rid) is str or type(rid) is int else None
        except TypeError:
            req = None
        if rows is None:
            token = toks[k] if toks is not None else None
        else:
            token = _one_token(rows[k])  # type: ignore[assignment]
        if token is not _MANY and req is not None and (slot := req.decode_slot) >= 0:
            if opening and slot in opened:  # (a request named twice: its first growth stands before the second)
                _open_rows(txn, opening, opened, generations)
                popping = 0
            hi, o = slot >> SLOT_SHIFT, slot & mask
            leaf = lens[hi]
            n = leaf[o]
            if tails is None:
                tail = None
            else:
                tail_leaf = tails[hi]
                tail = tail_leaf[o]
            # (a count stops a row's ids, a row awaiting ids takes no more: both are the general rule's)
            if n < limit and (tail is None or (token is not None and type(tail) is bytes)):
                if n % bs:  # the token goes into the open block
                    leaf[o] = n + 1
                    if tail is not None and token is _PLACEHOLDER:  # a placeholder: the row now awaits an id
                        tail_leaf[o] = Awaiting(tail)
                    elif tail is not None:
                        tail_leaf[o] = tail + token.to_bytes(8, "little")  # type: ignore[union-attr]
                    continue
                if opening is not None and popping < txn.free_blocks:  # it opens a block: the row rule
                    growth = _ONE_PLACEHOLDER if token is _PLACEHOLDER else 1 if token is None else [token]
                    opening.append((k, slot, n + 1, 1, growth))
                    opened.add(slot)
                    popping += 1
                    continue
                if opening is None and paged <= txn.free_blocks:  # (and the request's generation)
                    growth = _ONE_PLACEHOLDER if token is _PLACEHOLDER else 1 if token is None else [token]
                    _grow_row(txn, slot, n + 1, 1, growth)
                    generations.append((k, txn.new_layout(slot)))
                    continue
        if opening and (req is None or any(s in opened for s in req.slots)):  # (named twice: the first one stands)
            _open_rows(txn, opening, opened, generations)
            popping = 0
        growth_rows: Sequence[Growth] | None
        if rows is not None:
            if rows[k] is None:  # (None is the decode path's "one token a row", not a growth an append may name)
                return invalid(f"append to request {shown(rid)} must give one entry per row, got None", field="tokens")
            growth_rows = rows[k]
        else:
            growth_rows = None if toks is None else [[toks[k]]] * (len(req.slots) if req is not None else 1)
        planned = _planned(txn, rid, growth_rows, popping)
        if isinstance(planned, KVError):
            return planned
        req, grown, need = planned
        if need and opening is not None and len(grown) == 1:  # one row opening blocks: popped with the others
            opening.append((k, *grown[0]))
            opened.add(grown[0][0])
            popping += need
            continue
        if need and opening:  # (the general rule pops: the rows before it take theirs first)
            _open_rows(txn, opening, opened, generations)
            popping = 0
        for slot, new_len, extra, item in grown:
            _grow_row(txn, slot, new_len, extra, item)
        if need:
            generations.append((k, txn.new_layout(req.slots[0])))
    if opening:
        _open_rows(txn, opening, opened, generations)
    return generations


def _open_rows(
    txn: Txn, opening: list[tuple[int, int, int, int, Growth]], opened: set[int], generations: list[tuple[int, int]]
) -> None:
    """The one-row requests ``grow_each`` found opening blocks (batch index, slot, new length, new blocks, growth),
    in order: one pop for all of them, then each row's rule (``_grow_row``) with its blocks and its request's
    generation; nothing is left pending."""
    fresh = pool.pop_blocks(txn, sum(extra for _, _, _, extra, _ in opening))
    at = 0
    for k, slot, new_len, extra, growth in opening:
        _grow_row(txn, slot, new_len, extra, growth, fresh[at : at + extra])
        at += extra
        generations.append((k, txn.new_layout(slot)))
    opening.clear()
    opened.clear()


_MANY = object()  # a growth other than one token for a single row
_PLACEHOLDER = object()  # a growth of one placeholder for a single row (the step planned before its id is known)
_ONE_PLACEHOLDER = Placeholders(1)


def _one_token(rows: Sequence[Growth]) -> object:
    """A growth of one token for a single row: its id, None for a count of 1, ``_PLACEHOLDER`` for one placeholder;
    else ``_MANY``."""
    if (type(rows) is list or type(rows) is tuple) and len(rows) == 1:
        g = rows[0]
        if type(g) is int:
            return None if g == 1 else _MANY
        if type(g) is Placeholders:
            return _PLACEHOLDER if g.n == 1 else _MANY
        if (type(g) is list or type(g) is tuple) and len(g) == 1 and is_token_id(g[0]):
            return g[0]
    return _MANY


def decode_batch(
    request_ids: Iterable[RequestId], tokens: Sequence[int] | None
) -> tuple[Sequence[RequestId], Sequence[int] | None] | KVError:
    """A decode batch's ids and token ids, the token ids checked once for the whole call."""
    refused = ids_problem(request_ids, "a decode step")
    if refused is not None:
        return refused
    ids: Sequence[RequestId] = request_ids  # type: ignore[assignment]
    if tokens is None:
        return ids, None
    if not is_seq(tokens):
        return invalid(f"a decode step's token ids must be a list (or None), got {shown(tokens):.80}", field="tokens")
    toks = tokens
    if len(toks) != len(ids):
        return invalid(
            f"a decode step needs one token id per request: {len(ids)} requests, {len(toks)} ids", field="tokens"
        )
    if not are_token_ids(toks):
        bad = next(t for t in toks if not is_token_id(t))
        return invalid(f"token ids must be non-negative integers below 2**64, got {shown(bad)}", field="tokens")
    return ids, toks


_ONES = [(1,) * n for n in range(9)]


def _planned(
    txn: Txn, rid: RequestId, rows: Sequence[Growth] | None, popping: int = 0
) -> tuple[Request, list[tuple[int, int, int, Growth]], int] | KVError:
    """One request's growth judged on ``txn`` (``popping`` blocks already promised to rows before it): the request,
    each growing row's (slot, new length, new blocks per group, growth) and the blocks all groups need; or the
    refusal. Nothing is written."""
    if not is_request_id(rid):
        return invalid(f"request id must be a string or a 64-bit integer, got {shown(rid)}", field="request")
    req = txn.base.requests.get(rid)
    if req is None:
        return KVError(ErrorCode.UNKNOWN_REQUEST, f"request {shown(rid)} is not admitted", request=rid)
    if rows is None:  # append_decode: one token per row
        rows = _ONES[len(req.slots)] if len(req.slots) < len(_ONES) else (1,) * len(req.slots)
    if not is_seq(rows) or len(rows) != len(req.slots):
        return invalid(
            f"append to request {shown(rid)} must give one entry per row ({len(req.slots)})",
            request=rid,
            field="tokens",
        )
    planned = _plan_growth(txn, req, rows)
    if isinstance(planned, KVError):
        return planned
    grown, need = planned
    free = txn.free_blocks - popping
    if need > free:
        return KVError(
            ErrorCode.NO_CAPACITY,
            f"request {shown(rid)} needs {need} more blocks; {free} are free",
            request=rid,
            requested=need,
            available=free,
        )
    return req, grown, need


def _plan_growth(
    txn: Txn, req: Request, rows: Sequence[Growth]
) -> tuple[list[tuple[int, int, int, Growth]], int] | KVError:
    """Each growing row's (slot, new length, new blocks per group, growth), and the blocks all groups
    need; or why the growth is refused. Nothing is written."""
    rid, cfg = req.request_id, txn.config
    row_len, records = txn.row_len, txn.rows
    need = 0
    grown: list[tuple[int, int, int, Growth]] = []
    for i, item in enumerate(rows):
        if type(item) is int or type(item) is Placeholders:
            n = item if type(item) is int else item.n  # type: ignore[union-attr]
            if type(n) is not int or not 0 <= n < INT_ID_LIMIT:  # (a count past 2**63 fits no row, nor a message)
                return invalid(
                    f"request {shown(rid)} row {i}: cannot append {shown(n)} tokens", request=rid, field="num_tokens"
                )
        elif isinstance(item, (list, tuple)) or are_packed_ids(item):
            if type(txn.row_tail[req.slots[i]]) is Awaiting:  # ids go where the known ones end: fill first
                slot = req.slots[i]
                return invalid(
                    f"request {shown(rid)} row {i}: positions {known_ids(records[slot], txn.row_tail[slot])}.."
                    f"{row_len[slot]} await their ids (fill them before appending ids)",
                    request=rid,
                    field="tokens",
                )
            ids = cast(Sequence[int], item)
            if type(ids) is not array and not are_token_ids(ids):  # (at C speed; the loop names a bad one)
                bad = next(t for t in ids if not is_token_id(t))
                return invalid(
                    f"request {shown(rid)} row {i}: token ids must be non-negative integers below 2**64, got {shown(bad)}",
                    request=rid,
                    field="tokens",
                )
            n = len(ids)
        else:
            return invalid(
                f"request {shown(rid)} row {i}: growth must be a count or a list of token ids, got {shown(item)}",
                request=rid,
                field="tokens",
            )
        if n == 0:
            continue
        if req.layouts[i].is_diffusion:
            return invalid(
                f"request {shown(rid)} row {i} is a diffusion row; its length is fixed at admission",
                request=rid,
                field="tokens",
            )
        slot = req.slots[i]
        new_len = row_len[slot] + n
        if cfg.max_model_len is not None and new_len > cfg.max_model_len:
            return invalid(
                f"request {shown(rid)} row {i} would reach {shown(new_len)} tokens, over max_model_len {cfg.max_model_len}",
                request=rid,
                field="tokens",
            )
        old, bs = row_len[slot], cfg.block_size
        if cfg.stops_at_block_end and old % bs and new_len > old - old % bs + bs:  # (vLLM's aligned split)
            return invalid(
                f"request {shown(rid)} row {i}: an align-mode state group caches each block's state at the "
                f"block's end: a forward from {old} tokens stops at {old - old % bs + bs}",
                request=rid,
                field="tokens",
            )
        extra = -(-new_len // bs) - len(records[slot].blocks[0])
        if extra:
            need += cfg.growth_blocks(extra)
        grown.append((slot, new_len, extra, item))
    return grown, need


def _grow_row(txn: Txn, slot: int, new_len: int, extra: int, item: Growth, popped: tuple[int, ...] = ()) -> None:
    """One row grows to ``new_len`` with ``extra`` new blocks a group; its ids stay known while it
    grows by ids (whole blocks join its record, the open block's stay in its tail). ``popped``: a one-group row's
    new blocks, taken from the free queue already (``_open_rows``)."""
    records, tails = txn.rows, txn.row_tail
    record = records[slot]
    tail = tails[slot]
    ids = record.ids
    if tail is not None:  # the row's ids are known so far: keep them known, or stop at a count
        if ids is None:
            raise InvariantError("a row with a token tail has token ids")
        if type(item) is Placeholders:  # the known ids stay a prefix; the rest await theirs
            tails[slot] = as_tail(tail, True)
        elif isinstance(item, (list, tuple)) or type(item) is array:
            ids, tails[slot] = with_more_ids(ids, tail, pack_ids(item), txn.config.block_size, awaiting=False)
        else:
            if tail:
                ids = ids_plus(ids, tail)
            tails[slot] = None
    txn.row_len[slot] = new_len
    blocks = (
        (record.blocks[0] + popped,) if popped else _extended(txn, record.blocks, extra) if extra else record.blocks
    )
    if ids is not record.ids or extra:
        records[slot] = Row(blocks, ids, record.hashes, record.pending, record.hw)


def _extended(txn: Txn, blocks: Blocks, extra: int) -> Blocks:
    """A row's lists grown by ``extra`` positions, each group's as its kind grows (``KindRules.grown``)."""
    if len(blocks) == 1:
        return (blocks[0] + pool.pop_blocks(txn, extra),)
    pop = partial(pool.pop_blocks, txn)
    return tuple(r.grown(g, extra, pop) for r, g in zip(txn.config.rules, blocks))
