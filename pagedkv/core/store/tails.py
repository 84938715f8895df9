"""A row's token ids as the state keeps them: eight little-endian bytes an id (``bytes``, which the GC does
not track), the ids of whole blocks in the row's record and the rest in its tail; the tail's type marks a
row whose later positions await their ids (``Awaiting``: it grew by placeholders)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any, Protocol


class _Record(Protocol):
    @property
    def chunked(self) -> int: ...

    def with_ids(self, more: bytes) -> Any: ...


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


def known_ids(record: _Record, tail: bytes | None) -> int:
    """How many leading positions of a row have known token ids (its record's, then its tail's)."""
    return record.chunked + (len(tail) >> 3 if tail is not None else 0)


def unpack_ids(data: bytes) -> tuple[int, ...]:
    a = array("Q")
    a.frombytes(data)
    return tuple(a)


def with_more_ids(ids: bytes, tail: bytes, packed: bytes, bs: int, *, awaiting: bool) -> tuple[bytes, bytes]:
    """A row's ids (its record's) and tail once ``packed`` ids follow its known ones: the blocks before the one
    holding the last known id join the ids, the rest stay in the tail (marked while positions still await ids)."""
    chunked = len(ids) >> 3
    tail += packed
    last_block = (chunked + (len(tail) >> 3) - 1) // bs * bs
    if last_block > chunked:  # ids reached a new block: the blocks before join the chunks
        cut = (last_block - chunked) << 3
        ids += tail[:cut]
        tail = tail[cut:]
    return ids, as_tail(tail, awaiting)
