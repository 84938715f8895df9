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

One block per content, unless the edit keeps duplicates (``CacheConfig.cache_duplicates``, vLLM's block
pool: a block that fills with content another block already holds is cached too). A hash then maps to
the tuple of its blocks in the order they were cached; a lookup takes the first, an eviction drops one
(the next then answers lookups); every cached block keeps its reverse entry and counts in ``len``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
    """A transition's working copy of a ``PrefixIndex``: an overlay of what it changed, folded
    into new buckets once, by ``persistent``.

    ``keys`` has the last word on every key the transition touched (its block, or 0: dropped),
    ``blocks`` on every block (its key, or None). A bucket is then copied once for all the
    transition's changes in it, and every leaf of the locator vector once.
    """

    __slots__ = ("base", "keys", "blocks", "size", "duplicates")

    def __init__(self, base: PrefixIndex, duplicates: bool = False) -> None:
        self.base = base
        self.keys: dict[CacheKey, int | tuple[int, ...]] = {}  # a key's blocks: one, several, or 0 (none)
        self.blocks: dict[int, CacheKey | None] = {}
        self.size = base.size
        self.duplicates = duplicates  # a content already cached caches another block too

    def get(self, key: CacheKey) -> int | None:
        b = self.keys.get(key)
        if b is not None:
            return (b or None) if isinstance(b, int) else b[0]
        return self.base.get(key)

    def blocks_of(self, key: CacheKey) -> tuple[int, ...]:
        b = self.keys.get(key)
        if b is None:
            return self.base.blocks_of(key)
        if isinstance(b, tuple):
            return b
        return (b,) if b else ()

    def __contains__(self, key: CacheKey) -> bool:
        return self.get(key) is not None

    def is_cached(self, block: int) -> bool:
        blocks = self.blocks
        if block in blocks:
            return blocks[block] is not None
        return self.base.where[block] != 0

    def key_of(self, block: int) -> CacheKey | None:
        blocks = self.blocks
        if block in blocks:
            return blocks[block]
        return self.base.key_of(block)

    def set(self, key: CacheKey, block: int) -> None:
        """Cache ``block`` under ``key`` (neither is in the index yet)."""
        added = self.add(key[0], key[1], block)
        assert added, "a key or a block entered the index twice"

    def add(self, g: int, h: BlockHash, block: int) -> bool:
        """Cache ``block`` under (g, h) unless the hash is cached already or the block is; added?"""
        key = (g, h)
        b = self.keys.get(key)
        base = self.base
        if b is None:  # untouched by this edit: the base decides (leaves read directly: a hot path)
            vec = base.buckets[g]
            k = (h[0] | h[1] << 8 | h[2] << 16) & base.mask
            if h in vec.leaves[k >> _BUCKET_SHIFT][k & _BUCKET_MASK]:
                if not self.duplicates:
                    return False  # the same content sits in another block
                return self._add_duplicate(key, block)
        elif b:
            if not self.duplicates:
                return False
            return self._add_duplicate(key, block)
        blocks = self.blocks
        if block in blocks:
            if blocks[block] is not None:
                return False  # this block holds another content
        else:
            where = base.where
            if where.leaves[block >> where.shift][block & ((1 << where.shift) - 1)]:
                return False
        self.keys[key] = block
        blocks[block] = key
        self.size += 1
        return True

    def _add_duplicate(self, key: CacheKey, block: int) -> bool:
        if self.key_of(block) is not None:
            return False  # this block holds a content already
        self.keys[key] = (*self.blocks_of(key), block)
        self.blocks[block] = key
        self.size += 1
        return True

    def evict(self, block: int) -> CacheKey | None:
        """Drop ``block``'s entry (its content is about to be overwritten); the key it had, if any."""
        key = self.key_of(block)
        if key is None:
            return None
        cur = self.keys.get(key)
        if cur is None:
            cur = self.base.blocks_of(key)
        if isinstance(cur, tuple) and len(cur) > 1:  # a key with duplicates keeps the others, in order
            rest = tuple(b for b in cur if b != block)
            self.keys[key] = rest[0] if len(rest) == 1 else rest
        else:
            self.keys[key] = 0
        self.blocks[block] = None
        self.size -= 1
        return key

    def persistent(self) -> PrefixIndex:
        base = self.base
        if not self.keys:
            return base
        mask = base.mask
        # per bucket: the old pairs of every key touched go, then the new ones come
        touched: dict[tuple[int, int], list[tuple[BlockHash, int | tuple[int, ...]]]] = {}
        for (g, h), b in self.keys.items():
            touched.setdefault((g, (h[0] | h[1] << 8 | h[2] << 16) & mask), []).append((h, b))
        edits: list[VecEdit[dict[Any, Any]] | None] = [None] * len(base.buckets)
        for (g, k), changes in touched.items():
            edit = edits[g]
            if edit is None:
                edit = edits[g] = VecEdit(base.buckets[g])
            leaf = edit.own(k >> _BUCKET_SHIFT)
            bucket = dict(leaf[k & _BUCKET_MASK])  # (a copy of an untracked dict stays untracked)
            for h, _ in changes:  # every old pair of a key touched goes first
                old = bucket.pop(h, None)
                if type(old) is int:
                    del bucket[old]
                elif old is not None:
                    for d in old:
                        del bucket[d]
            for h, b in changes:
                if isinstance(b, int):
                    if b:
                        bucket[h] = b
                        bucket[b] = h  # the reverse entry, for eviction
                elif b:
                    bucket[h] = b
                    for d in b:
                        bucket[d] = h
            leaf[k & _BUCKET_MASK] = bucket
        where = VecEdit(base.where)
        sh, m = where.shift, where.mask
        leaves = where.own_many({b >> sh for b in self.blocks})
        for b, key in self.blocks.items():
            if key is None:
                leaves[b >> sh][b & m] = 0
            else:
                g, h = key
                leaves[b >> sh][b & m] = (((h[0] | h[1] << 8 | h[2] << 16) & mask) << GROUP_BITS | g) + 1
        buckets = tuple(v if e is None else e.persistent() for v, e in zip(base.buckets, edits))
        out = PrefixIndex(buckets, where.persistent(), self.size, base.root)
        self.base, self.keys, self.blocks = out, {}, {}
        return out
