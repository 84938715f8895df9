"""The metadata snapshot the core hands the shell for one forward (its contract: docs/core.md, "The metadata snapshot").

Immutable, small, picklable; no tensors. ``core.outputs.snapshot.publish`` builds it and takes no
generation: the snapshot carries the latest one, which is what a worker checks.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import chain
from typing import overload

from pagedkv.core.errors import RequestId, shown
from pagedkv.core.spec import Span
from pagedkv.core.store.state import Blocks


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

    def __init__(
        self, request_ids: tuple[RequestId, ...], block_ids: tuple[Blocks, ...], seq_lens: array[int], slots: array[int]
    ) -> None:
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
        return RowMetadata(
            self.request_ids[i], 0, self.block_ids[i], n, 1, n - 1, (self.slots[i],), (Segment(True, n - 1, n, n),)
        )

    def __iter__(self) -> Iterator[RowMetadata]:
        return (self[k] for k in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DecodeRows):
            return (
                self.request_ids == other.request_ids
                and self.seq_lens == other.seq_lens
                and self.slots == other.slots
                and self.block_ids == other.block_ids
            )
        return isinstance(other, tuple) and tuple(self) == other

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"DecodeRows({shown(tuple(self))})"

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
    if count <= 0:
        return ()
    end, bs = start + count, block_size
    first, last = start // bs, (end - 1) // bs
    if first == last:  # (a decode's, a short chunk's: one block)
        base = blocks[first] * bs
        return tuple(range(base + start % bs, base + (end - 1) % bs + 1))
    # a run of whole blocks: a range a block, joined at C speed
    runs = [range(blocks[first] * bs + start % bs, blocks[first] * bs + bs)]
    runs += [range(b * bs, b * bs + bs) for b in blocks[first + 1 : last]]
    runs.append(range(blocks[last] * bs, blocks[last] * bs + (end - 1) % bs + 1))
    return tuple(chain.from_iterable(runs))


def token_rows_of(meta: KVMetadata) -> KVMetadata:
    """A causal snapshot's query tokens as decode rows: each position p of a row a row of length p + 1 over
    the same block lists, its own slot (what the decode kernel computes for that position)."""
    rids, blocks, lens, slots = [], [], array("q"), array("q")
    for r in meta.rows:
        q = r.query_len
        rids.extend([r.request_id] * q)
        blocks.extend([r.block_ids] * q)
        lens.extend(range(r.kv_start_pos + 1, r.seq_len + 1))
        slots.extend(r.slots)
    return KVMetadata(
        meta.generation, meta.epoch, meta.block_size, Phase.DECODE, DecodeRows(tuple(rids), tuple(blocks), lens, slots)
    )
