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
it once, as it writes, so an insert or an eviction costs O(1) amortised, never a scan.

One block per content, unless the edit keeps duplicates (``CacheConfig.cache_duplicates``, vLLM's block
pool: a block that fills with content another block already holds is cached too). A hash then maps to
the tuple of its blocks in the order they were cached; a lookup takes the first, an eviction drops one
(the next then answers lookups); every cached block keeps its reverse entry and counts in ``len``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pagedkv.core.errors import InvariantError
from pagedkv.core.hashing import BlockHash, CacheKey
from pagedkv.core.vec import Vec, VecEdit

_EMPTY: dict[Any, Any] = {}  # the shared empty bucket: never written (edits copy a bucket first)
_BUCKET_SHIFT = 5  # leaves of 32 buckets
_BUCKET_MASK = (1 << _BUCKET_SHIFT) - 1
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

    def __init__(self, buckets: tuple[Vec[dict[Any, Any]], ...], where: Vec[int], size: int, root: BlockHash) -> None:
        self.buckets = buckets
        self.where = where  # by block: 0, or (bucket << GROUP_BITS | group) + 1
        self.size = size
        self.mask = len(buckets[0]) - 1
        self.root = root  # the parent of every first block (root_hash of the pool's namespace)

    @staticmethod
    def empty(num_blocks: int, num_groups: int, root: BlockHash = b"") -> PrefixIndex:
        if num_groups > 1 << GROUP_BITS:  # (CacheConfig refuses more: a bug to reach here)
            raise InvariantError(f"at most {1 << GROUP_BITS} KV cache groups")
        bucket_vec = Vec.filled(_EMPTY, bucket_count(num_blocks), ints=False, shift=_BUCKET_SHIFT)
        return PrefixIndex((bucket_vec,) * num_groups, Vec.filled(0, num_blocks, ints=True), 0, root)

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: CacheKey) -> bool:
        g, h = key
        return h in self.buckets[g][(h[0] | h[1] << 8 | h[2] << 16) & self.mask]

    def __getitem__(self, key: CacheKey) -> int:
        g, h = key
        block = self.buckets[g][(h[0] | h[1] << 8 | h[2] << 16) & self.mask][h]
        return block if type(block) is int else block[0]

    def get(self, key: CacheKey) -> int | None:
        g, h = key
        block = self.buckets[g][(h[0] | h[1] << 8 | h[2] << 16) & self.mask].get(h)
        return block if type(block) is not tuple else block[0]

    def blocks_of(self, key: CacheKey) -> tuple[int, ...]:
        """Every block cached under ``key``, the one lookups take first."""
        g, h = key
        block = self.buckets[g][(h[0] | h[1] << 8 | h[2] << 16) & self.mask].get(h)
        return () if block is None else (block,) if type(block) is int else block

    def items(self) -> Iterator[tuple[CacheKey, int]]:
        """Each cached block with its key (a key with duplicates once for each of its blocks, in order)."""
        if not self.size:
            return
        for g, vec in enumerate(self.buckets):
            for bucket in vec:
                for h, b in bucket.items() if bucket else ():
                    if type(h) is bytes:  # (the block -> hash entries are the same pairs, reversed)
                        if type(b) is int:
                            yield (g, h), b
                        else:
                            for d in b:
                                yield (g, h), d

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

    def edit(self, duplicates: bool = False) -> PrefixIndexEdit:
        return PrefixIndexEdit(self, duplicates)


