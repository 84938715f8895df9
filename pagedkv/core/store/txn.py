"""A transition's private working copy of one state: edits, then ``done``.

Each vector's edit and each map's mutation is opened on first use and copies
nothing until its first write; ``done`` builds the next state from what was
opened. The pool's mechanics (pops, frees, hits) are pool.py's, the row slots'
are here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from immutables import MapMutation
from returns.result import Failure, Result, Success

from pagedkv.core.errors import ErrorCode, KVError, RequestId, invalid, is_request_id, is_seq, pairs_of, shown
from pagedkv.core.outputs.events import KVEvent
from pagedkv.core.store.host import HostEdit
from pagedkv.core.store.index import PrefixIndexEdit
from pagedkv.core.store.rerooted import IntArrayEdit
from pagedkv.core.store.state import EMPTY_ROW, KVState, Request, Row, Step
from pagedkv.core.store.vec import VecEdit

E = TypeVar("E")


class Txn:
    """A transition's private working copy of one state (edits, then ``done``).

    Lives inside one transition function and never escapes it, so the core
    stays pure from the outside: the base state is never touched, and a
    refused transition simply drops its Txn. Each vector's edit and each map's
    mutation is opened on its first use, and copies nothing until its first
    write; ``done`` builds the next state from what was opened.
    """

    __slots__ = (
        "config",
        "base",
        "free_blocks",
        "slot_top",
        "generation",
        "prefix_queries",
        "prefix_hits",
        "events",
        "_refcount",
        "_nxt",
        "_prv",
        "_row_len",
        "_row_computed",
        "_row_tail",
        "_rows",
        "_row_generation",
        "_slot_stack",
        "_requests",
        "_index",
        "_host",
    )

    def __init__(self, s: KVState) -> None:
        self.base = s
        self.config = s.config
        self.free_blocks = s.free_blocks
        self.slot_top = s.slot_top
        self.generation = s.generation
        self.prefix_queries = s.prefix_queries
        self.prefix_hits = s.prefix_hits
        self.events: list[KVEvent] = []
        self._refcount: IntArrayEdit | None = None
        self._nxt: IntArrayEdit | None = None
        self._prv: IntArrayEdit | None = None
        self._row_len: VecEdit[int] | None = None
        self._row_computed: VecEdit[int] | None = None
        self._row_tail: VecEdit[bytes | None] | None = None
        self._rows: VecEdit[Row] | None = None
        self._row_generation: VecEdit[int] | None = None
        self._slot_stack: VecEdit[int] | None = None
        self._requests: MapMutation[RequestId, Request] | None = None
        self._index: PrefixIndexEdit | None = None
        self._host: HostEdit | None = None

    # -- the working copies, each opened on its first use ------------------------
    @property
    def host(self) -> HostEdit:
        """The host tier's working copy (core/store/host.py)."""
        if self._host is None:
            self._host = HostEdit(self.base.host)
        return self._host

    @property
    def refcount(self) -> IntArrayEdit:
        e = self._refcount
        if e is None:
            e = self._refcount = IntArrayEdit(self.base.refcount)
        return e

    @property
    def nxt(self) -> IntArrayEdit:  # the free queue's forward links
        e = self._nxt
        if e is None:
            e = self._nxt = IntArrayEdit(self.base.free_next)
        return e

    @property
    def prv(self) -> IntArrayEdit:  # and its backward links
        e = self._prv
        if e is None:
            e = self._prv = IntArrayEdit(self.base.free_prev)
        return e

    @property
    def row_len(self) -> VecEdit[int]:
        e = self._row_len
        if e is None:
            e = self._row_len = VecEdit(self.base.row_len)
        return e

    @property
    def row_computed(self) -> VecEdit[int]:
        e = self._row_computed
        if e is None:
            e = self._row_computed = VecEdit(self.base.row_computed)
        return e

    @property
    def row_tail(self) -> VecEdit[bytes | None]:
        e = self._row_tail
        if e is None:
            e = self._row_tail = VecEdit(self.base.row_tail)
        return e

    @property
    def rows(self) -> VecEdit[Row]:
        e = self._rows
        if e is None:
            e = self._rows = VecEdit(self.base.rows)
        return e

    @property
    def row_generation(self) -> VecEdit[int]:
        e = self._row_generation
        if e is None:
            e = self._row_generation = VecEdit(self.base.row_generation)
        return e

    @property
    def slot_stack(self) -> VecEdit[int]:
        e = self._slot_stack
        if e is None:
            e = self._slot_stack = VecEdit(self.base.slot_stack)
        return e

    @property
    def requests(self) -> MapMutation[RequestId, Request]:
        if self._requests is None:
            self._requests = self.base.requests.mutate()
        return self._requests

    @property
    def index(self) -> PrefixIndexEdit:
        if self._index is None:
            self._index = self.base.cache.edit(self.base.config.cache_duplicates)
        return self._index

    def done(self) -> KVState:
        b = self.base
        return KVState(
            b.config,
            b.refcount if self._refcount is None else self._refcount.persistent(),
            b.free_next if self._nxt is None else self._nxt.persistent(),
            b.free_prev if self._prv is None else self._prv.persistent(),
            self.free_blocks,
            b.requests if self._requests is None else self._requests.finish(),
            b.row_len if self._row_len is None else self._row_len.persistent(),
            b.row_computed if self._row_computed is None else self._row_computed.persistent(),
            b.row_tail if self._row_tail is None else self._row_tail.persistent(),
            b.rows if self._rows is None else self._rows.persistent(),
            b.row_generation if self._row_generation is None else self._row_generation.persistent(),
            b.slot_stack if self._slot_stack is None else self._slot_stack.persistent(),
            self.slot_top,
            self.generation,
            b.epoch,
            b.cache if self._index is None else self._index.persistent(),
            b.cache_epoch,
            self.prefix_queries,
            self.prefix_hits,
            b.host if self._host is None else self._host.done(),
        )

    def admitted(self, rid: RequestId, rows: object, op: str, unit: str, field: str) -> Request | KVError:
        """The admitted request ``rid`` whose rows ``rows`` name one ``unit`` each (``op``: the call, for the
        message), or why not: ``UNKNOWN_REQUEST``, or ``INVALID`` on ``field``."""
        req = self.base.requests.get(rid) if is_request_id(rid) else None
        if req is None:
            return KVError(ErrorCode.UNKNOWN_REQUEST, f"request {shown(rid)} is not admitted", request=rid)
        if not is_seq(rows) or len(rows) != len(req.slots):
            return invalid(
                f"{op} of request {shown(rid)} must give {unit} per row ({len(req.slots)})", request=rid, field=field
            )
        return req

    def next_generation(self) -> int:
        """The next generation: never reused (a release takes one; a layout that changes, ``new_layout``)."""
        self.generation += 1
        return self.generation

    def new_layout(self, first_slot: int) -> int:
        """A request's block layout changed (admitted, grown into new blocks, a window let blocks go, cut back):
        it takes the next generation, kept at its first row's slot. The one writer of a request's generation."""
        gen = self.next_generation()
        self.row_generation[first_slot] = gen
        return gen

    # -- row slots ----------------------------------------------------------
    def new_slot(self, seq_len: int, computed: int, row: Row, tail: bytes | None, generation: int = 0) -> int:
        if self.slot_top:
            self.slot_top -= 1
            slot = self.slot_stack[self.slot_top]
            self.row_len[slot] = seq_len
            self.row_computed[slot] = computed
            self.row_tail[slot] = tail
            self.rows[slot] = row
            self.row_generation[slot] = generation
            return slot
        self.row_computed.append(computed)
        self.row_tail.append(tail)
        self.rows.append(row)
        self.row_generation.append(generation)
        return self.row_len.append(seq_len)

    def free_slot(self, slot: int) -> None:
        """The slot's numbers stay until ``new_slot`` writes them; its objects go now (their memory)."""
        self.row_tail[slot] = None
        self.rows[slot] = EMPTY_ROW
        if self.slot_top < len(self.slot_stack):
            self.slot_stack[self.slot_top] = slot
        else:
            self.slot_stack.append(slot)
        self.slot_top += 1


def each(
    state: KVState, items: Iterable[tuple[RequestId, Any]], one: Callable[[Txn, RequestId, Any], E | KVError], what: str
) -> Result[Step[tuple[E, ...]], KVError]:
    """Several one-request changes as one transition (``commit_many``, ``fill_many``, ...): ``one`` applied to
    each item in order on a single working copy; all of them, or none (the first refusal)."""
    pairs = pairs_of(items, what)
    if isinstance(pairs, KVError):
        return Failure(pairs)
    txn = Txn(state)
    out: list[E] = []
    for rid, arg in zip(*pairs):
        got = one(txn, rid, arg)
        if isinstance(got, KVError):
            return Failure(got)
        out.append(got)
    return Success(Step(txn.done(), tuple(out)))
