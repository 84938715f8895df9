"""The prefix-cache index: (group, block hash) -> block id, and back, as a value at the cost of a dict.

A production trace (long prompts: hundreds of blocks cached and evicted a step) makes the index the core's
busiest structure: every block a prefill fills is cached, every block popped from the free queue may be
evicted. A copy-on-write map pays a copy of a bucket and a leaf for most of those writes (~7 us each,
measured); a plain dict, ~1 us. So the index is a rerooted lineage (rerooted.py: every version shares one
store of plain dicts, holding the current version's contents; the others hold undo logs): reading the current
version is a dict lookup, and an edit writes the store in place and logs each key's first old value on the
version it edits. The store's dicts hold bytes and ints (and, for duplicates, tuples of ints), which CPython's
GC does not walk; a log is one dict of dicts a version.

One block per content, unless the edit keeps duplicates (``CacheConfig.cache_duplicates``, vLLM's block
pool: a block that fills with content another block already holds is cached too). A hash then maps to the
tuple of its blocks in the order they were cached; a lookup takes the first, an eviction drops one (the next
then answers lookups); every cached block keeps its reverse entry and counts in ``len``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pagedkv.core.errors import InvariantError
from pagedkv.core.rules.hashing import BlockHash, CacheKey
from pagedkv.core.store.rerooted import DictStore, DictUndo, Version, fork

GROUP_BITS = 6  # up to 64 KV cache groups (CacheConfig refuses more)

# An undo log's codes (rerooted.DictUndo): g >= 0, group g's map, hash -> block(s); ~g < 0, group g's reverse map,
# block -> hash.


class _Store(DictStore):
    """The plain dicts one lineage of versions shares, holding the contents of ``current``."""

    __slots__ = ("maps", "revs")

    def __init__(self, num_groups: int) -> None:
        super().__init__()
        self.maps: list[dict[bytes, Any]] = [{} for _ in range(num_groups)]  # hash -> block, or blocks
        self.revs: list[dict[int, bytes]] = [{} for _ in range(num_groups)]  # block -> hash

    def dict_of(self, code: int) -> dict[Any, Any]:
        return self.maps[code] if code >= 0 else self.revs[~code]


def _olds(log: DictUndo, code: int) -> dict[Any, Any]:
    """The log's old values of the map ``code`` names (made on its first write)."""
    olds = log.get(code)
    if olds is None:
        olds = log[code] = {}
    return olds


