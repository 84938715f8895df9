"""Admission: every block of every row and group of a request, or none.

Allocation order is part of the contract (traces pin block ids): rows in order,
then groups in order, then positions ascending, each block popped from the head
of the free queue, after the prefix-cache hits are taken (so an admission never
evicts its own hit).
"""

from __future__ import annotations

from functools import partial
from itertools import chain
from typing import Any

from returns.result import Failure, Result, Success

import pagedkv.core.rules.pool as pool
from pagedkv.core.outputs.effects import Admitted, TurnedAway
from pagedkv.core.errors import ErrorCode, GivenHashError, KVError, fail, invalid, shown
from pagedkv.core.rules.hashing import BlockKeys
from pagedkv.core.rules.kinds import HOSTED
from pagedkv.core.rules.prefix import Hit, find_hit
from pagedkv.core.spec import RequestSpec, check_request_spec
from pagedkv.core.store.state import NO_PENDING, Blocks, KVState, Pending, Request, Row, RowLayout, Step
from pagedkv.core.store.tails import as_tail, ids_plus, pack_ids
from pagedkv.core.store.txn import Txn


def admit(
    state: KVState, spec: RequestSpec, *, reserve: int = 0, checked: bool = False
) -> Result[Step[Admitted], KVError]:
    """Reserve every block of every row and group of ``spec``, or nothing. ``reserve``: blocks the admission
    must leave free (a watermark kept for decode growth, blocks promised elsewhere); short of them it is
    ``NO_CAPACITY``. ``checked``: the spec's form was checked already (``check_request_spec``: a scheduler
    checks a request when it arrives and builds each try's spec from it), so its O(tokens) check is not run
    again at each try; what depends on the pool (its hashes' width, its state rows) is.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> rows = (RowSpec(8, prefix_len=4, target_len=4),) * 2  # two CFG rows
    >>> step = admit(s, RequestSpec("img", rows)).unwrap()
    >>> step.effect.generation, step.effect.blocks, step.state.free_blocks
    (1, (((1, 2),), ((3, 4),)), 4)
    """
    err = _shape(state, spec, checked)
    if err is not None:
        return Failure(err)
    if type(reserve) is not int or reserve < 0:
        return Failure(
            invalid(
                f"reserve must be a non-negative integer (blocks to leave free), got {shown(reserve):.80}",
                request=spec.request_id,
                field="reserve",
            )
        )
    cfg = state.config
    rid, rows = spec.request_id, spec.rows
    per_row = [cfg.blocks_for(row.num_tokens) for row in rows]
    hit = _hit(state, spec)
    if isinstance(hit, KVError):
        return Failure(hit)
    firsts = _firsts(cfg, spec, hit)
    held, need = _cost(state, spec, hit, firsts)
    err = _over_limits(state, spec, held)
    if err is not None:
        return Failure(err)
    if need + reserve > state.free_blocks:
        kept = f", {reserve} kept back" if reserve else ""
        return fail(
            ErrorCode.NO_CAPACITY,
            f"request {shown(rid)} needs {need} blocks; {state.free_blocks} are free{kept}",
            rid,
            requested=need,
            available=max(state.free_blocks - reserve, 0),
        )
    txn = Txn(state)
    slots, blocks = _reserve(txn, spec, per_row, hit, firsts)
    cached = hit.num_blocks * cfg.block_size
    if cfg.enable_prefix_caching:
        txn.prefix_queries += sum(row.num_tokens for row in rows)
        txn.prefix_hits += cached * len(rows)
    layouts = tuple(RowLayout(r.prefix_len, r.target_len, r.spans) for r in rows)
    # the commit and growth loops do the common row of a one-row request that may grow
    decode_slot = slots[0] if len(slots) == 1 and not layouts[0].is_diffusion else -1
    txn.requests[rid] = Request(
        rid,
        tuple(slots),
        layouts,
        spec.extra_keys,
        decode_slot,
        state.cache_epoch,
        BlockKeys.of(spec.extra_keys, content=spec.content, first=spec.first_block_keys, kind=cfg.block_hash),
        tuple(row.block_hashes for row in rows) if any(row.block_hashes for row in rows) else (),
    )
    gen = txn.new_layout(slots[0])
    effect = Admitted(rid, gen, (cached,) * len(rows), tuple(blocks), tuple(txn.events))
    return Success(Step(txn.done(), effect))


