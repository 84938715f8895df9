"""The prefix-cache index: (group, block hash) -> block id, and back, as a value the GC barely sees.

A hash map of tens of thousands of entries built from GC-tracked nodes (pyrsistent's
PMap, or a HAMT) costs every full collection a walk over all of them, and every
update a path of new nodes the young collections walk again: with 65,536 cached
blocks a HAMT is 64,000 nodes (measured). Here the index is a ``Vec`` of small
dicts per group, bucketed by the hash's own first bytes (BLAKE2b output is
uniform). A bucket holds both directions of its entries, hash -> block and
block -> hash (bytes and int keys never collide): a dict of bytes and ints is never
tracked by CPython's GC, and a leaf tuple of such dicts is untracked at its first
collection. One integer ``Vec`` by block id says which bucket holds the block
(0: not cached, else ``(bucket << 6 | group) + 1``), so an eviction is two dict
operations on one bucket.

An edit copies each bucket it writes once (a few entries) and the leaves around
it once, so an insert or an eviction costs O(1) amortised, never a scan.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pagedkv.core.hashing import BlockHash, CacheKey
from pagedkv.core.vec import Vec, VecEdit

_EMPTY: dict[Any, Any] = {}  # the shared empty bucket: never written (edits copy a bucket first)
_BUCKET_SHIFT = 5  # leaves of 32 buckets
GROUP_BITS = 6  # a locator keeps the group in its low bits: up to 64 KV cache groups
GROUP_MASK = (1 << GROUP_BITS) - 1


def bucket_count(num_blocks: int) -> int:
    """A power of two near an eighth of the pool (a full cache holds about eight hashes a bucket).

    >>> bucket_count(65_536), bucket_count(7)
    (8192, 4)
    """
    return 1 << max(2, (max(num_blocks, 1) // 8).bit_length() - 1)


class PrefixIndex:
    """A persistent map (group, hash) -> block id with the reverse lookup ``key_of(block)``.

    Reads like a mapping: ``key in index``, ``index[key]``, ``index.get(key)``,
    ``len(index)``, ``index.items()``.

    >>> e = PrefixIndex.empty(num_blocks=9, num_groups=1).edit()
    >>> e.set((0, bytes(16)), 3)
    >>> idx = e.persistent()
    >>> (0, bytes(16)) in idx, idx.key_of(3) == (0, bytes(16)), idx.key_of(4), len(idx)
    (True, True, None, 1)
    """

    __slots__ = ("buckets", "where", "size", "mask", "root")

    def __init__(self, buckets: tuple[Vec[dict[Any, Any]], ...], where: Vec[int], size: int,
                 root: BlockHash) -> None:  # fmt: skip
        self.buckets = buckets
        self.where = where  # by block: 0, or (bucket << GROUP_BITS | group) + 1
        self.size = size
        self.mask = len(buckets[0]) - 1
        self.root = root  # the parent of every first block (root_hash of the pool's namespace)

    @staticmethod
    def empty(num_blocks: int, num_groups: int, root: BlockHash = b"") -> PrefixIndex:
        assert num_groups <= 1 << GROUP_BITS, f"at most {1 << GROUP_BITS} KV cache groups"
        bucket_vec = Vec.filled(_EMPTY, bucket_count(num_blocks), ints=False, shift=_BUCKET_SHIFT)
        return PrefixIndex((bucket_vec,) * num_groups, Vec.filled(0, num_blocks, ints=True), 0, root)

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: CacheKey) -> bool:
        g, h = key
        return h in self.buckets[g][(h[0] | h[1] << 8 | h[2] << 16) & self.mask]

    def __getitem__(self, key: CacheKey) -> int:
        g, h = key
        block: int = self.buckets[g][(h[0] | h[1] << 8 | h[2] << 16) & self.mask][h]
        return block

    def get(self, key: CacheKey) -> int | None:
        g, h = key
        return self.buckets[g][(h[0] | h[1] << 8 | h[2] << 16) & self.mask].get(h)

    def items(self) -> Iterator[tuple[CacheKey, int]]:
        if not self.size:
            return
        for g, vec in enumerate(self.buckets):
            for bucket in vec:
                for h, b in bucket.items() if bucket else ():
                    if type(h) is bytes:  # (the block -> hash entries are the same pairs, reversed)
                        yield (g, h), b

    def keys(self) -> Iterator[CacheKey]:
        return (k for k, _ in self.items())

    def values(self) -> Iterator[int]:
        return (b for _, b in self.items())

    def is_cached(self, block: int) -> bool:
        return self.where[block] != 0

    def key_of(self, block: int) -> CacheKey | None:
        """The key block ``block`` is cached under, if any."""
        w = self.where[block] - 1
        if w < 0:
            return None
        g = w & GROUP_MASK
        return g, self.buckets[g][w >> GROUP_BITS][block]

    def edit(self) -> PrefixIndexEdit:
        return PrefixIndexEdit(self)


class PrefixIndexEdit:
    """A transition's working copy of a ``PrefixIndex``: buckets are copied on their first write."""

    __slots__ = ("base", "buckets", "copied", "where", "size", "mask")

    def __init__(self, base: PrefixIndex) -> None:
        self.base = base
        self.buckets: list[VecEdit[dict[Any, Any]] | None] = [None] * len(base.buckets)
        self.copied: set[int] = set()  # locators (bucket << GROUP_BITS | group) of the buckets this edit copied
        self.where: VecEdit[int] = VecEdit(base.where)
        self.size = base.size
        self.mask = base.mask

    def _bucket(self, g: int, k: int) -> dict[Any, Any]:
        edit = self.buckets[g]
        return self.base.buckets[g][k] if edit is None else edit[k]

    def __contains__(self, key: CacheKey) -> bool:
        g, h = key
        return h in self._bucket(g, (h[0] | h[1] << 8 | h[2] << 16) & self.mask)

    def get(self, key: CacheKey) -> int | None:
        g, h = key
        return self._bucket(g, (h[0] | h[1] << 8 | h[2] << 16) & self.mask).get(h)

    def is_cached(self, block: int) -> bool:
        return self.where[block] != 0

    def _writable(self, g: int, k: int, loc: int) -> dict[Any, Any]:
        edit = self.buckets[g]
        if edit is None:
            edit = self.buckets[g] = VecEdit(self.base.buckets[g])
        if loc in self.copied:
            return edit[k]
        bucket = edit[k] = dict(edit[k])  # (a copy of an untracked dict stays untracked)
        self.copied.add(loc)
        return bucket

    def set(self, key: CacheKey, block: int) -> None:
        """Cache ``block`` under ``key`` (neither is in the index yet)."""
        added = self.add(key[0], key[1], block)
        assert added, "a key or a block entered the index twice"

    def add(self, g: int, h: BlockHash, block: int) -> bool:
        """Cache ``block`` under (g, h) unless the hash is cached already or the block is; added?"""
        k = (h[0] | h[1] << 8 | h[2] << 16) & self.mask
        edit = self.buckets[g]
        bucket = self.base.buckets[g][k] if edit is None else edit[k]
        if h in bucket or self.where[block]:
            return False  # the same content sits in another block, or this block holds another
        loc = k << GROUP_BITS | g
        bucket = self._writable(g, k, loc)
        bucket[h] = block
        bucket[block] = h  # the reverse entry, for eviction
        self.where[block] = loc + 1
        self.size += 1
        return True

    def evict(self, block: int) -> CacheKey | None:
        """Drop ``block``'s entry (its content is about to be overwritten); the key it had, if any."""
        loc = self.where[block] - 1
        if loc < 0:
            return None
        g = loc & GROUP_MASK
        bucket = self._writable(g, loc >> GROUP_BITS, loc)
        h = bucket.pop(block)
        del bucket[h]
        self.where[block] = 0
        self.size -= 1
        return g, h

    def persistent(self) -> PrefixIndex:
        base = self.base
        if not self.copied:
            return base
        buckets = tuple(b if e is None else e.persistent() for b, e in zip(base.buckets, self.buckets))
        out = PrefixIndex(buckets, self.where.persistent(), self.size, base.root)
        self.base, self.buckets, self.copied = out, [None] * len(buckets), set()
        self.where = VecEdit(out.where)
        return out
