"""A row's token ids as the state keeps them: eight little-endian bytes an id (``bytes``, which the GC does
not track), the ids of whole blocks in the row's record and the rest in its tail; the tail's type marks a
row whose later positions await their ids (``Awaiting``: it grew by placeholders).

The record's ids are ``Ids``: a tuple of chunks of ``CHUNK`` bytes (1,024 ids) but the last, which holds the rest
and is never empty. A block's ids join a row by copying its last chunk at most, never the row's whole history: a
12,288-token row copied 96 KiB, page faults and all, at each block it moved past (55 us a row in a decode step of 64
such rows)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any, Protocol


class _Record(Protocol):
    @property
    def chunked(self) -> int: ...

    def with_ids(self, more: bytes) -> Any: ...


CHUNK = 1 << 13  # bytes of a row's ids a chunk holds (1,024 ids)

Ids = tuple[bytes, ...]


def ids_count(ids: Ids) -> int:
    """How many ids ``ids`` holds."""
    return ((len(ids) - 1) * CHUNK + len(ids[-1])) >> 3 if ids else 0


def ids_plus(ids: Ids, more: bytes) -> Ids:
    """``ids`` followed by the packed ids ``more``: the last chunk filled first, then new ones.

    >>> from pagedkv.core.store import tails
    >>> x = tails.ids_plus(tails.ids_plus((), b"a" * (CHUNK - 8)), b"b" * 24)
    >>> [len(c) for c in x], tails.ids_count(x), tails.ids_span(x, 1022, 1025)
    ([8192, 16], 1026, b'aaaaaaaabbbbbbbbbbbbbbbb')
    """
    if not more:
        return ids
    if ids and len(last := ids[-1]) < CHUNK:
        room = CHUNK - len(last)
        ids = (*ids[:-1], last + more[:room])
        more = more[room:]
    if more:
        ids = ids + tuple(more[i : i + CHUNK] for i in range(0, len(more), CHUNK))
    return ids


def ids_span(ids: Ids, start: int, end: int) -> bytes:
    """The packed ids of positions ``[start, end)`` (within ``ids``)."""
    a, b = start << 3, end << 3
    if b <= a:
        return b""
    i, j = a // CHUNK, (b - 1) // CHUNK
    if i == j:
        return ids[i][a - i * CHUNK : b - i * CHUNK]
    return b"".join((ids[i][a - i * CHUNK :], *ids[i + 1 : j], ids[j][: b - j * CHUNK]))


def ids_cut(ids: Ids, n: int) -> Ids:
    """The first ``n`` ids."""
    if n >= ids_count(ids):
        return ids
    b = n << 3
    k, r = divmod(b, CHUNK)
    return ids[:k] + ((ids[k][:r],) if r else ())


def packed_known(ids: Ids, tail: bytes | None) -> bytes:
    """A row's known ids, packed in one ``bytes``: its record's chunks, then its tail."""
    return b"".join((*ids, tail)) if tail else b"".join(ids)


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as the tail stores them: eight little-endian bytes each (an ``array("Q")`` as it is)."""
    return ids.tobytes() if type(ids) is array else array("Q", ids).tobytes()


class Awaiting(bytes):
    """A row's tail while positions past its known ids await theirs (it grew by placeholders): the known ids,
    as any tail holds them. Its type is the mark the growth loop tests (``type(tail) is Awaiting``): a row
    awaiting ids goes to the general rule, which refuses ids appended past the gap."""

    __slots__ = ()


def as_tail(ids: bytes, awaiting: bool) -> bytes:
    """A tail of ``ids``, marked ``Awaiting`` while positions past them have no ids yet.

    >>> type(as_tail(b"", True)).__name__, type(as_tail(b"", False)).__name__
    ('Awaiting', 'bytes')
    """
    return Awaiting(ids) if awaiting else bytes(ids)


def known_ids(record: _Record, tail: bytes | None, chunked: int | None = None) -> int:
    """How many leading positions of a row have known token ids (its record's, then its tail's); ``chunked``: the
    record's count, where the caller has it."""
    return (record.chunked if chunked is None else chunked) + (len(tail) >> 3 if tail is not None else 0)


def unpack_ids(data: bytes) -> tuple[int, ...]:
    a = array("Q")
    a.frombytes(data)
    return tuple(a)


def with_more_ids(
    ids: Ids, tail: bytes, packed: bytes, bs: int, *, awaiting: bool, chunked: int | None = None
) -> tuple[Ids, bytes]:
    """A row's ids (its record's) and tail once ``packed`` ids follow its known ones: the blocks before the one
    holding the last known id join the ids, the rest stay in the tail (marked while positions still await ids).
    ``chunked``: how many ids ``ids`` holds, where the caller has counted them."""
    if chunked is None:
        chunked = ids_count(ids)
    tail += packed
    last_block = (chunked + (len(tail) >> 3) - 1) // bs * bs
    if last_block > chunked:  # ids reached a new block: the blocks before join the record's
        cut = (last_block - chunked) << 3
        ids = ids_plus(ids, tail[:cut])
        tail = tail[cut:]
    return ids, as_tail(tail, awaiting)
