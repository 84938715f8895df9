"""A persistent array that CPython's cyclic GC never walks element by element.

The core keeps its per-row-slot numbers and records here (row lengths, computed
counts, tails, rows; the per-block ones are rerooted.py's ``IntArray``s, written
in place: a transition there writes a few scattered entries of a large array, and
here a decode step writes every row). pyrsistent's ``PVector`` would do the job, but its C
traverse visits every element of every young vector, so a step that leaves a
new 65,536-entry vector behind pays for all of it in each collection (83% of a
step at 1,024 running requests, measured; see bench/RESULTS.md).

A ``Vec`` is a tuple of leaves of ``2**shift`` entries (the state's slot vectors: 32). Integer leaves are
``array('q')`` (the GC never walks their items); object leaves are tuples
(untracked by the GC once their items are). An edit copies the top tuple once
and each leaf it touches once, so a transition costs O(leaves + entries
written); a decode step, which writes every row, copies each leaf once.

A ``VecEdit`` is the private working copy a transition writes through; it never
escapes the transition, and ``persistent()`` hands back a new ``Vec`` that
shares every untouched leaf with the old one. Published leaves are never
written again: that is what makes every ``Vec`` a value.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any, Generic, TypeVar
from pagedkv.core.errors import shown

T = TypeVar("T")


class Vec(Generic[T]):
    """An immutable array of ints (``ints=True``) or objects, in leaves.

    >>> v = Vec.of(range(5), ints=True, shift=5)
    >>> e = v.edit(); e[2] = 40; w = e.persistent()
    >>> list(v), list(w), len(w)
    ([0, 1, 2, 3, 4], [0, 1, 40, 3, 4], 5)
    """

    __slots__ = ("leaves", "n", "shift", "ints")

    def __init__(self, leaves: tuple[Any, ...], n: int, shift: int, ints: bool) -> None:
        self.leaves = leaves
        self.n = n
        self.shift = shift
        self.ints = ints

    @staticmethod
    def of(items: Iterable[T], *, ints: bool, shift: int) -> Vec[T]:
        data = list(items)
        size = 1 << shift
        make = (lambda xs: array("q", xs)) if ints else tuple
        leaves = tuple(make(data[k : k + size]) for k in range(0, len(data), size))
        return Vec(leaves, len(data), shift, ints)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> T:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.leaves[i >> self.shift][i & ((1 << self.shift) - 1)]  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[T]:
        return chain.from_iterable(self.leaves)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vec) and self.n == other.n and list(self) == list(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Vec({shown(list(self))})"

    def edit(self) -> VecEdit[T]:
        return VecEdit(self)


class VecEdit(Generic[T]):
    """A transition's working copy of one ``Vec``: no copy until the first write."""

    __slots__ = ("base", "leaves", "owned", "shift", "mask", "n", "ints")

    def __init__(self, base: Vec[T]) -> None:
        self.base = base
        self.leaves: Any = base.leaves  # a tuple until the first write, then a list
        self.owned: set[int] | None = None  # leaves copied by this edit (safe to write)
        self.shift = base.shift
        self.mask = (1 << base.shift) - 1
        self.n = base.n
        self.ints = base.ints

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> T:
        return self.leaves[i >> self.shift][i & self.mask]  # type: ignore[no-any-return]

    def __setitem__(self, i: int, value: T) -> None:
        k = i >> self.shift
        owned = self.owned
        if owned is None:
            self.leaves = list(self.leaves)
            owned = self.owned = set()
        if k not in owned:
            leaf = self.leaves[k]
            self.leaves[k] = leaf[:] if self.ints else list(leaf)
            owned.add(k)
        self.leaves[k][i & self.mask] = value

    def own(self, k: int) -> Any:
        """Leaf ``k``, writable: copied on its first ``own`` (a loop that writes a few entries keeps
        ``leaves[k]`` and writes ``leaf[i & mask]`` itself)."""
        owned = self.owned
        if owned is None:
            self.leaves = list(self.leaves)
            owned = self.owned = set()
        if k in owned:
            return self.leaves[k]
        leaf = self.leaves[k]
        leaf = self.leaves[k] = leaf[:] if self.ints else list(leaf)
        owned.add(k)
        return leaf

    def own_all(self) -> list[Any]:
        """Copy every leaf now and return them, for a loop that writes everywhere
        (a decode step touches every row): ``leaves[i >> shift][i & mask] = x``."""
        owned = self.owned
        if owned is None:
            self.leaves = list(self.leaves)
            owned = self.owned = set()
        leaves = self.leaves
        if len(owned) < len(leaves):
            for k, leaf in enumerate(leaves):
                if k not in owned:
                    leaves[k] = leaf[:] if self.ints else list(leaf)
            owned.update(range(len(leaves)))
        return leaves  # type: ignore[no-any-return]

    def own_for(self, batch: int) -> Any:
        """Writable leaves for a loop over ``batch`` entries: all of them at once when the batch is large
        against the vector (a decode step writes every row), else each leaf on its first use."""
        return self.own_all() if batch * 2 >= len(self.leaves) else _OwnOnRead(self)

    def append(self, value: T) -> int:
        """Add an entry at the end; returns its index."""
        i = self.n
        k = i >> self.shift
        owned = self.owned
        if owned is None:
            self.leaves = list(self.leaves)
            owned = self.owned = set()
        if k == len(self.leaves):
            self.leaves.append(array("q") if self.ints else [])
            owned.add(k)
        elif k not in owned:
            leaf = self.leaves[k]
            self.leaves[k] = array("q", leaf) if self.ints else list(leaf)
            owned.add(k)
        self.leaves[k].append(value)
        self.n = i + 1
        return i

    def persistent(self) -> Vec[T]:
        owned = self.owned
        if owned is None:
            return self.base
        leaves = self.leaves
        if not self.ints:
            for k in owned:
                leaves[k] = tuple(leaves[k])
        self.owned = None  # the edit is closed: published leaves are never written again
        self.leaves = tuple(leaves)
        out: Vec[T] = Vec(self.leaves, self.n, self.shift, self.ints)
        self.base = out
        return out


class _OwnOnRead:
    """``VecEdit.own_for`` for a small batch: leaf ``k`` owned (copied) when first read."""

    __slots__ = ("own",)

    def __init__(self, edit: VecEdit[Any]) -> None:
        self.own = edit.own

    def __getitem__(self, k: int) -> Any:
        return self.own(k)
