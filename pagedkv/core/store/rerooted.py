"""Persistent values written in place: every version of one lineage shares one mutable store (Baker's trick).

The store holds the contents of one version, the current; every other version holds an undo log (``_diff``)
toward the version after it (``_next``). Reading the current version costs what reading the store does;
reading another first *reroots* the store to it, applying the logs along the way and leaving their inverses
behind, so every version stays readable and unchanged (Conchon and Filliatre, "A persistent union-find data
structure", 2007). An edit writes the store in place and logs each entry's old value on the version it edits
before writing it: a transition costs the entries it writes, never a copy.

The prefix index (index.py: dicts) and the per-block numbers (``IntArray`` below: refcounts, free-queue links)
are such lineages. What makes that safe where the core is used:

- A refusal, an exception or an interrupt in the middle of an edit leaves the edited version's log holding
  every write made so far (an old value is logged before its entry is written): reading that version rolls
  them back. A reroot first computes the inverse log, reading only, then marks itself pending and writes
  (idempotent writes of logged values); an interrupt there is finished by the next access.
- Memory is what the live versions' logs hold: a version nobody holds is collected with its log.
- States are single-thread values: two threads must not read different versions of one lineage at once
  (``pickle`` materializes one: a copy to cross a thread or a process).
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Iterable, Iterator
from typing import Any, Generic, TypeVar

from pagedkv.core.errors import InvariantError, shown


class Store:
    """What one lineage's versions share: the contents of ``current``. A kind of store says how to undo a log."""

    __slots__ = ("current", "pending")

    def __init__(self) -> None:
        self.current: Version[Any] | None = None
        self.pending: tuple[Any, ...] | None = None  # a reroot whose writes an interrupt may have cut short

    def inverse(self, log: Any) -> Any:
        """The log that takes the store from the version ``log`` leads to back there, once ``log`` is applied
        (reading only)."""
        raise NotImplementedError

    def apply(self, log: Any) -> None:
        """Write ``log``'s old values (idempotent: a reroot cut short writes them again)."""
        raise NotImplementedError


S = TypeVar("S", bound=Store)


class Version(Generic[S]):
    """One version of a lineage: the store's current, or an undo log toward ``_next``."""

    __slots__ = ("_store", "_diff", "_next")

    def __init__(self, store: S) -> None:
        self._store = store
        self._diff: Any = None  # applied to ``_next``'s contents, gives this version's
        self._next: Version[S] | None = None

    def _here(self) -> S:
        """The store, holding this version's contents."""
        store = self._store
        if store.current is not self or store.pending is not None:  # (the common case: one attribute, one compare)
            _reroot(self)
        return store


def fork(base: Version[S], node: Version[S], log: Any) -> S:
    """``node`` becomes the store's current, to be written in place; ``base`` leaves the store first, with the
    empty ``log`` that the writes fill with their old values. Returns the store."""
    store = base._here()
    base._diff, base._next = log, node
    store.current = node
    return store


def _finish(store: Store) -> None:
    """Complete the pending reroot: its writes (idempotent), then the pointers, the mark cleared last."""
    node, after, log, inverse = store.pending  # type: ignore[misc]
    store.apply(log)
    after._diff, after._next = inverse, node
    node._diff = node._next = None
    store.current = node
    store.pending = None


def _reroot(target: Version[Any]) -> None:
    """Make ``target`` the version its store holds: each log on the way to the current version applied, its
    inverse left on the version it came from."""
    store = target._store
    if store.pending is not None:
        _finish(store)
    path = []
    node = target
    while store.current is not node:
        path.append(node)
        node = node._next  # type: ignore[assignment]
        if node is None:
            raise InvariantError("a version is not linked to its store's current one")
    for node in reversed(path):  # (node._next is the current version)
        log = node._diff
        if log is None:
            raise InvariantError("a version off its store has no log")
        store.pending = (node, node._next, log, store.inverse(log))
        _finish(store)


# -- plain dicts ------------------------------------------------------------------------------------------------
# Their log: code -> {key: old}, each key's first old value (None: the key was absent), one dict a code, so that a
# write logs with one ``setdefault`` and allocates no tuple. A kind of dicts store names its dicts by code.

DictUndo = dict[int, dict[Any, Any]]


class DictStore(Store):
    """Plain dicts one lineage shares (the prefix index's, the host tier's), each named by a code (``dict_of``)."""

    __slots__ = ()

    def dict_of(self, code: int) -> dict[Any, Any]:
        raise NotImplementedError

    def inverse(self, log: DictUndo) -> DictUndo:
        dict_of = self.dict_of
        return {code: {key: d.get(key) for key in olds} for code, olds in log.items() for d in (dict_of(code),)}

    def apply(self, log: DictUndo) -> None:
        dict_of = self.dict_of
        for code, olds in log.items():
            d = dict_of(code)
            for key, old in olds.items():
                if old is None:
                    d.pop(key, None)
                else:
                    d[key] = old