class PrefixIndexEdit:
    """A transition's working copy of a ``PrefixIndex``, written through: each bucket it changes is
    copied once (a few entries) into a copy of its leaf, and the locator vector's leaves likewise;
    ``persistent`` publishes them. Reads see the edit's own writes.
    """

    __slots__ = ("base", "buckets", "where", "owned", "size", "mask", "duplicates")

    def __init__(self, base: PrefixIndex, duplicates: bool = False) -> None:
        self.base = base
        self.buckets: list[VecEdit[dict[Any, Any]] | None] = [None] * len(base.buckets)  # per group, on first write
        self.where: VecEdit[int] | None = None
        self.owned: set[tuple[int, int]] = set()  # (group, bucket) copied by this edit: safe to write
        self.size = base.size
        self.mask = base.mask
        self.duplicates = duplicates  # a content already cached caches another block too

    def _bucket(self, g: int, h: BlockHash) -> dict[Any, Any]:
        return self._bucket_at(g, (h[0] | h[1] << 8 | h[2] << 16) & self.mask)

    def _bucket_at(self, g: int, k: int) -> dict[Any, Any]:
        """Bucket ``k`` of group ``g`` as this edit sees it (for reading)."""
        e = self.buckets[g]
        leaves = self.base.buckets[g].leaves if e is None else e.leaves
        return leaves[k >> _BUCKET_SHIFT][k & _BUCKET_MASK]  # type: ignore[no-any-return]

    def _own_bucket(self, g: int, k: int) -> dict[Any, Any]:
        """Bucket ``k`` of group ``g``, writable (copied on its first write in this edit)."""
        leaf = self.buckets[g]
        if leaf is None:
            leaf = self.buckets[g] = VecEdit(self.base.buckets[g])
        entries = leaf.own(k >> _BUCKET_SHIFT)
        if (g, k) in self.owned:
            return entries[k & _BUCKET_MASK]  # type: ignore[no-any-return]
        bucket = entries[k & _BUCKET_MASK] = dict(entries[k & _BUCKET_MASK])  # (untracked, as its source)
        self.owned.add((g, k))
        return bucket

    def _located(self, block: int) -> int:
        w = self.where
        vec = self.base.where if w is None else w
        return vec.leaves[block >> vec.shift][block & ((1 << vec.shift) - 1)]  # type: ignore[no-any-return]

    def _locate(self, block: int, value: int) -> None:
        if self.where is None:
            self.where = VecEdit(self.base.where)
        self.where[block] = value

    def get(self, key: CacheKey) -> int | None:
        block = self._bucket(*key).get(key[1])
        return block if type(block) is not tuple else block[0]

    def blocks_of(self, key: CacheKey) -> tuple[int, ...]:
        block = self._bucket(*key).get(key[1])
        return () if block is None else (block,) if type(block) is int else block

    def __contains__(self, key: CacheKey) -> bool:
        return key[1] in self._bucket(*key)

    def is_cached(self, block: int) -> bool:
        return self._located(block) != 0

    def key_of(self, block: int) -> CacheKey | None:
        w = self._located(block) - 1
        if w < 0:
            return None
        g = w & GROUP_MASK
        return g, self._bucket_at(g, w >> GROUP_BITS)[block]

    def set(self, key: CacheKey, block: int) -> None:
        """Cache ``block`` under ``key`` (neither is in the index yet)."""
        added = self.add(key[0], key[1], block)
        if not added:
            raise InvariantError("a key or a block entered the index twice")

    def add(self, g: int, h: BlockHash, block: int) -> bool:
        """Cache ``block`` under (g, h) unless the hash is cached already or the block is; added?"""
        k = (h[0] | h[1] << 8 | h[2] << 16) & self.mask
        old = self._bucket_at(g, k).get(h)
        if (old is not None and not self.duplicates) or self._located(block):
            return False  # the same content sits in another block, or this block holds a content
        bucket = self._own_bucket(g, k)
        bucket[h] = block if old is None else (old, block) if type(old) is int else (*old, block)
        bucket[block] = h  # the reverse entry, for eviction
        self._locate(block, (k << GROUP_BITS | g) + 1)
        self.size += 1
        return True

    def evict(self, block: int) -> CacheKey | None:
        """Drop ``block``'s entry (its content is about to be overwritten); the key it had, if any."""
        w = self._located(block) - 1
        if w < 0:
            return None
        g = w & GROUP_MASK
        bucket = self._own_bucket(g, w >> GROUP_BITS)
        h = bucket.pop(block)
        cur = bucket[h]
        if type(cur) is tuple:  # a key with duplicates keeps the others, in order
            rest = tuple(b for b in cur if b != block)
            bucket[h] = rest[0] if len(rest) == 1 else rest
        else:
            del bucket[h]
        self._locate(block, 0)
        self.size -= 1
        return g, h

    def persistent(self) -> PrefixIndex:
        base = self.base
        if not self.owned and self.where is None:
            return base
        buckets = tuple(v if e is None else e.persistent() for v, e in zip(base.buckets, self.buckets))
        where = base.where if self.where is None else self.where.persistent()
        out = PrefixIndex(buckets, where, self.size, base.root)
        self.base, self.buckets, self.where, self.owned = out, [None] * len(buckets), None, set()
        return out