def refusal(state: KVState, spec: RequestSpec, *, checked: bool = False) -> KVError | None:
    """Why ``admit`` refuses ``spec`` whatever else the pool holds (``INVALID``, ``UNSCHEDULABLE``, a duplicate
    id), or None. A request is refused for good only when it cannot run alone in the pool: every usable block
    free, its prefix-cache hit (as the cache holds it now) taken, each group holding what it holds of a row
    computed from the hit on (a window group only the blocks a query past the hit can see).

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9, max_model_len=16))
    >>> refusal(s, RequestSpec("a", (RowSpec(40),))).message
    "request 'a' row 0 has 40 tokens, over max_model_len 16"
    >>> refusal(s, RequestSpec("b", (RowSpec(12),)*3)).message
    "request 'b' needs 9 blocks; the pool has 8 usable blocks in all"
    """
    err = _shape(state, spec, checked)
    if err is not None:
        return err
    hit = _hit(state, spec)
    if isinstance(hit, KVError):
        return hit
    return _over_limits(state, spec, _cost(state, spec, hit, _firsts(state.config, spec, hit))[0])


def turn_away(state: KVState, spec: RequestSpec) -> Result[Step[TurnedAway], KVError]:
    """What vLLM-Omni 0.30's diffusion KV manager leaves in its pool when a CFG request does not fit now (where
    ``admit`` refuses with ``NO_CAPACITY`` and changes nothing): its lookup's hits pinned (out of the free queue);
    its rows given blocks one after another while the next fits (fresh blocks popped from the head, a cached one
    evicted); those rows freed again, the last first, as ``free_queue="vllm-omni"`` frees rows (fresh blocks to
    the head); then the pins, the last hit first (cached: to the tail). For a caller that must leave the pool as
    vLLM-Omni's does, block for block (``integrations.vllm_omni``: docs/vllm-omni.md); refused (``INVALID``,
    nothing changed) but under ``free_queue="vllm-omni"`` with groups that hold a block for every position (full
    attention, MLA: no window or state group), and for a request that fits.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, free_queue, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9, free_queue="vllm-omni"))
    >>> step = turn_away(s, RequestSpec("img", (RowSpec(12, prefix_len=8, target_len=4),) * 3))
    >>> step.unwrap().effect.rows_tried, free_queue(step.unwrap().state)
    (2, [1, 2, 3, 4, 5, 6, 7, 8])
    """
    cfg = state.config
    err = _shape(state, spec)
    if err is None and (cfg.free_queue != "vllm-omni" or any(r.nulls_positions for r in cfg.rules)):
        err = invalid(
            "turn_away is vLLM-Omni's refusal: it needs free_queue='vllm-omni' and groups that hold a block "
            "for every position (full attention, MLA)",
            request=spec.request_id,
        )
    if err is not None:
        return Failure(err)
    hit = _hit(state, spec)
    if isinstance(hit, KVError):
        return Failure(hit)
    firsts = _firsts(cfg, spec, hit)
    need = _cost(state, spec, hit, firsts)[1]
    if need <= state.free_blocks:
        return Failure(invalid(f"request {shown(spec.request_id)} fits: admit it", request=spec.request_id))
    txn = Txn(state)
    pinned = list(dict.fromkeys(b for row_ids in hit.ids for ids in row_ids for b in ids if b > 0))
    pool.take_hits(txn, pinned)  # (vLLM's touch: no allocation below evicts a hit)
    taken: list[list[tuple[int, ...]]] = []
    for row in spec.rows:
        fresh = cfg.blocks_for(row.num_tokens) - hit.num_blocks
        if fresh * len(cfg.groups) > txn.free_blocks:
            break
        taken.append([pool.pop_blocks(txn, fresh) for _ in cfg.groups])
    pool.free_rows_as_vllm_omni(txn, taken)  # the rollback: the rows' fresh blocks back, the last row first
    pool.unref_many(txn, pinned[::-1])
    return Success(Step(txn.done(), TurnedAway(spec.request_id, len(taken), tuple(txn.events))))


def _shape(state: KVState, spec: RequestSpec, checked: bool = False) -> KVError | None:
    """What is wrong with ``spec`` before any count: its form (unless ``checked`` already), the block hashes it
    brings, and rows a state group cannot serve."""
    err = (None if checked else check_request_spec(spec)) or _state_rows(state, spec)
    width_checked = checked and not spec.rows[0].block_hashes  # (a scheduler's hashes: its own, of the pool's kind)
    if (
        err is None
        and not width_checked
        and not set(map(len, chain(spec.block_hashes, *(row.block_hashes for row in spec.rows))))
        <= {state.config.hash_width}
    ):
        width = state.config.hash_width
        return invalid(
            f"request {shown(spec.request_id)}: block_hashes must be {width}-byte hashes ({state.config.block_hash})",
            request=spec.request_id,
            field="block_hashes",
        )
    return err


