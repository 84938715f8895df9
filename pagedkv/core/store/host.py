"""The prefix cache's host tier (``CacheConfig(host_blocks=n)``, vLLM's native KV offloading): the core decides,
the shell copies. Its value and working copy are here; the pool keeps a block in it (``pool.offload``) and loads
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
slot. Every operation is O(1) amortized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from immutables import Map, MapMutation

from pagedkv.core.rules.hashing import BlockHash

Key = tuple[int, BlockHash]  # (group, chain hash)


@dataclass(frozen=True, slots=True)
class HostTier:
    entries: Map[Key, tuple[int, int]] = field(default_factory=Map)  # (group, hash) -> (slot, tick)
    by_tick: Map[int, Key] = field(default_factory=Map)  # tick -> (group, hash): the LRU order
    oldest: int = 0  # no entry has a smaller tick
    next_tick: int = 0
    next_slot: int = 0  # slots [0, next_slot) have been handed out (a full tier reuses a dropped entry's)
    spare: tuple[int, ...] = ()  # handed-out slots no entry holds (``forget_host``'s), taken again first

    def __len__(self) -> int:
        return len(self.entries)


EMPTY_HOST = HostTier()


class HostEdit:
    """A transition's working copy of the tier (``Txn.host``)."""

    __slots__ = ("entries", "by_tick", "oldest", "next_tick", "next_slot", "spare", "pinned")

    def __init__(self, tier: HostTier) -> None:
        self.entries: MapMutation[Key, tuple[int, int]] = tier.entries.mutate()
        self.by_tick: MapMutation[int, Key] = tier.by_tick.mutate()
        self.oldest, self.next_tick, self.next_slot = tier.oldest, tier.next_tick, tier.next_slot
        self.spare = tier.spare
        self.pinned: set[Key] = set()  # entries this transition loads: never dropped by it

    def done(self) -> HostTier:
        return HostTier(
            self.entries.finish(), self.by_tick.finish(), self.oldest, self.next_tick, self.next_slot, self.spare
        )

    def touch(self, key: Key) -> int:
        """``key``'s slot, the entry now the most recently used, pinned for this transition."""
        slot, tick = self.entries[key]
        del self.by_tick[tick]
        self.entries[key] = (slot, self.next_tick)
        self.by_tick[self.next_tick] = key
        self.next_tick += 1
        self.pinned.add(key)
        return slot

    def put(self, key: Key, capacity: int) -> tuple[int, Key | None] | None:
        """A slot for ``key`` (not in the tier), the most recently used, and the entry dropped for it; None when
        every entry is pinned (the block is not kept)."""
        dropped: Key | None = None
        if self.spare:
            slot, self.spare = self.spare[0], self.spare[1:]
        elif self.next_slot < capacity:
            slot = self.next_slot
            self.next_slot += 1
        else:
            victim = self._least_recent()
            if victim is None:
                return None
            dropped = victim
            slot, tick = self.entries.pop(victim)
            del self.by_tick[tick]
        self.entries[key] = (slot, self.next_tick)
        self.by_tick[self.next_tick] = key
        self.next_tick += 1
        return slot, dropped

    def forget(self, gone: list[tuple[int, Key]]) -> None:
        """Drop these entries, (slot, key) each (their slots spare)."""
        for _, key in gone:
            del self.by_tick[self.entries.pop(key)[1]]
        self.spare = tuple(sorted({*self.spare, *(slot for slot, _ in gone)}))

    def _least_recent(self) -> Key | None:
        """The least recently used entry not pinned (the pointer moves past ticks taken away)."""
        while self.oldest < self.next_tick and self.oldest not in self.by_tick:
            self.oldest += 1
        tick = self.oldest
        while tick < self.next_tick:
            key = self.by_tick.get(tick)
            if key is not None and key not in self.pinned:
                return key
            tick += 1
        return None
