"""The core's state: one persistent snapshot, and the private working copy a
transition edits before it hands back the next snapshot.

Layout, chosen for the decode step with CPython's GC on (bench/peers.py):

- Per block, ``refcount``, ``free_next`` and ``free_prev`` are integer ``Vec``
  values (leaves of ``array('q')``, which the GC never walks). The free queue is
  a doubly linked list over block ids with block 0 (the null block, never free)
  as the sentinel: ``free_next[0]`` is the head, ``free_prev[0]`` the tail.
  Popping the head, pushing the tail and unlinking any block are O(1) writes.
- The prefix-cache index (``cache``: (group, hash) -> block) and its reverse
  (``block_key``: block -> (group, hash), only for cached blocks) and the
  requests are ``immutables.Map`` values: a HAMT in C whose update copies a
  path of small nodes, so a step's garbage stays small.
- Per row slot, what changes every step (``row_len``, ``row_computed``) is an
  integer ``Vec``; the token ids of the row's open block (``row_tail``) are
  ``bytes`` (eight little-endian bytes an id), which the GC does not track;
  what changes once a block or less (block lists, token chunks, hashes,
  pending KV) is one ``Row`` record.

Nothing here grows a GC-tracked container per token: a decode step writes a few
integers and bytes per request.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Generic, TypeVar

from immutables import Map, MapMutation

from pagedkv.core.config import CacheConfig
from pagedkv.core.errors import RequestId
from pagedkv.core.events import BlockRemoved, KVEvent
from pagedkv.core.hashing import BlockHash, CacheKey
from pagedkv.core.spec import Span
from pagedkv.core.vec import Vec, VecEdit

Blocks = tuple[tuple[int, ...], ...]  # per group: block ids by position (0 = null)
Pending = tuple[int, frozenset[int]]  # (tokens [0, n) that arrive from elsewhere, block positions not ready)
Chunks = tuple[tuple[int, ...], ...]  # token ids in pieces: the admission's, then one piece per block filled
NO_PENDING: Pending = (0, frozenset())
E = TypeVar("E")
SLOT_SHIFT = 5  # row vectors grow one slot at a time: leaves of 32


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

    def at_generation(self, generation: int) -> Request:
        return Request(self.request_id, self.slots, self.layouts, self.extra_keys, generation, self.decode_slot,
                       self.cache_epoch)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Row:
    """What a row changes at most once a block: its block lists, token ids, hashes, pending KV.

    Known token ids are ``chunks`` (positions ``[0, chunked)``) followed by the
    row's tail bytes (``KVState.row_tail``); ``chunks is None`` for a row
    without ids (or with prefix caching off), and a tail of ``None`` means the
    ids stopped at ``chunked`` (the row grew by a count).
    """

    blocks: Blocks
    chunks: Chunks | None
    chunked: int
    hashes: tuple[BlockHash, ...]  # chain hashes of its blocks hashed so far
    pending: Pending = NO_PENDING

    # the changes a transition makes (explicit constructors: dataclasses.replace costs ~4 us)
    def with_blocks(self, blocks: Blocks) -> Row:
        return Row(blocks, self.chunks, self.chunked, self.hashes, self.pending)

    def with_hashes(self, hashes: tuple[BlockHash, ...]) -> Row:
        return Row(self.blocks, self.chunks, self.chunked, hashes, self.pending)

    def with_chunk(self, chunk: tuple[int, ...]) -> Row:
        """The ids of a filled block (or the rest of a tail) join the chunks."""
        assert self.chunks is not None
        return Row(self.blocks, self.chunks + (chunk,), self.chunked + len(chunk), self.hashes, self.pending)

    def with_pending(self, pending: Pending) -> Row:
        return Row(self.blocks, self.chunks, self.chunked, self.hashes, pending)


EMPTY_ROW = Row((), None, 0, ())


@dataclass(frozen=True, slots=True)
class KVState:
    """The whole core state. A value: transitions return new ones, old ones stay valid."""

    config: CacheConfig
    refcount: Vec[int]  # by block id; block 0 is never referenced
    free_next: Vec[int]  # free-queue links by block id; 0 is the sentinel
    free_prev: Vec[int]
    num_free: int
    requests: Map[RequestId, Request]
    row_len: Vec[int]  # by row slot: seq_len
    row_computed: Vec[int]  # by row slot: tokens whose KV is written
    row_tail: Vec[bytes | None]  # by row slot: ids of positions [chunked, len) packed, or None
    rows: Vec[Row]  # by row slot
    slot_stack: Vec[int]  # free row slots: entries [0, slot_top) are live
    slot_top: int
    generation: int  # latest generation issued; 0 before any
    epoch: int
    # -- prefix cache (empty unless config.enable_prefix_caching) --
    cache: Map[CacheKey, int]  # (group, block hash) -> block id
    block_key: Map[int, CacheKey]  # block id -> its key in the cache index, for cached blocks only
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

    # -- read-only views by row slot (what request_blocks and the checks read) --
    @property
    def row_blocks(self) -> _SlotView[Blocks]:
        return _SlotView(self, _blocks_of)

    @property
    def row_pending(self) -> _SlotView[Pending]:
        return _SlotView(self, _pending_of)

    @property
    def row_hashes(self) -> _SlotView[tuple[BlockHash, ...]]:
        return _SlotView(self, _hashes_of)

    @property
    def row_tokens(self) -> _SlotView[tuple[int, ...] | None]:
        return _SlotView(self, row_token_ids)


T = TypeVar("T")


class _SlotView(Generic[T]):
    """``state.row_blocks[slot]`` and friends: one field of every row, read by slot."""

    __slots__ = ("state", "field")

    def __init__(self, state: KVState, field: object) -> None:
        self.state = state
        self.field = field

    def __getitem__(self, slot: int) -> T:
        return self.field(self.state, slot)  # type: ignore[operator, no-any-return]


def _blocks_of(state: KVState, slot: int) -> Blocks:
    return state.rows[slot].blocks


def _pending_of(state: KVState, slot: int) -> Pending:
    return state.rows[slot].pending


def _hashes_of(state: KVState, slot: int) -> tuple[BlockHash, ...]:
    return state.rows[slot].hashes


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as the tail stores them: eight little-endian bytes each."""
    return array("Q", ids).tobytes()


