"""The core's state: one persistent snapshot, and the private working copy a
transition edits before it hands back the next snapshot.

Layout, chosen for the decode step (measured in bench/core_step.py): what a
request never changes after admission lives in its ``Request`` record; what
changes every step (row length, computed count, block lists) lives in
slot-indexed vectors, so growing a row is a vector ``set`` and not a rebuild of
nested records (a pvector evolver ``set`` costs ~0.1 us, a record ~1.4 us).

The free queue is a doubly linked list over block ids, kept in two vectors
(``free_next``, ``free_prev``) with block 0 (the null block, never free) as the
sentinel: ``free_next[0]`` is the head, ``free_prev[0]`` the tail. Popping the
head, pushing the tail and unlinking any block are O(1) vector sets: no
operation scans the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from pyrsistent import PMap, PVector, pmap, pvector
from pyrsistent.typing import PMapEvolver, PVectorEvolver

from pagedkv.core.config import CacheConfig
from pagedkv.core.errors import RequestId
from pagedkv.core.events import BlockRemoved, KVEvent
from pagedkv.core.hashing import BlockHash, CacheKey
from pagedkv.core.spec import Span

Blocks = tuple[tuple[int, ...], ...]  # per group: block ids by position (0 = null)
Pending = tuple[int, frozenset[int]]  # (tokens [0, n) that arrive from elsewhere, block positions not ready)
NO_PENDING: Pending = (0, frozenset())
E = TypeVar("E")


@dataclass(frozen=True, slots=True)
class RowLayout:
    """What a row keeps from its spec for its whole life."""

    prefix_len: int | None
    target_len: int | None
    spans: tuple[Span, ...]

    @property
    def is_diffusion(self) -> bool:
        return self.target_len is not None


@dataclass(frozen=True, slots=True)
class Request:
    """An admitted request. ``slots[i]`` indexes row i's entries in the row vectors."""

    request_id: RequestId
    slots: tuple[int, ...]
    layouts: tuple[RowLayout, ...]
    extra_keys: tuple[str, ...]
    generation: int  # the latest generation this request's block layout took
    decode_slot: int  # the slot of a one-row request that may grow, else -1 (decode fast path)
    cache_epoch: int  # the prefix-cache epoch it was admitted in; it caches blocks only in that one


@dataclass(frozen=True, slots=True)
class KVState:
    """The whole core state. A value: transitions return new ones, old ones stay valid."""

    config: CacheConfig
    refcount: PVector[int]  # by block id; block 0 is never referenced
    free_next: PVector[int]  # free-queue links by block id; 0 is the sentinel
    free_prev: PVector[int]
    num_free: int
    requests: PMap[RequestId, Request]
    row_len: PVector[int]  # by row slot: seq_len
    row_computed: PVector[int]  # by row slot: tokens whose KV is written
    row_blocks: PVector[Blocks]  # by row slot
    slot_stack: PVector[int]  # free row slots: entries [0, slot_top) are live
    slot_top: int
    generation: int  # latest generation issued; 0 before any
    epoch: int
    # -- prefix cache (empty unless config.enable_prefix_caching) --
    cache: PMap[CacheKey, int]  # (group, block hash) -> block id
    block_key: PVector[CacheKey | None]  # by block id: its key in the cache index, if any
    row_tokens: PVector[PVector[int] | None]  # by row slot: known token ids (a prefix of the row)
    row_hashes: PVector[tuple[BlockHash, ...]]  # by row slot: chain hashes of its blocks hashed so far
    row_pending: PVector[Pending]  # by row slot: KV arriving from elsewhere (tokens, block positions not ready)
    cache_epoch: int  # bumped by reset_prefix_cache: older requests no longer insert
    prefix_queries: int  # tokens looked up at admission
    prefix_hits: int  # of which came from the cache

    @property
    def free_blocks(self) -> int:
        """Length of the free queue (the null block is never counted)."""
        return self.num_free

    @property
    def usage(self) -> float:
        """Referenced blocks over usable blocks (cached blocks nobody holds count as free)."""
        usable = self.config.num_blocks - 1
        return (usable - self.num_free) / usable

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(frozen=True, slots=True)
class Step(Generic[E]):
    """A successful transition: the next state and what the shell should know."""

    state: KVState
    effect: E


