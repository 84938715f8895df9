"""The prefix cache's host tier (``CacheConfig(host_blocks=n)``, vLLM's native KV offloading): the core decides,
the shell copies. Its value and working copy are here; the pool keeps a block in it (``pool.offload_many``) and loads
one back (``pool.onload``).

A cached block the device pool evicts to reuse is kept in the tier: it takes a host slot (when the tier is full,
the slot of its least recently used entry, which is dropped), and the transition records ``BlockOffloaded``: copy
the device block to the slot. A prefix hit that runs on past the device cache through the tier takes fresh device
blocks for those positions and records ``BlockOnloaded``: copy the slot to the block. The shell carries out a
step's copies in the order the core recorded them, all before the step's forward (an evicted block's bytes are
saved before anything overwrites it; a slot a load reads is never reused in the transition that loads it: the
entries a transition loads are pinned). A loaded block counts as computed for its row, and its hash is the row's
(the row goes on hashing after it), but it does not enter the device index: only its row reads it, so a load
that failed harms no other request (the shell fails that request: ``release(..., "error")``).

The tier is a value: entries ``(group, hash) -> (slot, tick)``, their order by tick (the least recently used
first, found by a pointer that moves past the ticks taken away: no scan), the next tick and the next unused
slot. Every operation is O(1) amortized. Like the prefix index (index.py), it is a rerooted lineage
(rerooted.py): every version shares one store of two plain dicts holding the current version's entries, the
others hold undo logs, so a block kept costs a few dict writes and their logged old values (an ``immutables``
map's copy-on-write cost ~6 us a block kept, measured on bench/multiturn.py's no-reuse workload).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.core.rules.hashing import BlockHash
from pagedkv.core.store.rerooted import DictStore, Version, fork

Key = tuple[int, BlockHash]  # (group, chain hash)
# the undo log's codes (rerooted.DictUndo): the entries' old values, the ticks'; the use counts', their ticks'
ENTRIES, BY_TICK, USES, USES_BY_TICK = 0, 1, 2, 3


class _Store(DictStore):
    """The dicts one lineage of versions shares, holding the contents of ``current``."""

    __slots__ = ("by_tick", "entries", "uses", "uses_by_tick")

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[Key, tuple[int, int]] = {}  # (group, hash) -> (slot, tick)
        self.by_tick: dict[int, Key] = {}  # tick -> (group, hash): the LRU order
        self.uses: dict[BlockHash, tuple[int, int]] = {}  # hash -> (uses seen, tick): ``host_store_threshold``'s
        self.uses_by_tick: dict[int, BlockHash] = {}  # tick -> hash: the use table's LRU order

    def dict_of(self, code: int) -> dict[Any, Any]:
        return (self.entries, self.by_tick, self.uses, self.uses_by_tick)[code]


class HostTier(Version[_Store]):
    """One version of the tier: its entries and LRU order (read through ``entries`` / ``by_tick``, views valid
    until another version of the lineage is read), ``oldest`` (no entry has a smaller tick), ``next_tick``,
    ``next_slot`` (slots ``[0, next_slot)`` have been handed out; a full tier reuses a dropped entry's) and
    ``spare`` (handed-out slots no entry holds, ``forget_host``'s, taken again first); under
    ``host_store_threshold`` the use table (``uses``: hash -> (uses seen, tick), ``uses_by_tick``; its ticks from
    the same ``next_tick``, ``uses_oldest`` as ``oldest``)."""

    __slots__ = ("next_slot", "next_tick", "oldest", "size", "spare", "uses_oldest")

    def __init__(
        self,
        store: _Store,
        size: int,
        oldest: int,
        next_tick: int,
        next_slot: int,
        spare: tuple[int, ...],
        uses_oldest: int = 0,
    ) -> None:
        super().__init__(store)
        self.size = size
        self.oldest = oldest
        self.next_tick = next_tick
        self.next_slot = next_slot
        self.spare = spare
        self.uses_oldest = uses_oldest

    @staticmethod
    def empty() -> HostTier:
        """An empty tier, a lineage of its own (each state's history keeps its own)."""
        store = _Store()
        out = HostTier(store, 0, 0, 0, 0, ())
        store.current = out
        return out

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: Key) -> bool:
        return key in self._here().entries

    @property
    def entries(self) -> Mapping[Key, tuple[int, int]]:
        """(group, hash) -> (slot, tick), to read now (a view: valid until another version is read)."""
        return self._here().entries

    @property
    def by_tick(self) -> Mapping[int, Key]:
        """tick -> (group, hash): the LRU order, to read now (a view, as ``entries``)."""
        return self._here().by_tick

    @property
    def uses(self) -> Mapping[BlockHash, tuple[int, int]]:
        """hash -> (uses seen, tick): the use table (``host_store_threshold``), to read now (a view)."""
        return self._here().uses

    @property
    def uses_by_tick(self) -> Mapping[int, BlockHash]:
        """tick -> hash: the use table's LRU order, to read now (a view, as ``uses``)."""
        return self._here().uses_by_tick

    def __repr__(self) -> str:
        return f"HostTier({len(self)} entries, next slot {self.next_slot})"

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy of this version alone (a state crossing a thread or a process: materialized)."""
        return _rebuilt, (
            dict(self.entries), self.oldest, self.next_tick, self.next_slot, self.spare, dict(self.uses),
            self.uses_oldest,
        )  # fmt: skip


def _rebuilt(
    entries: dict[Key, tuple[int, int]],
    oldest: int,
    next_tick: int,
    next_slot: int,
    spare: tuple[int, ...],
    uses: dict[BlockHash, tuple[int, int]],
    uses_oldest: int,
) -> HostTier:
    out = HostTier.empty()
    store = out._store
    store.entries.update(entries)
    store.by_tick.update({tick: key for key, (_, tick) in entries.items()})
    store.uses.update(uses)
    store.uses_by_tick.update({tick: h for h, (_, tick) in uses.items()})
    out.size, out.oldest, out.next_tick, out.next_slot, out.spare = len(entries), oldest, next_tick, next_slot, spare
    out.uses_oldest = uses_oldest
    return out


class HostEdit:
    """A transition's working copy of the tier (``Txn.host``): the first write makes a new version the store's
    current, each entry's first old value logged on the version edited (``base``) before it is written, so
    reading ``base`` again (a refusal, an exception) rolls the edit back; ``done`` hands the new version out."""

    __slots__ = ("base", "next_slot", "next_tick", "node", "oldest", "pinned", "size", "spare", "uses_oldest")

    def __init__(self, tier: HostTier) -> None:
        self.base = tier
        self.node: HostTier | None = None  # the version being written, from the first write on
        self.size, self.oldest, self.next_tick = tier.size, tier.oldest, tier.next_tick
        self.next_slot, self.spare, self.uses_oldest = tier.next_slot, tier.spare, tier.uses_oldest
        self.pinned: set[Key] = set()  # entries this transition loads: never dropped by it

    def _writable(self) -> tuple[_Store, tuple[dict[Key, Any], dict[int, Any]]]:
        """The store holding the edit's contents, and the log of its old values (base's): the entries', the ticks'."""
        store = self._forked()
        log = self.base._diff
        return store, (log[ENTRIES], log[BY_TICK])

    def _forked(self) -> _Store:
        """The store holding the edit's contents, the edit's version its current (a fork on the first write)."""
        node = self.node
        if node is None:
            base = self.base
            node = self.node = HostTier(base._store, 0, 0, 0, 0, ())
            return fork(base, node, {ENTRIES: {}, BY_TICK: {}, USES: {}, USES_BY_TICK: {}})
        return node._here()

    def done(self) -> HostTier:
        node = self.node
        if node is None:  # (nothing written: the pointer ``oldest`` may have moved, which changes nothing)
            return self.base
        node.size, node.oldest, node.next_tick, node.next_slot, node.spare, node.uses_oldest = (
            self.size, self.oldest, self.next_tick, self.next_slot, self.spare, self.uses_oldest
        )  # fmt: skip
        self.base, self.node = node, None  # (the edit goes on from the new version)
        return node

    def touch(self, key: Key) -> int:
        """``key``'s slot, the entry now the most recently used, pinned for this transition."""
        store, (olds, ticks) = self._writable()
        entries, by_tick = store.entries, store.by_tick
        slot, tick = cur = entries[key]
        tick_now = self.next_tick
        olds.setdefault(key, cur)  # (each old value logged before its key is written)
        ticks.setdefault(tick, key)
        ticks.setdefault(tick_now, None)
        del by_tick[tick]
        entries[key] = (slot, tick_now)
        by_tick[tick_now] = key
        self.next_tick = tick_now + 1
        self.pinned.add(key)
        return slot

    def put_many(self, keys: list[Key], capacity: int, threshold: int = 0) -> list[tuple[int, Key | None] | None]:
        """Each of ``keys`` in order kept, the most recently used: its slot and the entry dropped for it (when the
        tier is full, the least recently used one not pinned); None for a key not kept: the tier holds it already,
        every entry is pinned, or (``threshold`` 2 or more: ``host_store_threshold``) its content was seen in fewer
        uses (the use table, ``use``)."""
        out: list[tuple[int, Key | None] | None] = []
        store, (olds, ticks) = self._writable()
        entries, by_tick, uses = store.entries, store.by_tick, store.uses
        for key in keys:
            dropped: Key | None = None
            if key in entries or (threshold > 1 and uses.get(key[1], (0,))[0] < threshold):
                out.append(None)
                continue
            if self.spare:
                slot, self.spare = self.spare[0], self.spare[1:]
            elif self.next_slot < capacity:
                slot = self.next_slot
                self.next_slot += 1
            else:
                dropped = self._least_recent()
                if dropped is None:
                    out.append(None)
                    continue
                slot, tick = old = entries[dropped]
                olds.setdefault(dropped, old)  # (each old value logged before its key is written)
                ticks.setdefault(tick, dropped)
                del entries[dropped]
                del by_tick[tick]
                self.size -= 1
            tick = self.next_tick
            olds.setdefault(key, None)
            ticks.setdefault(tick, None)
            entries[key] = (slot, tick)
            by_tick[tick] = key
            self.next_tick = tick + 1
            self.size += 1
            out.append((slot, dropped))
        return out

    def forget(self, gone: list[tuple[int, Key]]) -> None:
        """Drop these entries, (slot, key) each (their slots spare)."""
        if not gone:
            return
        store, (olds, ticks) = self._writable()
        for _, key in gone:
            old = store.entries[key]
            olds.setdefault(key, old)  # (each old value logged before its key is written)
            ticks.setdefault(old[1], key)
            del store.entries[key]
            del store.by_tick[old[1]]
        self.size -= len(gone)
        self.spare = tuple(sorted({*self.spare, *(slot for slot, _ in gone)}))

    def _least_recent(self) -> Key | None:
        """The least recently used entry not pinned (the pointer moves past ticks taken away)."""
        node = self.node
        by_tick = (self.base if node is None else node)._here().by_tick
        end = self.next_tick
        oldest = self.oldest
        while oldest < end and oldest not in by_tick:
            oldest += 1
        self.oldest = tick = oldest
        pinned = self.pinned
        while tick < end:
            key = by_tick.get(tick)
            if key is not None and key not in pinned:
                return key
            tick += 1
        return None

    # -- the use table (``host_store_threshold``: vLLM's offloading store_threshold) ----------------------------------
    def use(self, hashes: Sequence[BlockHash], threshold: int, capacity: int) -> None:
        """One more use of each content of ``hashes`` (a row computed it, an admission hit it), the most recently
        used; counted up to ``threshold`` (what decides), in a table of ``capacity`` contents at most (the least
        recently used one dropped for a new one)."""
        store = self._forked()
        log = self.base._diff
        olds, ticks = log[USES], log[USES_BY_TICK]
        uses, by_tick = store.uses, store.uses_by_tick
        for h in hashes:
            tick = self.next_tick
            cur = uses.get(h)
            olds.setdefault(h, cur)  # (each old value logged before its key is written)
            ticks.setdefault(tick, None)
            if cur is not None:
                count, was = cur
                ticks.setdefault(was, h)
                del by_tick[was]
                uses[h] = (min(count + 1, threshold), tick)
            else:
                if len(uses) >= capacity:
                    oldest = self.uses_oldest
                    while oldest not in by_tick:  # (the pointer moves past ticks taken away: no scan)
                        oldest += 1
                    self.uses_oldest = oldest
                    gone = by_tick.pop(oldest)
                    ticks.setdefault(oldest, gone)
                    olds.setdefault(gone, uses[gone])
                    del uses[gone]
                uses[h] = (1, tick)
            by_tick[tick] = h
            self.next_tick = tick + 1
