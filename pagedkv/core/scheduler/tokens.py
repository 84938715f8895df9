"""What each request generated: a persistent log the scheduler appends to every step.

A tuple that grows by one id a step costs O(length) a step and a new tracked
record a request; here a request's ids are two ``bytes`` values by slot (eight
little-endian bytes an id): ``done`` (every id but the last few) and ``recent``
(the last 1..64), so an append copies at most 512 bytes and every 64th moves
``recent`` into ``done``. Bytes are invisible to CPython's GC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from immutables import Map

from pagedkv.core.errors import RequestId
from pagedkv.core.store.tails import unpack_ids
from pagedkv.core.store.vec import Vec, VecEdit

_SHIFT = 5
_RECENT = 64 << 3  # bytes in ``recent`` before it moves to ``done``


@dataclass(frozen=True, slots=True)
class TokenLog:
    """Per request: the ids it generated so far.

    >>> e = TokenLog.empty().edit()
    >>> e.add("a"); e.append("a", 5); e.append("a", 9)
    >>> log = e.persistent()
    >>> log.tokens("a"), log.count("a"), log.last("a")
    ((5, 9), 2, 9)
    """

    slot_of: Map[RequestId, int]
    done: Vec[bytes]
    recent: Vec[bytes]
    free: Vec[int]  # free slots: entries [0, free_top) are free
    free_top: int

    @staticmethod
    def empty() -> TokenLog:
        none: Vec[Any] = Vec.of((), ints=False, shift=_SHIFT)
        return TokenLog(Map(), none, none, Vec.of((), ints=True, shift=_SHIFT), 0)

    def __contains__(self, rid: RequestId) -> bool:
        return rid in self.slot_of

    def tokens(self, rid: RequestId) -> tuple[int, ...]:
        slot = self.slot_of[rid]
        return unpack_ids(self.done[slot] + self.recent[slot])

    def count(self, rid: RequestId) -> int:
        slot = self.slot_of[rid]
        return (len(self.done[slot]) + len(self.recent[slot])) >> 3

    def last(self, rid: RequestId) -> int:
        """The last id ``rid`` generated (it has generated one)."""
        slot = self.slot_of[rid]
        return int.from_bytes(self.recent[slot][-8:], "little")

    def ids(self, rid: RequestId, start: int, end: int) -> tuple[int, ...]:
        """Ids ``[start, end)`` of what ``rid`` generated, unpacking only those."""
        slot = self.slot_of[rid]
        done, recent = self.done[slot], self.recent[slot]
        split = len(done) >> 3
        if start >= split:
            return unpack_ids(recent[(start - split) << 3 : (end - split) << 3])
        return unpack_ids(done[start << 3 : end << 3] + recent[: max(0, end - split) << 3])

    def last_many(self, rids: Sequence[RequestId]) -> list[int]:
        """The last id each of ``rids`` generated (each has generated one)."""
        get, leaves, mask = self.slot_of.__getitem__, self.recent.leaves, (1 << _SHIFT) - 1
        out = []
        for r in rids:
            slot = get(r)
            out.append(int.from_bytes(leaves[slot >> _SHIFT][slot & mask][-8:], "little"))
        return out

    def edit(self) -> TokenLogEdit:
        return TokenLogEdit(self)


class TokenLogEdit:
    """A transition's working copy of a ``TokenLog``."""

    __slots__ = ("base", "slots", "done", "recent", "free", "free_top")

    def __init__(self, base: TokenLog) -> None:
        self.base = base
        self.slots = base.slot_of.mutate()
        self.done: VecEdit[bytes] = VecEdit(base.done)
        self.recent: VecEdit[bytes] = VecEdit(base.recent)
        self.free: VecEdit[int] = VecEdit(base.free)
        self.free_top = base.free_top

    def add(self, rid: RequestId, ids: Sequence[int] = ()) -> None:
        """A new request (``rid`` is not in the log), with the ids it has generated so far."""
        packed = b"".join(t.to_bytes(8, "little") for t in ids)
        cut = max(0, len(packed) - _RECENT)
        if self.free_top:
            self.free_top -= 1
            slot = self.free[self.free_top]
            self.done[slot], self.recent[slot] = packed[:cut], packed[cut:]
        else:
            slot = self.done.append(packed[:cut])
            self.recent.append(packed[cut:])
        self.slots[rid] = slot

    def drop(self, rid: RequestId) -> None:
        slot = self.slots.pop(rid)
        self.done[slot] = self.recent[slot] = b""
        if self.free_top < len(self.free):
            self.free[self.free_top] = slot
        else:
            self.free.append(slot)
        self.free_top += 1

    def append_many(self, rids: Sequence[RequestId], tokens: Sequence[int]) -> list[int]:
        """``tokens[k]`` joins what ``rids[k]`` generated; how many each has now. (A step's batch:
        every leaf is copied once, then written in place.)"""
        if len(rids) * 2 < len(self.recent.leaves):
            for rid, tok in zip(rids, tokens):
                self.append(rid, tok)
            return [self.count(rid) for rid in rids]
        get, recent, mask = self.slots.__getitem__, self.recent.own_all(), (1 << _SHIFT) - 1
        done = self.done
        counts = []
        for rid, tok in zip(rids, tokens):
            slot = get(rid)
            leaf, o = recent[slot >> _SHIFT], slot & mask
            ids = leaf[o]
            if len(ids) >= _RECENT:
                done[slot] += ids
                ids = b""
            ids += tok.to_bytes(8, "little")
            leaf[o] = ids
            counts.append((len(done[slot]) + len(ids)) >> 3)
        return counts

    def append(self, rid: RequestId, token: int) -> None:
        slot = self.slots[rid]
        recent = self.recent[slot]
        if len(recent) >= _RECENT:
            self.done[slot] += recent
            recent = b""
        self.recent[slot] = recent + token.to_bytes(8, "little")

    def set_last_many(self, rids: Sequence[RequestId], tokens: Sequence[int]) -> None:
        """Each ``rids[k]``'s last id becomes ``tokens[k]`` (it stood for an id not known yet: a step's ids read a
        step late); the leaves the batch writes copied once, then written in place."""
        get, recent, mask = self.slots.__getitem__, self.recent.own_for(len(rids)), (1 << _SHIFT) - 1
        for rid, tok in zip(rids, tokens):
            slot = get(rid)
            leaf, o = recent[slot >> _SHIFT], slot & mask
            leaf[o] = leaf[o][:-8] + tok.to_bytes(8, "little")

    def count(self, rid: RequestId) -> int:
        slot = self.slots[rid]
        return (len(self.done[slot]) + len(self.recent[slot])) >> 3

    def tokens(self, rid: RequestId) -> tuple[int, ...]:
        slot = self.slots[rid]
        return unpack_ids(self.done[slot] + self.recent[slot])

    def persistent(self) -> TokenLog:
        return TokenLog(
            self.slots.finish(), self.done.persistent(), self.recent.persistent(), self.free.persistent(), self.free_top
        )
