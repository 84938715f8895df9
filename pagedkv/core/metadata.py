"""The metadata snapshot the core hands the shell for one forward.

Immutable, small, picklable; no tensors. ``publish`` builds it and takes no
generation: the snapshot carries the latest one, which is what a worker checks.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import overload

from returns.result import Failure, Result, Success

from pagedkv.core.errors import ErrorCode, KVError, RequestId, invalid, is_request_id
from pagedkv.core.spec import Span
from pagedkv.core.state import NO_PENDING, SLOT_SHIFT, Blocks, KVState, Request, Step


class Phase(StrEnum):
    PREFILL = "prefill"  # prefill, chunk of it, or a first denoising step
    DENOISE = "denoise"  # a later denoising step: only the target span is rewritten
    DECODE = "decode"  # one query token per row


@dataclass(frozen=True, slots=True)
class Segment:
    """Query positions ``[q_start, q_end)`` and the key bound they see.

    Causal: position p sees keys ``[0, p]`` (``kv_end`` is the segment's end).
    Full: every query sees keys ``[0, kv_end)``, the end of its full span.
    Positions are absolute within the row.
    """

    causal: bool
    q_start: int
    q_end: int
    kv_end: int


@dataclass(frozen=True, slots=True)
class RowMetadata:
    request_id: RequestId
    row: int
    block_ids: Blocks  # per group, ceil(row length / block_size) ids; 0 = null
    seq_len: int  # keys of this forward end here
    query_len: int
    kv_start_pos: int  # first query position
    slots: tuple[int, ...]  # group 0 slot of each query position
    segments: tuple[Segment, ...]


class DecodeRows(Sequence[RowMetadata]):
    """The rows of a decode forward as columns: one query token a row, one causal segment.

    What ``publish`` hands out for the common decode (one-row requests, no full spans): a
    sequence of ``RowMetadata`` built when read, so a step over a thousand requests makes
    four columns instead of four thousand records. A worker can read the columns directly
    (``seq_lens``, ``slots``: ``array('q')``; ``block_ids``: the rows' own block lists).
    Equal to the tuple of its rows, picklable, and never changed.
    """

    __slots__ = ("request_ids", "block_ids", "seq_lens", "slots")

    def __init__(self, request_ids: tuple[RequestId, ...], block_ids: tuple[Blocks, ...], seq_lens: array[int],
                 slots: array[int]) -> None:  # fmt: skip
        self.request_ids = request_ids
        self.block_ids = block_ids
        self.seq_lens = seq_lens
        self.slots = slots

    def __len__(self) -> int:
        return len(self.request_ids)

    @overload
    def __getitem__(self, i: int) -> RowMetadata: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[RowMetadata, ...]: ...

    def __getitem__(self, i: int | slice) -> RowMetadata | tuple[RowMetadata, ...]:
        if isinstance(i, slice):
            return tuple(self[k] for k in range(*i.indices(len(self))))
        n = self.seq_lens[i]
        return RowMetadata(self.request_ids[i], 0, self.block_ids[i], n, 1, n - 1, (self.slots[i],),
                           (Segment(True, n - 1, n, n),))  # fmt: skip

    def __iter__(self) -> Iterator[RowMetadata]:
        return (self[k] for k in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DecodeRows):
            return (self.request_ids == other.request_ids and self.seq_lens == other.seq_lens
                    and self.slots == other.slots and self.block_ids == other.block_ids)  # fmt: skip
        return isinstance(other, tuple) and tuple(self) == other

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"DecodeRows({tuple(self)!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (DecodeRows, (self.request_ids, self.block_ids, self.seq_lens, self.slots))


@dataclass(frozen=True, slots=True)
class KVMetadata:
    """Everything a worker needs to install for one forward.

    ``rows`` is a tuple of ``RowMetadata``, or for a decode forward of one-row
    requests a ``DecodeRows`` (the same rows, as columns).
    """

    generation: int
    epoch: int
    block_size: int
    phase: Phase
    rows: Sequence[RowMetadata]

    @property
    def num_query_tokens(self) -> int:
        return sum(r.query_len for r in self.rows)


def segments_of(spans: Sequence[Span], seq_len: int, q_start: int) -> tuple[Segment, ...]:
    """Cut the query ``[q_start, seq_len)`` into causal gaps and full spans.

    >>> [(s.causal, s.q_start, s.q_end, s.kv_end) for s in segments_of([(4, 8)], 10, 0)]
    [(True, 0, 4, 4), (False, 4, 8, 8), (True, 8, 10, 10)]
    >>> [(s.causal, s.q_start, s.kv_end) for s in segments_of([(4, 8)], 8, 6)]
    [(False, 6, 8)]
    """
    pieces: list[tuple[bool, int, int]] = []
    pos = 0
    for a, b in spans:
        if a >= seq_len:
            break
        b = min(b, seq_len)
        if a > pos:
            pieces.append((True, pos, a))
        pieces.append((False, a, b))
        pos = b
    if pos < seq_len:
        pieces.append((True, pos, seq_len))
    return tuple(Segment(causal, max(a, q_start), b, b) for causal, a, b in pieces if b > q_start)


def slots_of(blocks: Sequence[int], block_size: int, start: int, count: int) -> tuple[int, ...]:
    """Slot of position p: ``blocks[p // block_size] * block_size + p % block_size``.

    >>> slots_of([3, 1], 16, 17, 2)
    (17, 18)
    """
    return tuple(blocks[p // block_size] * block_size + p % block_size for p in range(start, start + count))


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
    if not isinstance(phase, str) or phase not in _PHASES:
        return Failure(invalid(f"phase must be one of {sorted(_PHASES)}, got {phase!r}", field="phase"))
    phase = Phase(phase)
    if not isinstance(request_ids, (list, tuple)) or not request_ids:
        return Failure(invalid("publish needs a non-empty list of request ids", field="requests"))
    seen: set[RequestId] = set()
    for rid in request_ids:
        if not is_request_id(rid):
            return Failure(invalid(f"request id must be a string or an integer, got {rid!r}", field="requests"))
        if rid in seen:
            return Failure(invalid(f"request {rid!r} is named twice in one publish", request=rid, field="requests"))
        seen.add(rid)
    bs = state.config.block_size
    rows: list[RowMetadata] = []
    structure: tuple[bool, ...] | None = None
    requests = []
    for rid in request_ids:  # every id resolves before any row is judged
        req = state.requests.get(rid)
        if req is None:
            return Failure(KVError(ErrorCode.UNKNOWN_REQUEST, f"request {rid!r} is not admitted", request=rid))
        requests.append(req)
    if phase is Phase.DECODE:
        columns = _decode_columns(state, requests)
        if columns is not None:
            return Success(Step(state, KVMetadata(state.generation, state.epoch, bs, phase, columns)))
    row_len, records = state.row_len, state.rows
    for req in requests:
        rid = req.request_id
        for i, slot in enumerate(req.slots):
            layout = req.layouts[i]
            length = row_len[slot]
            record = records[slot]
            blocks = record.blocks
            if phase is Phase.PREFILL:
                seq_len = length
                start = state.row_computed[slot]
                if start >= seq_len:
                    return Failure(invalid(f"request {rid!r} row {i}: all {seq_len} tokens are computed; "
                                           "nothing to prefill", request=rid, field="phase"))  # fmt: skip
                limit = query_limits.get(rid) if query_limits else None
                if limit is not None:
                    if type(limit) is not int or limit < 1:
                        return Failure(invalid(f"query limit of request {rid!r} must be a positive integer",
                                               request=rid, field="query_limits"))  # fmt: skip
                    seq_len = min(seq_len, start + limit)
            elif phase is Phase.DENOISE:
                if layout.prefix_len is None or layout.target_len is None:
                    return Failure(invalid(f"request {rid!r} row {i} is not a diffusion row; it cannot denoise",
                                           request=rid, field="phase"))  # fmt: skip
                start = layout.prefix_len
                seq_len = layout.prefix_len + layout.target_len
            else:
                if layout.is_diffusion:
                    return Failure(invalid(f"request {rid!r} row {i} is a diffusion row; it cannot decode",
                                           request=rid, field="phase"))  # fmt: skip
                seq_len = length
                start = length - 1
            if phase is Phase.DECODE and not layout.spans:  # the common case, without the general cut
                segments: tuple[Segment, ...] = (Segment(True, start, seq_len, seq_len),)
                flags: tuple[bool, ...] = _CAUSAL
            else:
                segments = segments_of(layout.spans, seq_len, start)
                flags = tuple(s.causal for s in segments)
            if structure is None:
                structure = flags
            elif flags != structure:
                return Failure(invalid(
                    f"request {rid!r} row {i} has segments {_flags(flags)} but the forward's first row has "
                    f"{_flags(structure)}; rows of one forward need the same segment structure",
                    request=rid, field="requests"))  # fmt: skip
            _, pending = record.pending
            if pending and min(pending) * bs < seq_len:
                return Failure(invalid(f"request {rid!r} row {i}: block position {min(pending)} is pending (its KV "
                                       "has not arrived); attention cannot read it", request=rid, field="pending"))  # fmt: skip
            query = seq_len - start
            rows.append(RowMetadata(
                rid, i, blocks, seq_len, query, start, slots_of(blocks[0], bs, start, query), segments))  # fmt: skip
    meta = KVMetadata(state.generation, state.epoch, bs, phase, tuple(rows))
    return Success(Step(state, meta))


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