class PrefixIndex(Version[_Store]):
    """A persistent map (group, hash) -> block id with the reverse lookup ``key_of(block)``.

    Reads like a mapping: ``key in index``, ``index[key]``, ``index.get(key)``,
    ``len(index)``, ``index.items()``.

    >>> e = PrefixIndex.empty(num_blocks=9, num_groups=1).edit()
    >>> e.set((0, bytes(16)), 3)
    >>> idx = e.persistent()
    >>> (0, bytes(16)) in idx, idx.key_of(3) == (0, bytes(16)), idx.key_of(4), len(idx)
    (True, True, None, 1)
    """

    __slots__ = ("size", "root", "num_blocks")

    def __init__(self, store: _Store, size: int, root: BlockHash, num_blocks: int) -> None:
        super().__init__(store)
        self.size = size
        self.root = root  # the parent of every first block (root_hash of the pool's namespace)
        self.num_blocks = num_blocks

    @staticmethod
    def empty(num_blocks: int, num_groups: int, root: BlockHash = b"") -> PrefixIndex:
        if num_groups > 1 << GROUP_BITS:  # (CacheConfig refuses more: a bug to reach here)
            raise InvariantError(f"at most {1 << GROUP_BITS} KV cache groups")
        store = _Store(num_groups)
        out = PrefixIndex(store, 0, root, num_blocks)
        store.current = out
        return out

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: CacheKey) -> bool:
        return key[1] in self._here().maps[key[0]]

    def __getitem__(self, key: CacheKey) -> int:
        block = self._here().maps[key[0]][key[1]]
        return block if type(block) is int else block[0]

    def get(self, key: CacheKey) -> int | None:
        block = self._here().maps[key[0]].get(key[1])
        return block if type(block) is not tuple else block[0]

    def blocks_of(self, key: CacheKey) -> tuple[int, ...]:
        """Every block cached under ``key``, the one lookups take first."""
        block = self._here().maps[key[0]].get(key[1])
        return () if block is None else (block,) if type(block) is int else block

    def items(self) -> Iterator[tuple[CacheKey, int]]:
        """Each cached block with its key (a key with duplicates once for each of its blocks, in order)."""
        pairs = []
        for g, entries in enumerate(self._here().maps):  # (taken now: a reroot during the loop changes nothing)
            for h, b in entries.items():
                if type(b) is int:
                    pairs.append(((g, h), b))
                else:
                    pairs.extend(((g, h), d) for d in b)
        return iter(pairs)

    def keys(self) -> Iterator[CacheKey]:
        return (k for k, _ in self.items())

    def values(self) -> Iterator[int]:
        return (b for _, b in self.items())

    def is_cached(self, block: int) -> bool:
        revs = self._here().revs
        return block in revs[0] if len(revs) == 1 else any(block in rev for rev in revs)

    def key_of(self, block: int) -> CacheKey | None:
        """The key block ``block`` is cached under, if any."""
        for g, rev in enumerate(self._here().revs):
            h = rev.get(block)
            if h is not None:
                return g, h
        return None

    def group_map(self, g: int) -> dict[BlockHash, Any]:
        """Group ``g``'s hash -> block map as this version holds it (a block, or the tuple of a key's duplicates,
        the first one a lookup's), for a loop that only reads it while nothing reads another version of this
        lineage or writes it (a prefix lookup's walk: a dict read a block, no key tuple built)."""
        return self._here().maps[g]

    def cached_blocks(self) -> int:
        """How many blocks carry a key (the reverse entries): ``len`` where the index is whole."""
        return sum(len(rev) for rev in self._here().revs)

    def edit(self, duplicates: bool = False) -> PrefixIndexEdit:
        return PrefixIndexEdit(self, duplicates)

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy of this version alone (a state crossing a thread or a process: materialized)."""
        return _rebuilt, (len(self._here().maps), self.num_blocks, self.root, list(self.items()))


def _rebuilt(num_groups: int, num_blocks: int, root: BlockHash, items: list[tuple[CacheKey, int]]) -> PrefixIndex:
    e = PrefixIndex.empty(num_blocks, num_groups, root).edit(duplicates=True)
    for (g, h), b in items:
        e.add(g, h, b)
    return e.persistent()


class PrefixIndexEdit:
    """A transition's working copy of a ``PrefixIndex``: the first write makes a new version the store's current,
    and each key's first old value is logged on the version edited (``base``), so that reading ``base`` again
    (a refusal, an exception, or the transition's own reads of its old state) rolls the edit back and reading the
    edit rolls it forward. ``persistent`` hands the new version out. Reads see the edit's own writes.
    """

    __slots__ = ("base", "node", "size", "duplicates")

    def __init__(self, base: PrefixIndex, duplicates: bool = False) -> None:
        self.base = base
        self.node: PrefixIndex | None = None  # the version being written, from the first write on
        self.size = base.size
        self.duplicates = duplicates  # a content already cached caches another block too

    def _store(self) -> _Store:
        """The store, holding the edit's contents (for reading)."""
        node = self.node
        return self.base._here() if node is None else node._here()

    def _writable(self) -> tuple[_Store, DictUndo]:
        """The store holding the edit's contents, and the log of its old values (base's)."""
        node = self.node
        if node is None:
            base = self.base
            node = self.node = PrefixIndex(base._store, base.size, base.root, base.num_blocks)
            return fork(base, node, {}), base._diff
        store = node._here()
        return store, self.base._diff

    def get(self, key: CacheKey) -> int | None:
        block = self._store().maps[key[0]].get(key[1])
        return block if type(block) is not tuple else block[0]

    def blocks_of(self, key: CacheKey) -> tuple[int, ...]:
        block = self._store().maps[key[0]].get(key[1])
        return () if block is None else (block,) if type(block) is int else block

    def __contains__(self, key: CacheKey) -> bool:
        return key[1] in self._store().maps[key[0]]

    def is_cached(self, block: int) -> bool:
        node = self.node
        revs = (self.base if node is None else node)._here().revs
        return block in revs[0] if len(revs) == 1 else any(block in rev for rev in revs)

    def key_of(self, block: int) -> CacheKey | None:
        node = self.node
        for g, rev in enumerate((self.base if node is None else node)._here().revs):
            h = rev.get(block)
            if h is not None:
                return g, h
        return None

    def reverse_maps(self) -> list[dict[int, bytes]]:
        """Each group's block -> hash map as the edit sees it, for a loop that only reads them (``b in maps[g]``:
        is block b cached there) while nothing writes the index."""
        node = self.node
        return (self.base if node is None else node)._here().revs

    def evict_many(self, blocks: Sequence[int], report: bool = True) -> list[tuple[int, int, BlockHash]]:
        """``evict`` of each of ``blocks`` in order, in one pass: (block, group, hash) of those that were cached
        (``report`` False: none listed, where nobody reads them)."""
        node = self.node
        store = (self.base if node is None else node)._here()
        revs, maps = store.revs, store.maps
        one = revs[0] if len(revs) == 1 else None  # (one group: a block's entry is a single pop away)
        gone: list[tuple[int, int, BlockHash]] = []
        logs: list[tuple[dict[Any, Any], dict[Any, Any]]] | None = None  # each group's old values: map, reverse
        n = g = 0
        rev = one
        for block in blocks:
            if one is not None:
                h = one.get(block)
                if h is None:
                    continue
            else:
                for g, rev in enumerate(revs):
                    h = rev.get(block)
                    if h is not None:
                        break
                else:
                    continue
            if logs is None:
                log = self._writable()[1] if self.node is None else self.base._diff
                logs = [(_olds(log, k), _olds(log, ~k)) for k in range(len(revs))]
            olds, back = logs[g]
            entries = maps[g]
            cur = entries[h]
            back.setdefault(block, h)  # (each old value logged before its key is written)
            olds.setdefault(h, cur)
            del rev[block]  # type: ignore[union-attr]
            if type(cur) is tuple:  # a key with duplicates keeps the others, in order
                rest = tuple(b for b in cur if b != block)
                entries[h] = rest[0] if len(rest) == 1 else rest
            else:
                del entries[h]
            n += 1
            if report:
                gone.append((block, g, h))
        self.size -= n
        return gone

    def set(self, key: CacheKey, block: int) -> None:
        """Cache ``block`` under ``key`` (neither is in the index yet)."""
        added = self.add(key[0], key[1], block)
        if not added:
            raise InvariantError("a key or a block entered the index twice")

    def add(self, g: int, h: BlockHash, block: int) -> bool:
        """Cache ``block`` under (g, h) unless the hash is cached already or the block is; added?"""
        return self.add_many(g, (h,), (block,)) == 1

    def add_many(self, g: int, hashes: Sequence[BlockHash], blocks: Sequence[int]) -> int:
        """``add`` of (g, ``hashes[i]``, ``blocks[i]``) for each i in order, in one pass (a block 0, the null block,
        skipped); how many were added. What a commit of many blocks of one group runs."""
        node = self.node
        store = (self.base if node is None else node)._here()
        entries, revs = store.maps[g], store.revs
        rev, one = revs[g], revs[0] if len(revs) == 1 else None
        duplicates = self.duplicates
        olds: dict[Any, Any] | None = None  # (the log's old values of this group's map, and of its reverse map)
        back: dict[Any, Any] = {}
        n = 0
        for h, block in zip(hashes, blocks):
            if not block:
                continue
            old = entries.get(h)
            if old is not None and not duplicates:
                continue  # the same content sits in another block
            if block in one if one is not None else any(block in r for r in revs):
                continue  # this block holds a content
            if olds is None:
                log = self._writable()[1] if self.node is None else self.base._diff  # (the same store's dicts)
                olds, back = _olds(log, g), _olds(log, ~g)
            olds.setdefault(h, old)
            back.setdefault(block, None)
            entries[h] = block if old is None else (old, block) if type(old) is int else (*old, block)
            rev[block] = h
            n += 1
        self.size += n
        return n

    def evict(self, block: int) -> CacheKey | None:
        """Drop ``block``'s entry (its content is about to be overwritten); the key it had, if any."""
        gone = self.evict_many((block,))
        return (gone[0][1], gone[0][2]) if gone else None

    def persistent(self) -> PrefixIndex:
        node = self.node
        if node is None:
            return self.base
        node.size = self.size
        self.base, self.node = node, None  # (the edit goes on from the new version)
        return node