def unpack_ids(data: bytes) -> tuple[int, ...]:
    a = array("Q")
    a.frombytes(data)
    return tuple(a)


def row_token_ids(state: KVState, slot: int) -> tuple[int, ...] | None:
    """The known token ids of a row (a prefix of it), or None if it has none."""
    row = state.rows[slot]
    if row.chunks is None:
        return None
    out: tuple[int, ...] = tuple(t for chunk in row.chunks for t in chunk)
    tail = state.row_tail[slot]
    return out + unpack_ids(tail) if tail else out


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
        refcount=Vec.of([0] * n, ints=True),
        free_next=Vec.of(nxt, ints=True),
        free_prev=Vec.of(prv, ints=True),
        num_free=n - 1,
        requests=Map(),
        row_len=Vec.of((), ints=True, shift=SLOT_SHIFT),
        row_computed=Vec.of((), ints=True, shift=SLOT_SHIFT),
        row_tail=Vec.of((), ints=False, shift=SLOT_SHIFT),
        rows=Vec.of((), ints=False, shift=SLOT_SHIFT),
        slot_stack=Vec.of((), ints=True, shift=SLOT_SHIFT),
        slot_top=0,
        generation=generation,
        epoch=epoch,
        cache=Map(),
        block_key=Map(),
        cache_epoch=cache_epoch,
        prefix_queries=0,
        prefix_hits=0,
    )


def free_queue(state: KVState) -> list[int]:
    """The free queue from head (next to be allocated) to tail. O(free blocks)."""
    out = []
    nxt = state.free_next
    b = nxt[0]
    while b:
        out.append(b)
        b = nxt[b]
        assert len(out) < state.config.num_blocks, "the free queue has a cycle (a block was freed twice)"
    return out


def request_blocks(state: KVState, request_id: RequestId) -> tuple[Blocks, ...]:
    """Per row, per group, the block ids of an admitted request."""
    req = state.requests[request_id]
    rows = state.rows
    return tuple(rows[s].blocks for s in req.slots)


