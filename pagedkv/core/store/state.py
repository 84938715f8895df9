"""The core's state: one persistent snapshot (the working copy a transition
edits is txn.py's).

Layout, chosen for the decode step with CPython's GC on (bench/peers.py):

- Per block, ``refcount``, ``free_next`` and ``free_prev`` are ``IntArray``
  values (rerooted.py: one ``array('q')`` a lineage, which the GC never walks,
  written in place: a transition costs the entries it writes, indexed flat). The free queue is
  a doubly linked list over block ids with block 0 (the null block, never free)
  as the sentinel: ``free_next[0]`` is the head, ``free_prev[0]`` the tail.
  Popping the head, pushing the tail and unlinking any block are O(1) writes.
- The prefix-cache index (``cache``: (group, hash) -> block, and back) is a
  ``PrefixIndex``: small untracked dicts in a ``Vec``, and integer ``Vec``
  values by block (see index.py).
- The requests are an ``immutables.Map`` (a HAMT in C: a lookup costs what a
  dict's does); a request's record never changes after its admission, so the
  map changes only when requests come and go. What changes while it runs (its
  generation) is an integer ``Vec`` by row slot.
- Per row slot, what changes every step (``row_len``, ``row_computed``) is an
  integer ``Vec``; the token ids of the row's open block (``row_tail``) are
  ``bytes`` (eight little-endian bytes an id), which the GC does not track;
  what changes once a block or less (block lists, token ids and hashes as
  bytes, pending KV) is one ``Row`` record.

Nothing here grows a GC-tracked container per token: a decode step writes a few
integers and bytes per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from immutables import Map

from pagedkv.core.store.host import HostTier
from pagedkv.core.config import CacheConfig
from pagedkv.core.errors import InvariantError, RequestId
from pagedkv.core.rules.hashing import NO_KEYS, BlockHash, BlockKeys, Key, root_hash
from pagedkv.core.store.index import PrefixIndex
from pagedkv.core.store.rerooted import IntArray
from pagedkv.core.spec import Span
from pagedkv.core.store.tails import Ids, ids_count, ids_plus, known_ids, packed_known, unpack_ids
from pagedkv.core.store.vec import Vec

Blocks = tuple[tuple[int, ...], ...]  # per group: block ids by position (0 = null)
Pending = tuple[int, frozenset[int]]  # (tokens [0, n) that arrive from elsewhere, block positions not ready)
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
    extra_keys: tuple[Key, ...]
    decode_slot: int  # the slot of a one-row request that may grow, else -1 (the loops' common row)
    cache_epoch: int  # the prefix-cache epoch it was admitted in; it caches blocks only in that one
    keys: BlockKeys = NO_KEYS  # every block's extra keys, encoded for the pool's hash kind (hashing.BlockKeys)
    given: tuple[tuple[bytes, ...], ...] = ()  # per row, its caller's leading block hashes (RowSpec.block_hashes)


@dataclass(frozen=True, slots=True)
class Row:
    """What a row changes at most once a block: its block lists, token ids, hashes, pending KV.

    Token ids and hashes are ``bytes`` (eight little-endian bytes an id, sixteen a hash), which
    the GC does not track; the ids in chunks (``store.tails.Ids``). Known ids are ``ids`` (positions
    ``[0, chunked)``: the admission's, then each block the row moved past) followed by the row's tail (``KVState.row_tail``: the
    ids of its last block so far). ``ids is None`` for a row without ids (or with prefix caching
    off); a tail of ``None`` means the ids stopped at ``chunked`` (the row grew by a count).
    """

    blocks: Blocks
    ids: Ids | None
    hashes: bytes  # chain hashes of its blocks hashed so far, hw bytes each
    pending: Pending = NO_PENDING
    hw: int = 16  # bytes a hash (CacheConfig.hash_width)

    @property
    def chunked(self) -> int:
        return ids_count(self.ids) if self.ids is not None else 0

    @property
    def num_hashed(self) -> int:
        return len(self.hashes) // self.hw

    def hash_at(self, j: int) -> BlockHash:
        hw = self.hw
        return self.hashes[j * hw : (j + 1) * hw]

    # the changes a transition makes (explicit constructors: dataclasses.replace costs ~4 us)
    def with_blocks(self, blocks: Blocks) -> Row:
        return Row(blocks, self.ids, self.hashes, self.pending, self.hw)

    def with_hashes(self, hashes: bytes) -> Row:
        return Row(self.blocks, self.ids, hashes, self.pending, self.hw)

    def with_ids(self, more: bytes) -> Row:
        """Ids the row moved past (a tail's) join ``ids``."""
        if self.ids is None:
            raise InvariantError("a row that grows by ids holds its ids")
        return Row(self.blocks, ids_plus(self.ids, more), self.hashes, self.pending, self.hw)

    def with_pending(self, pending: Pending) -> Row:
        return Row(self.blocks, self.ids, self.hashes, pending, self.hw)


EMPTY_ROW = Row((), None, b"")


@dataclass(frozen=True, slots=True)
class KVState:
    """The whole core state. A value: transitions return new ones, old ones stay valid."""

    config: CacheConfig
    refcount: IntArray  # by block id; block 0 is never referenced
    free_next: IntArray  # free-queue links by block id; 0 is the sentinel
    free_prev: IntArray
    free_blocks: int
    requests: Map[RequestId, Request]
    row_len: Vec[int]  # by row slot: seq_len
    row_computed: Vec[int]  # by row slot: tokens whose KV is written
    row_tail: Vec[bytes | None]  # by row slot: packed ids of positions [chunked, len), or None
    rows: Vec[Row]  # by row slot
    row_generation: Vec[int]  # by row slot: the latest generation its request's block layout took
    slot_stack: Vec[int]  # free row slots: entries [0, slot_top) are live
    slot_top: int
    generation: int  # latest generation issued; 0 before any
    epoch: int
    # -- prefix cache (empty unless config.enable_prefix_caching) --
    cache: PrefixIndex  # (group, block hash) -> block id, and cache.key_of(block)
    cache_epoch: int  # bumped by reset_prefix_cache: older requests no longer insert
    prefix_queries: int  # tokens looked up at admission
    prefix_hits: int  # of which came from the cache
    host: HostTier = field(
        default_factory=HostTier.empty
    )  # the host tier (empty unless config.host_blocks: store/host.py)

    @property
    def usage(self) -> float:
        """Referenced blocks over usable blocks (cached blocks nobody holds count as free)."""
        usable = self.config.num_blocks - 1
        return (usable - self.free_blocks) / usable

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


def row_token_ids(state: KVState, slot: int) -> tuple[int, ...] | None:
    """The known token ids of a row (a prefix of it), or None if it has none."""
    row = state.rows[slot]
    if row.ids is None:
        return None
    tail = state.row_tail[slot]
    return unpack_ids(packed_known(row.ids, tail))


def row_known(state: KVState, slot: int) -> int:
    """How many leading positions of a row have known token ids (past them, positions the row grew by as
    placeholders await theirs); 0 for a row that keeps none."""
    return known_ids(state.rows[slot], state.row_tail[slot])


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
        refcount=IntArray.of([0] * n),
        free_next=IntArray.of(nxt),
        free_prev=IntArray.of(prv),
        free_blocks=n - 1,
        requests=Map(),
        row_len=Vec.of((), ints=True, shift=SLOT_SHIFT),
        row_computed=Vec.of((), ints=True, shift=SLOT_SHIFT),
        row_tail=Vec.of((), ints=False, shift=SLOT_SHIFT),
        rows=Vec.of((), ints=False, shift=SLOT_SHIFT),
        row_generation=Vec.of((), ints=True, shift=SLOT_SHIFT),
        slot_stack=Vec.of((), ints=True, shift=SLOT_SHIFT),
        slot_top=0,
        generation=generation,
        epoch=epoch,
        cache=PrefixIndex.empty(n, len(config.groups), root_hash(config.hash_namespace, config.block_hash)),
        cache_epoch=cache_epoch,
        prefix_queries=0,
        prefix_hits=0,
    )


def free_queue(state: KVState) -> list[int]:
    """The free queue from head (next to be allocated) to tail. O(free blocks)."""
    out = []
    after = state.free_next.values()
    limit = state.config.num_blocks
    b = after[0]
    while b:
        out.append(b)
        b = after[b]
        if len(out) >= limit:
            raise InvariantError("the free queue has a cycle (a block was freed twice)")
    return out


def request_generation(state: KVState, request_id: RequestId) -> int:
    """The latest generation an admitted request's block layout took."""
    return state.row_generation[state.requests[request_id].slots[0]]


def request_blocks(state: KVState, request_id: RequestId) -> tuple[Blocks, ...]:
    """Per row, per group, the block ids of an admitted request."""
    req = state.requests[request_id]
    rows = state.rows
    return tuple(rows[s].blocks for s in req.slots)