def _hit(state: KVState, spec: RequestSpec) -> Hit | KVError:
    """``find_hit``, a given block hash that is not the core's (``check_given_hashes``) refused."""
    try:
        return find_hit(state, spec)
    except GivenHashError as e:
        return e.refusal(spec.request_id)


def _state_rows(state: KVState, spec: RequestSpec) -> KVError | None:
    """State groups hold a row's state as it runs from position 0: a diffusion row (a target rewritten each
    step) or KV that arrives from elsewhere has no state here."""
    if state.config.recurrent:
        for i, row in enumerate(spec.rows):
            if row.prefix_len is not None or row.spans or row.pending_tokens:
                what = "pending_tokens" if row.pending_tokens else "a diffusion layout (prefix_len, spans)"
                return KVError(
                    ErrorCode.INVALID,
                    f"request {shown(spec.request_id)} row {i} has {what}; a pool "
                    "with state (Mamba) groups serves rows computed from their first token",
                    request=spec.request_id,
                    field="rows",
                )
    return None


def growing_refusal(state: KVState, spec: RequestSpec, *, checked: bool = False) -> KVError | None:
    """``refusal`` for a request whose rows are admitted a chunk at a time, judged without a hit: a windowed
    group holds only its window and a chunk, and a row near the pool's size is computed in chunks small enough
    (``CacheConfig.growing_chunk``), so the pool must hold what a row holds computed a token at a time
    (``held_growing``); what a scheduler checks before it admits a prefix.

    >>> from pagedkv.core import CacheConfig, GroupKind, GroupSpec, RequestSpec, RowSpec, initial_state
    >>> groups = (GroupSpec("full"), GroupSpec("w", GroupKind.SLIDING_WINDOW, window=8))
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=40, groups=groups))
    >>> refusal(s, RequestSpec("a", (RowSpec(100),))).code.value, growing_refusal(s, RequestSpec("a", (RowSpec(100),)))
    ('UNSCHEDULABLE', None)
    """
    cfg = state.config
    return _shape(state, spec, checked) or _over_limits(
        state, spec, sum(cfg.held_growing(r.num_tokens, 1) for r in spec.rows)
    )


def _over_limits(state: KVState, spec: RequestSpec, held: int) -> KVError | None:
    """Why ``spec``, holding ``held`` blocks at most, can never be admitted here (rows, length, the whole
    pool), or a duplicate id."""
    cfg, rid, rows = state.config, spec.request_id, spec.rows
    limit = cfg.max_rows_per_request
    if limit is not None and len(rows) > limit:
        return KVError(
            ErrorCode.UNSCHEDULABLE,
            f"request {shown(rid)} has {len(rows)} rows, over max_rows_per_request {limit}",
            request=rid,
            requested=len(rows),
            available=limit,
        )
    if cfg.max_model_len is not None:
        for i, row in enumerate(rows):
            if row.num_tokens > cfg.max_model_len:
                return KVError(
                    ErrorCode.UNSCHEDULABLE,
                    f"request {shown(rid)} row {i} has {shown(row.num_tokens)} tokens, over "
                    f"max_model_len {cfg.max_model_len}",
                    request=rid,
                    requested=row.num_tokens,
                    available=cfg.max_model_len,
                )
    if held > cfg.usable_blocks:
        return KVError(
            ErrorCode.UNSCHEDULABLE,
            f"request {shown(rid)} needs {held} blocks; the pool has {cfg.usable_blocks} usable blocks in all",
            request=rid,
            requested=held,
            available=cfg.usable_blocks,
        )
    if rid in state.requests:
        return KVError(ErrorCode.DUPLICATE_REQUEST, f"request {shown(rid)} is already admitted", request=rid)
    return None


def _firsts(cfg: Any, spec: RequestSpec, hit: Hit) -> list[list[int]]:
    """Per row, per group: the first block a query of the row can see, the null block before it. A row's
    first computed position is past its hit and past KV that arrives from elsewhere (a diffusion row's
    target is rewritten, so never past its prefix); a full group sees from block 0."""
    cached = hit.num_blocks * cfg.block_size
    out = []
    for row in spec.rows:
        c = max(cached, row.pending_tokens)
        c = min(c, row.prefix_len) if row.prefix_len is not None else c
        out.append([r.first_visible_block(c, cfg.block_size) for r in cfg.rules])
    return out