# -- an integer array --------------------------------------------------------------------------------
# Its log, one of two kinds: sparse, the written entries' indices and old values in the order they were logged
# (two lists, applied backwards, so an entry logged twice ends at its first old value); or dense, a copy of the
# whole array as it was, where a transition writes so many entries (a release of a long prompt's blocks) that
# one copy (memcpy speed) costs less than logging them one by one.

DENSE = 64  # a transition that writes more than len / DENSE entries (and DENSE_MIN at least) logs the whole array
# (a sparse entry logs in ~50 ns and a warm copy costs ~0.17 ns an entry, but a conversion also replays the log so far
# and copies the array cold: 50.8 us for 65,537 entries in ../shared/peers' harness at 1,024 running, where releases
# of several requests crossed len / 256; at len / 64 the release p50 read 47.7 against 54.8 us over four alternations)
DENSE_MIN = 64


class _IntStore(Store):
    __slots__ = ("data",)

    def __init__(self, data: array[int]) -> None:
        super().__init__()
        self.data = data

    def inverse(self, log: Any) -> Any:
        data = self.data
        if type(log) is array:
            return data[:]
        idx, olds = log
        idx = idx[: min(len(idx), len(olds))]  # (an interrupt between a log's two extends: only whole pairs read)
        return idx, list(map(data.__getitem__, idx))

    def apply(self, log: Any) -> None:
        if type(log) is array:
            self.data[:] = log
        else:
            _undo(self.data, log)


def _undo(data: array[int], log: tuple[list[int], list[int]]) -> None:
    """A sparse log's old values written back, the last logged first (an entry logged twice ends at its first)."""
    idx, olds = log
    for i in range(min(len(idx), len(olds)) - 1, -1, -1):
        data[idx[i]] = olds[i]


class IntArray(Version[_IntStore]):
    """A persistent array of 64-bit integers of a fixed length, written in place (the per-block numbers).

    >>> v = IntArray.of(range(5))
    >>> e = v.edit(); e[2] = 40; w = e.persistent()
    >>> list(v), list(w), len(w), w.set(0, 7)[0], w[0]
    ([0, 1, 2, 3, 4], [0, 1, 40, 3, 4], 5, 7, 0)
    """

    __slots__ = ("n",)

    def __init__(self, store: _IntStore, n: int) -> None:
        super().__init__(store)
        self.n = n

    @staticmethod
    def of(items: Iterable[int]) -> IntArray:
        store = _IntStore(array("q", items))
        out = IntArray(store, len(store.data))
        store.current = out
        return out

    def values(self) -> array[int]:
        """This version's entries, to read in a loop (valid until another version of the lineage is read)."""
        return self._here().data

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self._here().data[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._here().data.tolist())  # (a copy: a reroot during the loop changes nothing)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IntArray) and self.values().tolist() == other.values().tolist()

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"IntArray({shown(list(self))})"

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy of this version alone (a state crossing a thread or a process: materialized)."""
        return IntArray.of, (self.values().tolist(),)

    def edit(self) -> IntArrayEdit:
        return IntArrayEdit(self)

    def set(self, i: int, value: int) -> IntArray:
        """A new version with entry ``i`` replaced (this one is unchanged)."""
        if not 0 <= i < self.n:
            raise IndexError(i)
        e = IntArrayEdit(self)
        e[i] = value
        return e.persistent()


class IntArrayEdit:
    """A transition's working copy of an ``IntArray``: the first write makes a new version the store's current;
    each entry's old value is logged on the version edited (``base``) before it is written. Reads see the
    edit's own writes; ``persistent`` hands the new version out."""

    __slots__ = ("base", "node")

    def __init__(self, base: IntArray) -> None:
        self.base = base
        self.node: IntArray | None = None  # the version being written, from the first write on

    def __len__(self) -> int:
        return self.base.n

    def values(self) -> array[int]:
        """The edit's entries, to read in a loop that writes nothing."""
        node = self.node
        return (self.base if node is None else node)._here().data

    def __getitem__(self, i: int) -> int:
        node = self.node
        return (self.base if node is None else node)._here().data[i]

    def writable(self, indices: Collection[int]) -> array[int]:
        """The edit's entries with those at ``indices`` logged: the caller then writes those (and no others)
        in place, ``data[i] = x``, before anything else reads or edits this lineage."""
        node = self.node
        if node is None:
            base = self.base
            node = self.node = IntArray(base._store, base.n)
            data = fork(base, node, ([], [])).data
        else:
            data = node._here().data
        base = self.base
        log = base._diff
        if type(log) is array:  # (the whole array is logged: every write is covered)
            return data
        idx, olds = log
        many = len(idx) + len(indices)
        if many >= DENSE_MIN and many * DENSE > base.n:  # (many writes: one copy of the array as it was)
            whole = data[:]
            _undo(whole, log)
            base._diff = whole
            return data
        olds += map(data.__getitem__, indices)  # (the old values first: see _IntStore.inverse)
        idx += indices
        return data

    def __setitem__(self, i: int, value: int) -> None:
        if not 0 <= i < self.base.n:
            raise IndexError(i)
        self.writable((i,))[i] = value

    def persistent(self) -> IntArray:
        node = self.node
        if node is None:
            return self.base
        self.base, self.node = node, None  # (the edit goes on from the new version)
        return node
