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
from pagedkv.core.spec import Span

Blocks = tuple[tuple[int, ...], ...]  # per group: block ids by position (0 = null)
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

    @property
    def free_blocks(self) -> int:
        """Length of the free queue (the null block is never counted)."""
        return self.num_free


@dataclass(frozen=True, slots=True)
class Step(Generic[E]):
    """A successful transition: the next state and what the shell should know."""

    state: KVState
    effect: E


def initial_state(config: CacheConfig, *, generation: int = 0, epoch: int = 0) -> KVState:
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
    )


def free_queue(state: KVState) -> list[int]:
    """The free queue from head (next to be allocated) to tail. O(free blocks)."""
    out = []
    b = state.free_next[0]
    while b:
        out.append(b)
        b = state.free_next[b]
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
    def new_slot(self, seq_len: int, computed: int, blocks: Blocks) -> int:
        if self.slot_top:
            self.slot_top -= 1
            slot = self.slot_stack[self.slot_top]
            self.row_len[slot] = seq_len
            self.row_computed[slot] = computed
            self.row_blocks[slot] = blocks
            return slot
        slot = len(self.row_len)
        self.row_len.append(seq_len)
        self.row_computed.append(computed)
        self.row_blocks.append(blocks)
        return slot

    def free_slot(self, slot: int) -> None:
        self.row_len[slot] = 0
        self.row_computed[slot] = 0
        self.row_blocks[slot] = ()
        if self.slot_top < len(self.slot_stack):
            self.slot_stack[self.slot_top] = slot
        else:
            self.slot_stack.append(slot)
        self.slot_top += 1
