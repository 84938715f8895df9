"""Building the metadata snapshot of one forward (``publish``): each row's query in its phase,
its segments and slots, checked before anything is handed out."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence

from returns.result import Failure, Result, Success

from pagedkv.core.errors import ErrorCode, KVError, RequestId, invalid, is_request_id, is_seq, shown
from pagedkv.core.outputs.metadata import DecodeRows, KVMetadata, Phase, RowMetadata, Segment, segments_of, slots_of
from pagedkv.core.store.state import NO_PENDING, SLOT_SHIFT, KVState, Request, Step


def publish(
    state: KVState,
    request_ids: Sequence[RequestId],
    phase: Phase | str,
    *,
    query_limits: Mapping[RequestId, int] | None = None,
) -> Result[Step[KVMetadata], KVError]:
    """Build the snapshot for one forward over every row of ``request_ids``.

    Prefill: the query is the uncomputed rest of each row
    (``kv_start_pos = computed``). Denoise (diffusion rows): the query is the
    target span, keys end at ``prefix_len + target_len``. Decode: the last token.
    Every row of one forward must have the same sequence of causal flags.
    ``query_limits`` caps a prefill's query per request (chunked prefill): the
    keys of that forward end where its chunk ends.
    """
    err = _check_call(request_ids, phase, query_limits)
    if err is not None:
        return Failure(err)
    phase = Phase(phase)
    bs = state.config.block_size
    requests = []
    for rid in request_ids:  # every id resolves before any row is judged
        req = state.requests.get(rid)
        if req is None:
            return Failure(KVError(ErrorCode.UNKNOWN_REQUEST, f"request {shown(rid)} is not admitted", request=rid))
        requests.append(req)
    if phase is Phase.DECODE:
        columns = _decode_columns(state, requests)
        if columns is not None:
            return Success(Step(state, KVMetadata(state.generation, state.epoch, bs, phase, columns)))
    rows: list[RowMetadata] = []
    structure: tuple[bool, ...] | None = None
    for req in requests:
        for i, slot in enumerate(req.slots):
            made = _row(state, req, i, slot, phase, query_limits)
            if isinstance(made, KVError):
                return Failure(made)
            row, flags = made
            if structure is None:
                structure = flags
            elif flags != structure:
                return Failure(
                    invalid(
                        f"request {shown(req.request_id)} row {i} has segments {_flags(flags)} but the forward's first row "
                        f"has {_flags(structure)}; rows of one forward need the same segment structure",
                        request=req.request_id,
                        field="requests",
                    )
                )
            _, pending = state.rows[slot].pending
            if pending and min(pending) * bs < row.seq_len:
                return Failure(
                    invalid(
                        f"request {shown(req.request_id)} row {i}: block position {min(pending)} is pending "
                        "(its KV has not arrived); attention cannot read it",
                        request=req.request_id,
                        field="pending",
                    )
                )
            rows.append(row)
    return Success(Step(state, KVMetadata(state.generation, state.epoch, bs, phase, tuple(rows))))


def _check_call(
    request_ids: Sequence[RequestId], phase: Phase | str, query_limits: Mapping[RequestId, int] | None
) -> KVError | None:
    """The phase is one of the three, the ids a non-empty list of distinct request ids, the query limits a mapping."""
    if query_limits is not None and not isinstance(query_limits, Mapping):
        return invalid(
            f"query_limits must map request ids to token counts, got {shown(query_limits):.80}", field="query_limits"
        )
    if not isinstance(phase, str) or phase not in _PHASES:
        return invalid(f"phase must be one of {sorted(_PHASES)}, got {shown(phase)}", field="phase")
    if not is_seq(request_ids) or not request_ids:
        return invalid("publish needs a non-empty list of request ids", field="requests")
    seen: set[RequestId] = set()
    for rid in request_ids:
        if not is_request_id(rid):
            return invalid(f"request id must be a string or a 64-bit integer, got {shown(rid)}", field="requests")
        if rid in seen:
            return invalid(f"request {shown(rid)} is named twice in one publish", request=rid, field="requests")
        seen.add(rid)
    return None


def _query(
    state: KVState, req: Request, i: int, slot: int, phase: Phase, query_limits: Mapping[RequestId, int] | None
) -> tuple[int, int] | KVError:
    """(first query position, keys' end) of row ``i`` in this phase, or why it has no query."""
    rid, layout, length = req.request_id, req.layouts[i], state.row_len[slot]
    if phase is Phase.PREFILL:
        start = state.row_computed[slot]
        if start >= length:
            return invalid(
                f"request {shown(rid)} row {i}: all {length} tokens are computed; nothing to prefill",
                request=rid,
                field="phase",
            )
        limit = query_limits.get(rid) if query_limits else None
        if limit is None:
            return start, length
        if type(limit) is not int or limit < 1:
            return invalid(
                f"query limit of request {shown(rid)} must be a positive integer", request=rid, field="query_limits"
            )
        return start, min(length, start + limit)
    if phase is Phase.DENOISE:
        if layout.prefix_len is None or layout.target_len is None:
            return invalid(
                f"request {shown(rid)} row {i} is not a diffusion row; it cannot denoise", request=rid, field="phase"
            )
        return layout.prefix_len, layout.prefix_len + layout.target_len
    if layout.is_diffusion:
        return invalid(f"request {shown(rid)} row {i} is a diffusion row; it cannot decode", request=rid, field="phase")
    return length - 1, length


def _row(
    state: KVState, req: Request, i: int, slot: int, phase: Phase, query_limits: Mapping[RequestId, int] | None
) -> tuple[RowMetadata, tuple[bool, ...]] | KVError:
    """Row ``i``'s metadata in this phase and its segments' causal flags, or why it has no query."""
    q = _query(state, req, i, slot, phase, query_limits)
    if isinstance(q, KVError):
        return q
    start, seq_len = q
    layout, record, bs = req.layouts[i], state.rows[slot], state.config.block_size
    if phase is Phase.DECODE and not layout.spans:  # the common case, without the general cut
        segments: tuple[Segment, ...] = (Segment(True, start, seq_len, seq_len),)
        flags: tuple[bool, ...] = _CAUSAL
    else:
        segments = segments_of(layout.spans, seq_len, start)
        flags = tuple(s.causal for s in segments)
    blocks, query = record.blocks, seq_len - start
    return RowMetadata(
        req.request_id, i, blocks, seq_len, query, start, slots_of(blocks[0], bs, start, query), segments
    ), flags


def _decode_columns(state: KVState, requests: list[Request]) -> DecodeRows | None:
    """A decode forward's rows as columns, when every request is one causal row with nothing
    pending (the common decode); None sends the forward down the general path."""
    bs = state.config.block_size
    len_leaves, row_leaves = state.row_len.leaves, state.rows.leaves  # (slot vectors: leaves of 2**SLOT_SHIFT)
    mask = (1 << SLOT_SHIFT) - 1
    lens = array("q")
    slots = array("q")
    blocks = []
    for req in requests:
        slot = req.decode_slot
        if slot < 0 or req.layouts[0].spans:
            return None
        record = row_leaves[slot >> SLOT_SHIFT][slot & mask]
        if record.pending is not NO_PENDING and record.pending[1]:
            return None
        n = len_leaves[slot >> SLOT_SHIFT][slot & mask]
        lens.append(n)
        last = n - 1
        slots.append(record.blocks[0][last // bs] * bs + last % bs)
        blocks.append(record.blocks)
    return DecodeRows(tuple(r.request_id for r in requests), tuple(blocks), lens, slots)


_PHASES = frozenset(p.value for p in Phase)
_CAUSAL = (True,)


def _flags(flags: tuple[bool, ...]) -> str:
    return "[" + ", ".join("causal" if f else "full" for f in flags) + "]"