def _cost(state: KVState, spec: RequestSpec, hit: Hit, firsts: list[list[int]]) -> tuple[int, int]:
    """What admitting ``spec`` with ``hit`` costs: the blocks it then holds (every group of every row, a hit
    block shared by rows once) and the blocks it takes from the free queue (fresh ones, and hit blocks no
    one holds). One count for the permanent refusal, the capacity check and ``_reserve``'s pops."""
    cfg, refcount = state.config, state.refcount
    fresh = 0
    hits: set[int] = set()
    for row, row_ids, row_firsts in zip(spec.rows, hit.ids, firsts):
        nb = cfg.blocks_for(row.num_tokens)
        for rules, ids, first in zip(cfg.rules, row_ids, row_firsts):
            popped, shared = rules.admission_cost(nb, ids, first)
            fresh += popped
            hits.update(shared)
    return fresh + len(hits), fresh + sum(1 for b in hits if refcount[b] == 0)


def _reserve(
    txn: Txn, spec: RequestSpec, per_row: list[int], hit: Hit, firsts: list[list[int]]
) -> tuple[list[int], list[Blocks]]:
    """Take the hit's blocks, then pop each row's fresh ones (a windowed group the null block before
    ``firsts``): the rows' slots and block lists."""
    cfg = txn.base.config
    cached = hit.num_blocks * cfg.block_size
    computed = [max(cached, row.pending_tokens) for row in spec.rows]
    rules = cfg.rules
    for row_ids, row_firsts in zip(hit.ids, firsts):  # hits first, so popping new blocks never evicts one of them
        for r, group_ids, first in zip(rules, row_ids, row_firsts):
            saved = r.taken_over(group_ids)
            if saved is not None:
                take_state(txn, saved)
            pool.take_hits(txn, r.hit_taken(group_ids, first))
    if cfg.host_store_threshold > 1:  # (a use of each content hit: what the tier keeps, core/store/host.py)
        for hashes in hit.hashes:
            txn.host.use(hashes, cfg.host_store_threshold, cfg.host_tracker_size)
    # the host tier's hit blocks pinned, with their slots, position by position: no pop below drops them
    loads = [
        [(j, g, txn.host.touch((g, hashes[j]))) for j in range(hit.num_blocks) for g, ids in enumerate(row_ids)
         if ids[j] == HOSTED]
        for hashes, row_ids in zip(hit.hashes, hit.ids)
    ] if txn.config.host_blocks else None  # fmt: skip
    pop = partial(pool.pop_blocks, txn)
    slots, blocks = [], []
    for r_i, (row, nb, row_ids, hashes, c, row_firsts) in enumerate(
        zip(spec.rows, per_row, hit.ids, hit.hashes, computed, firsts)
    ):
        rb = tuple(r.admitted(ids, nb, first, pop) for r, ids, first in zip(rules, row_ids, row_firsts))
        for j, g, slot in loads[r_i] if loads else ():  # those blocks into the fresh ones at their positions
            pool.onload(txn, g, hashes[j], slot, rules[g].loaded_into(rb[g], j))
        p = row.pending_tokens
        # destination blocks: what the prefix cache already holds is present; the rest arrives
        pending: Pending = (p, frozenset(range(hit.num_blocks, cfg.blocks_for(p)))) if p else NO_PENDING
        if cfg.enable_prefix_caching and row.tokens is not None:  # the ids stay known while the row grows by ids
            record = Row(rb, ids_plus((), pack_ids(row.tokens)), b"".join(hashes), pending, cfg.hash_width)
            tail = as_tail(b"", row.placeholders > 0)  # (its last positions await their ids)
        else:
            record, tail = Row(rb, None, b"".join(hashes), pending, cfg.hash_width), None
        slots.append(txn.new_slot(row.num_tokens, c, record, tail))
        blocks.append(rb)
    return slots, blocks


def take_state(txn: Txn, saved: int) -> None:
    """The saved state at a hit's boundary becomes the row's: out of the cache (it will be rewritten, so no
    other request may hit it), out of the free queue."""
    pool.evict(txn, saved)
    pool.take_hits(txn, (saved,))