def initial_state(config: CacheConfig, *, generation: int = 0, epoch: int = 0, cache_epoch: int = 0) -> KVState:
    """An empty pool: every usable block free, in id order.

    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s.free_blocks, list(free_queue(s))
    (8, [1, 2, 3, 4, 5, 6, 7, 8])
    """
    n = config.num_blocks
    nxt = list(range(1, n)) + [0]  # 0 -> 1 -> ... -> n-1 -> 0
    prv = [n - 1] + list(range(0, n - 1))
    return KVState(
        config=config,
        refcount=pvector([0] * n),
        free_next=pvector(nxt),
        free_prev=pvector(prv),
        num_free=n - 1,
        requests=pmap(),
        row_len=pvector(),
        row_computed=pvector(),
        row_blocks=pvector(),
        slot_stack=pvector(),
        slot_top=0,
        generation=generation,
        epoch=epoch,
        cache=pmap(),
        block_key=pvector([None] * n),
        row_tokens=pvector(),
        row_hashes=pvector(),
        row_pending=pvector(),
        cache_epoch=cache_epoch,
        prefix_queries=0,
        prefix_hits=0,
    )


def free_queue(state: KVState) -> list[int]:
    """The free queue from head (next to be allocated) to tail. O(free blocks)."""
    out = []
    b = state.free_next[0]
    while b:
        out.append(b)
        b = state.free_next[b]
        assert len(out) < state.config.num_blocks, "the free queue has a cycle (a block was freed twice)"
    return out


def request_blocks(state: KVState, request_id: RequestId) -> tuple[Blocks, ...]:
    """Per row, per group, the block ids of an admitted request."""
    req = state.requests[request_id]
    return tuple(state.row_blocks[s] for s in req.slots)


