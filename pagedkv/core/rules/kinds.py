"""The rules of each KV cache group kind, one class a kind (as vLLM's ``single_type_kv_cache_manager.py``).

A transition never asks what kind a group is: it asks the group's rules (``GroupSpec.rules``) what the kind
does. Each class answers, for one group of one row:

- which keys a query sees (``first_visible_position``, ``first_visible_block``): what a window lets go;
- what a row holds at most (``most_held``) and while a stretch of it is computed (``held_computing``, ``period``):
  admission's counts;
- what admission takes (``admission_cost``, ``hit_taken``, ``taken_over``, ``admitted``);
- what a growth takes (``growth_blocks``, ``grown``);
- what a commit lets go (``let_go``);
- what a prefix hit needs (``holds``) and which blocks it gives (``hit_ids``);
- what enters the prefix cache (a block that fills; a live state, ``holds_state``, only where a row ends).

The rules are arithmetic over a group's block list (a tuple of block ids, 0 the null block); a rule that
takes blocks is handed the pool's ``pop`` by its caller, so this module imports nothing of the pool.

>>> SlidingWindow(window=32).first_visible_block(112, 16)
5
>>> FullAttention().admission_cost(nb=4, hit=(7, 8), first=0)
(2, (7, 8))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import ClassVar, cast

from pagedkv.core.errors import InvariantError


class GroupKind(StrEnum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MLA = "mla"  # multi-head latent attention: one latent vector per token; allocates like full attention
    MAMBA = "mamba"  # a state per row (a Mamba layer's conv and SSM state): one block, whatever the length
    # vLLM's mamba_cache_mode="align": the state at each block boundary in that position's own block
    MAMBA_ALIGN = "mamba_align"


Pop = Callable[[int], tuple[int, ...]]  # the pool's: n fresh blocks, least recently freed first
Cached = Callable[[bytes], "int | None"]  # the prefix cache of one group: a chain hash's block, HOSTED, or None
# a hit's block that the host tier holds (core/store/host.py), not the device: admission loads it into a fresh block
HOSTED = -1


class KindRules:
    """One group kind's rules; the base class is full attention's (every block of every position, kept)."""

    kind: ClassVar[GroupKind] = GroupKind.FULL
    parameter: ClassVar[str | None] = None  # the size the kind takes ("window", "chunk"), if any
    lets_go: ClassVar[bool] = False  # commit nulls the blocks no future query can see (a window moves)
    nulls_positions: ClassVar[bool] = False  # a row's list may hold the null block (a worker's installs allow it)
    holds_state: ClassVar[bool] = False  # one live state a row, rewritten in place (cached only where a row ends)
    recurrent: ClassVar[bool] = False  # a state carried token to token: rows compute from their first token
    stops_at_block_end: ClassVar[bool] = False  # a forward that starts inside a block ends at its end, at most
    full_hit: ClassVar[bool] = True  # the hit is scanned left to right over these groups (the others cut it back)
    eagle_margin: ClassVar[bool] = False  # under vLLM's EAGLE drop the hit search holds one block more
    event_covers_run: ClassVar[bool] = False  # its BlockStored carries the ids since its last store (vLLM's align)
    __slots__ = ("window", "chunk")

    def __init__(self, window: int | None = None, chunk: int | None = None) -> None:
        self.window, self.chunk = window, chunk

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.window or self.chunk or ''})"

    def __reduce__(self) -> tuple[type[KindRules], tuple[int | None, int | None]]:
        return type(self), (self.window, self.chunk)

    @property
    def search_key(self) -> tuple[object, ...]:
        """Groups with one key are searched together for a hit, as vLLM's coordinator searches one spec."""
        return (self.kind, self.window, self.chunk)

    # which keys a query sees

    def first_visible_position(self, position: int) -> int:
        """The first key a query at ``position`` reads."""
        return 0

    def first_visible_block(self, position: int, block_size: int) -> int:
        """The first block any query at ``position`` or later can still see: blocks before it hold nothing a
        future token reads (a windowed group lets them go; the null block takes their place)."""
        return self.first_visible_position(position) // block_size

    # what a row holds

    def most_held(self, nb: int) -> int:
        """The most blocks a row of ``nb`` positions holds in this group."""
        return nb

    def held_computing(self, start: int, end: int, block_size: int) -> int:
        """The blocks a row holds here while its positions ``[start, end)`` are computed, ``start`` of them already
        (its blocks come a chunk at a time: a window has let go of what no query from ``start`` on sees)."""
        return -(-end // block_size)

    def period(self, block_size: int) -> int:
        """Past its first stretch, ``held_computing`` less the full groups' count repeats every ``period``
        positions (a full group's grows with the row): the span admission scans for a row's worst chunk."""
        return 1

    # admission

    def admission_cost(self, nb: int, hit: tuple[int, ...], first: int) -> tuple[int, tuple[int, ...]]:
        """Admitting a row of ``nb`` positions whose hit gave ``hit`` here, first visible block ``first``: the
        fresh blocks it pops (those the host tier's hit blocks are loaded into among them), and the hit blocks it
        shares (``hit_taken``)."""
        return nb - max(len(hit), min(first, nb)) + hit.count(HOSTED), self.hit_taken(hit, first)

    def hit_taken(self, hit: tuple[int, ...], first: int) -> tuple[int, ...]:
        """The device's hit blocks a row shares (a reference each), taken before any fresh block is popped."""
        return tuple(b for b in hit[first:] if b > 0)

    def taken_over(self, hit: tuple[int, ...]) -> int | None:
        """The hit block a row takes over (out of the cache: it will be rewritten), if any."""
        return None

    def loaded_into(self, ids: tuple[int, ...], position: int) -> int:
        """The fresh block of a row's admitted list ``ids`` that the host tier's hit block at ``position`` is loaded
        into."""
        return ids[position]

    def admitted(self, hit: tuple[int, ...], nb: int, first: int, pop: Pop) -> tuple[int, ...]:
        """A row's list of ``nb`` positions from its hit: the null block where no query looks (before ``first``),
        the hit's blocks (a fresh one at each position the host tier holds, popped first: its bytes are loaded
        into it), then fresh ones."""
        hit = _fresh_for_hosted(hit, pop)
        kept = hit if not first else tuple(0 if j < first else b for j, b in enumerate(hit))
        skip = max(0, min(first, nb) - len(hit))
        return kept + (0,) * skip + pop(nb - len(hit) - skip)

    # growth

    def growth_blocks(self, opened: int) -> int:
        """Blocks a row's growth takes when it opens ``opened`` positions."""
        return opened

    def grown(self, ids: tuple[int, ...], opened: int, pop: Pop) -> tuple[int, ...]:
        """A row's list grown by ``opened`` positions."""
        return ids + pop(opened)

    # commit

    def let_go(self, ids: tuple[int, ...], future: int, previous: int, block_size: int) -> Sequence[int]:
        """Positions of ``ids`` still held that no query from ``future`` on can see (``previous``: the last
        commit's count), tail first."""
        return ()

    # prefix hits

    def holds(self, cached: Cached, chains: Sequence[Sequence[bytes]], n: int, peek: bool, block_size: int) -> bool:
        """Does this group hold a hit of ``n`` blocks for every row: each block a query at the boundary can see
        (the block after it too, under ``peek``), on the device or in the host tier?"""
        first = self.first_visible_block(n * block_size, block_size)
        return all(cached(chain[j]) is not None for chain in chains for j in range(first, n + peek))

    def hit_ids(self, cached: Cached, chain: Sequence[bytes], n: int, block_size: int) -> tuple[int, ...]:
        """The block ids a hit of ``n`` blocks gives a row (0 where no query of the row will look; ``HOSTED`` where
        the host tier holds the block)."""
        first = min(self.first_visible_block(n * block_size, block_size), n)
        ids = tuple(map(cached, chain[first:n]))
        if None in ids:
            raise InvariantError("a hit's block is cached")
        return (0,) * first + cast(tuple[int, ...], ids)


def _fresh_for_hosted(ids: tuple[int, ...], pop: Pop) -> tuple[int, ...]:
    """A group's hit ids with a fresh block at each position the host tier holds (``HOSTED``), popped in position
    order before the row's others (its blocks then come off the free queue as one pop of them all would give)."""
    n = ids.count(HOSTED)
    if not n:
        return ids
    fresh = iter(pop(n))
    return tuple(next(fresh) if b == HOSTED else b for b in ids)


def _known(cached: Cached, h: bytes) -> int:
    b = cached(h)
    if b is None:
        raise InvariantError("a hit's block is cached")
    return b


class FullAttention(KindRules):
    """Full attention: a query sees every key before it; every block is kept while the row runs."""

    kind = GroupKind.FULL
    __slots__ = ()


class LatentAttention(FullAttention):
    """Multi-head latent attention (MLA): one latent vector a token instead of K and V; allocates as full."""

    kind = GroupKind.MLA
    __slots__ = ()


class _Windowed(KindRules):
    """A kind whose queries see a bounded stretch of keys: the blocks behind it go at commit."""

    __slots__ = ()
    lets_go = True
    nulls_positions = True
    full_hit = False
    eagle_margin = True

    def held_computing(self, start: int, end: int, block_size: int) -> int:
        return -(-end // block_size) - self.first_visible_block(start, block_size)

    def period(self, block_size: int) -> int:
        return math.lcm(block_size, self.chunk or 1)  # (a window: a block; a local chunk: its boundaries too)

    def let_go(self, ids: tuple[int, ...], future: int, previous: int, block_size: int) -> Sequence[int]:
        # the null positions of a window are a prefix of its list: back from the boundary over the blocks held
        first = self.first_visible_block(future, block_size)
        j = first - 1
        while j >= 0 and ids[j]:
            j -= 1
        return range(first - 1, j, -1)


class SlidingWindow(_Windowed):
    """Sliding window W: a token sees itself and the W - 1 tokens before it."""

    kind = GroupKind.SLIDING_WINDOW
    parameter = "window"
    __slots__ = ()

    def first_visible_position(self, position: int) -> int:
        if self.window is None:
            raise InvariantError("a sliding-window group has its window")
        return max(0, position - self.window + 1)


class ChunkedLocal(_Windowed):
    """Chunked local attention C: a token sees its own chunk from the chunk's start."""

    kind = GroupKind.CHUNKED_LOCAL
    parameter = "chunk"
    __slots__ = ()

    def first_visible_position(self, position: int) -> int:
        if self.chunk is None:
            raise InvariantError("a chunked-local group has its chunk")
        return position // self.chunk * self.chunk


class MambaState(KindRules):
    """A state group (Mamba): each row holds one block, its state, at its last position (the null block
    before it); growth moves it, never allocates; it is cached only when its row ends on a block boundary,
    and a hit takes it over (a state is rewritten in place: never shared)."""

    kind = GroupKind.MAMBA
    __slots__ = ()
    nulls_positions = True
    holds_state = True
    recurrent = True
    full_hit = False

    def most_held(self, nb: int) -> int:
        return 1

    def held_computing(self, start: int, end: int, block_size: int) -> int:
        return 1

    def admission_cost(self, nb: int, hit: tuple[int, ...], first: int) -> tuple[int, tuple[int, ...]]:
        return 1, ()  # fresh, or the saved state taken over out of the free queue

    def hit_taken(self, hit: tuple[int, ...], first: int) -> tuple[int, ...]:
        return ()

    def taken_over(self, hit: tuple[int, ...]) -> int | None:
        return hit[-1] if hit and hit[-1] != HOSTED else None

    def loaded_into(self, ids: tuple[int, ...], position: int) -> int:
        return ids[-1]  # (the state lives at the row's last position)

    def admitted(self, hit: tuple[int, ...], nb: int, first: int, pop: Pop) -> tuple[int, ...]:
        # the saved state taken over, or a fresh block: the row's own state, or the tier's saved one loaded into it
        saved = self.taken_over(hit)
        return (0,) * (nb - 1) + ((saved,) if saved is not None else pop(1))

    def growth_blocks(self, opened: int) -> int:
        return 0

    def grown(self, ids: tuple[int, ...], opened: int, pop: Pop) -> tuple[int, ...]:
        return ids[:-1] + (0,) * opened + ids[-1:]

    def holds(self, cached: Cached, chains: Sequence[Sequence[bytes]], n: int, peek: bool, block_size: int) -> bool:
        # a state saved where the hit ends, a different one for each row (it is taken over)
        saved = [cached(chain[n - 1]) for chain in chains]
        return None not in saved and len(set(saved)) == len(saved)

    def hit_ids(self, cached: Cached, chain: Sequence[bytes], n: int, block_size: int) -> tuple[int, ...]:
        return (0,) * (n - 1) + (_known(cached, chain[n - 1]),) if n else ()


class MambaAlign(KindRules):
    """vLLM's ``mamba_cache_mode="align"``: the state after the row's last token lives at its last block
    position, and each allocation (admission, growth) takes one block there, the positions it skips null; a
    forward reads the state from the previous state block and writes the new one, so the state at every block
    boundary stays in that position's block, is cached under its hash, and a hit shares it (the block the
    hit ends on). As a window of 2 tokens, the blocks before the one holding the computed tokens' state go
    at commit."""

    kind = GroupKind.MAMBA_ALIGN
    __slots__ = ()
    lets_go = True
    nulls_positions = True
    recurrent = True
    stops_at_block_end = True
    full_hit = False
    event_covers_run = True

    def first_visible_position(self, position: int) -> int:
        return max(0, position - 1)  # the state after the token before (vLLM's skipped tokens: n - 1)

    def most_held(self, nb: int) -> int:
        return min(nb, 2)  # the state it reads, the one it writes

    def held_computing(self, start: int, end: int, block_size: int) -> int:
        return min(2, -(-end // block_size) - self.first_visible_block(start, block_size))

    def period(self, block_size: int) -> int:
        return block_size

    def admission_cost(self, nb: int, hit: tuple[int, ...], first: int) -> tuple[int, tuple[int, ...]]:
        # one fresh block at the last position; one for the hit's state where the host tier holds it
        return int(nb > len(hit)) + hit.count(HOSTED), self.hit_taken(hit, first)

    def admitted(self, hit: tuple[int, ...], nb: int, first: int, pop: Pop) -> tuple[int, ...]:
        # the hit's state block (the null block before it; a fresh one the tier's state is loaded into, popped
        # first), then one fresh block at the last position
        hit = _fresh_for_hosted(hit, pop)
        return tuple(0 if j < first else b for j, b in enumerate(hit)) + _aligned(nb - len(hit), pop)

    def growth_blocks(self, opened: int) -> int:
        return int(opened > 0)

    def grown(self, ids: tuple[int, ...], opened: int, pop: Pop) -> tuple[int, ...]:
        return ids + _aligned(opened, pop)  # its last state block stays: the next forward reads it

    def let_go(self, ids: tuple[int, ...], future: int, previous: int, block_size: int) -> Sequence[int]:
        # null between its state blocks: scanned from the last commit's first visible block
        first = self.first_visible_block(future, block_size)
        since = self.first_visible_block(previous, block_size)
        return [k for k in range(since, min(first, len(ids))) if ids[k]]


def _aligned(opened: int, pop: Pop) -> tuple[int, ...]:
    """``opened`` new positions of an align-mode state group: the null block at each but the last, one fresh
    block there for the state the forward writes; nothing for none."""
    return (0,) * (opened - 1) + pop(1) if opened > 0 else ()


RULES: dict[GroupKind, type[KindRules]] = {
    c.kind: c for c in (FullAttention, LatentAttention, SlidingWindow, ChunkedLocal, MambaState, MambaAlign)
}