class Txn:
    """A transition's private working copy of one state (edits, then ``done``).

    Lives inside one transition function and never escapes it, so the core
    stays pure from the outside: the base state is never touched, and a
    refused transition simply drops its Txn. Vector edits copy nothing until
    their first write; map mutations are opened on first write.
    """

    __slots__ = (
        "config", "base", "refcount", "nxt", "prv", "num_free", "_requests", "row_len", "row_computed", "row_tail",
        "rows", "slot_stack", "slot_top", "generation", "_cache", "_block_key", "prefix_queries", "prefix_hits",
        "events",
    )  # fmt: skip

    def __init__(self, s: KVState) -> None:
        self.base = s
        self.config = s.config
        self.refcount: VecEdit[int] = VecEdit(s.refcount)
        self.nxt: VecEdit[int] = VecEdit(s.free_next)
        self.prv: VecEdit[int] = VecEdit(s.free_prev)
        self.num_free = s.num_free
        self._requests: MapMutation[RequestId, Request] | None = None
        self.row_len: VecEdit[int] = VecEdit(s.row_len)
        self.row_computed: VecEdit[int] = VecEdit(s.row_computed)
        self.row_tail: VecEdit[bytes | None] = VecEdit(s.row_tail)
        self.rows: VecEdit[Row] = VecEdit(s.rows)
        self.slot_stack: VecEdit[int] = VecEdit(s.slot_stack)
        self.slot_top = s.slot_top
        self.generation = s.generation
        self._cache: MapMutation[CacheKey, int] | None = None
        self._block_key: MapMutation[int, CacheKey] | None = None
        self.prefix_queries = s.prefix_queries
        self.prefix_hits = s.prefix_hits
        self.events: list[KVEvent] = []

    # map mutations, opened on the first write (immutables' MapMutation)
    @property
    def requests(self) -> MapMutation[RequestId, Request]:
        if self._requests is None:
            self._requests = self.base.requests.mutate()
        return self._requests

    @property
    def cache(self) -> MapMutation[CacheKey, int]:
        if self._cache is None:
            self._cache = self.base.cache.mutate()
        return self._cache

    @property
    def block_key(self) -> MapMutation[int, CacheKey]:
        if self._block_key is None:
            self._block_key = self.base.block_key.mutate()
        return self._block_key

    def done(self) -> KVState:
        b = self.base
        return KVState(
            config=b.config,
            refcount=self.refcount.persistent(),
            free_next=self.nxt.persistent(),
            free_prev=self.prv.persistent(),
            num_free=self.num_free,
            requests=b.requests if self._requests is None else self._requests.finish(),
            row_len=self.row_len.persistent(),
            row_computed=self.row_computed.persistent(),
            row_tail=self.row_tail.persistent(),
            rows=self.rows.persistent(),
            slot_stack=self.slot_stack.persistent(),
            slot_top=self.slot_top,
            generation=self.generation,
            epoch=b.epoch,
            cache=b.cache if self._cache is None else self._cache.finish(),
            block_key=b.block_key if self._block_key is None else self._block_key.finish(),
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
        key = (self.base.block_key if self._block_key is None else self._block_key).get(b)
        if key is not None:  # evict: the block's old content is about to be overwritten
            del self.cache[key]
            del self.block_key[b]
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
        return key in (self.base.cache if self._cache is None else self._cache)

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
    def new_slot(self, seq_len: int, computed: int, row: Row, tail: bytes | None) -> int:
        if self.slot_top:
            self.slot_top -= 1
            slot = self.slot_stack[self.slot_top]
            self.row_len[slot] = seq_len
            self.row_computed[slot] = computed
            self.row_tail[slot] = tail
            self.rows[slot] = row
            return slot
        self.row_computed.append(computed)
        self.row_tail.append(tail)
        self.rows.append(row)
        return self.row_len.append(seq_len)

    def free_slot(self, slot: int) -> None:
        self.row_len[slot] = 0
        self.row_computed[slot] = 0
        self.row_tail[slot] = None
        self.rows[slot] = EMPTY_ROW
        if self.slot_top < len(self.slot_stack):
            self.slot_stack[self.slot_top] = slot
        else:
            self.slot_stack.append(slot)
        self.slot_top += 1