class Txn:
    """A transition's private working copy of one state (evolvers, then ``done``).

    Lives inside one transition function and never escapes it, so the core
    stays pure from the outside: the base state is never touched, and a
    refused transition simply drops its Txn.
    """

    __slots__ = (
        "config", "base", "refcount", "nxt", "prv", "num_free", "requests",
        "row_len", "row_computed", "row_blocks", "slot_stack", "slot_top", "generation",
        "cache", "block_key", "row_tokens", "row_hashes", "row_pending", "prefix_queries", "prefix_hits", "events",
    )  # fmt: skip

    def __init__(self, s: KVState) -> None:
        self.base = s
        self.config = s.config
        self.refcount: PVectorEvolver[int] = s.refcount.evolver()
        self.nxt: PVectorEvolver[int] = s.free_next.evolver()
        self.prv: PVectorEvolver[int] = s.free_prev.evolver()
        self.num_free = s.num_free
        self.requests: PMapEvolver[RequestId, Request] = s.requests.evolver()
        self.row_len: PVectorEvolver[int] = s.row_len.evolver()
        self.row_computed: PVectorEvolver[int] = s.row_computed.evolver()
        self.row_blocks: PVectorEvolver[Blocks] = s.row_blocks.evolver()
        self.slot_stack: PVectorEvolver[int] = s.slot_stack.evolver()
        self.slot_top = s.slot_top
        self.generation = s.generation
        self.cache: PMapEvolver[CacheKey, int] = s.cache.evolver()
        self.block_key: PVectorEvolver[CacheKey | None] = s.block_key.evolver()
        self.row_tokens: PVectorEvolver[PVector[int] | None] = s.row_tokens.evolver()
        self.row_hashes: PVectorEvolver[tuple[BlockHash, ...]] = s.row_hashes.evolver()
        self.row_pending: PVectorEvolver[Pending] = s.row_pending.evolver()
        self.prefix_queries = s.prefix_queries
        self.prefix_hits = s.prefix_hits
        self.events: list[KVEvent] = []

    def done(self) -> KVState:
        b = self.base
        return KVState(
            config=b.config,
            refcount=self.refcount.persistent(),
            free_next=self.nxt.persistent(),
            free_prev=self.prv.persistent(),
            num_free=self.num_free,
            requests=self.requests.persistent(),
            row_len=self.row_len.persistent(),
            row_computed=self.row_computed.persistent(),
            row_blocks=self.row_blocks.persistent(),
            slot_stack=self.slot_stack.persistent(),
            slot_top=self.slot_top,
            generation=self.generation,
            epoch=b.epoch,
            cache=self.cache.persistent(),
            block_key=self.block_key.persistent(),
            row_tokens=self.row_tokens.persistent(),
            row_hashes=self.row_hashes.persistent(),
            row_pending=self.row_pending.persistent(),
            cache_epoch=b.cache_epoch,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
        )

    def next_generation(self) -> int:
        self.generation += 1
        return self.generation

    # -- free queue ---------------------------------------------------------
    def pop_free(self) -> int:
        """Take the head of the free queue (least recently freed) with one reference."""
        nxt, prv = self.nxt, self.prv
        b = nxt[0]
        assert b != 0, "pop_free on an empty free queue: capacity was not checked"
        after = nxt[b]
        nxt[0] = after
        prv[after] = 0
        self.num_free -= 1
        self.refcount[b] = 1
        key = self.block_key[b]
        if key is not None:  # evict: the block's old content is about to be overwritten
            self.cache.remove(key)
            self.block_key[b] = None
            self.events.append(BlockRemoved(key[1], key[0], b))
        return b

    def push_free(self, b: int) -> None:
        """Append ``b`` at the tail of the free queue (most recently freed)."""
        nxt, prv = self.nxt, self.prv
        tail = prv[0]
        nxt[tail] = b
        prv[b] = tail
        nxt[b] = 0
        prv[0] = b
        self.num_free += 1

    def is_cached(self, key: CacheKey) -> bool:
        return key in self.cache  # type: ignore[operator]  # the evolver has __contains__; its stub lacks it

    def take_hit(self, b: int) -> None:
        """One more reference to a cached block; out of the free queue if nobody held it."""
        rc = self.refcount[b]
        if rc == 0:
            self.unlink_free(b)
        self.refcount[b] = rc + 1

    def unlink_free(self, b: int) -> None:
        """Take ``b`` out of the middle of the free queue (a prefix-cache hit)."""
        nxt, prv = self.nxt, self.prv
        before, after = prv[b], nxt[b]
        nxt[before] = after
        prv[after] = before
        self.num_free -= 1

    def unref(self, b: int) -> None:
        rc = self.refcount[b] - 1
        assert rc >= 0, f"block {b} released more often than it was referenced"
        self.refcount[b] = rc
        if rc == 0:
            self.push_free(b)

    # -- row slots ----------------------------------------------------------
    def new_slot(
        self, seq_len: int, computed: int, blocks: Blocks, tokens: PVector[int] | None, hashes: tuple[BlockHash, ...],
        pending: Pending = NO_PENDING,
    ) -> int:
        if self.slot_top:
            self.slot_top -= 1
            slot = self.slot_stack[self.slot_top]
            self.row_len[slot] = seq_len
            self.row_computed[slot] = computed
            self.row_blocks[slot] = blocks
            self.row_tokens[slot] = tokens
            self.row_hashes[slot] = hashes
            self.row_pending[slot] = pending
            return slot
        slot = len(self.row_len)
        self.row_len.append(seq_len)
        self.row_computed.append(computed)
        self.row_blocks.append(blocks)
        self.row_tokens.append(tokens)
        self.row_hashes.append(hashes)
        self.row_pending.append(pending)
        return slot

    def free_slot(self, slot: int) -> None:
        self.row_len[slot] = 0
        self.row_computed[slot] = 0
        self.row_blocks[slot] = ()
        self.row_tokens[slot] = None
        self.row_hashes[slot] = ()
        self.row_pending[slot] = NO_PENDING
        if self.slot_top < len(self.slot_stack):
            self.slot_stack[self.slot_top] = slot
        else:
            self.slot_stack.append(slot)
        self.slot_top += 1
