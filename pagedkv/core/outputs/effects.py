"""What each transition hands back beside the next state: its effect, as a plain record.

The shell reads generations and block ids from them; routers read their KV events.
``takes_generation`` is the rule of which transitions must take a new generation, in one
place: the model checker and ``pagedkv replay --check`` both hold every transition to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pagedkv.core.errors import RequestId
from pagedkv.core.outputs.events import KVEvent
from pagedkv.core.store.state import Blocks


class ReleaseReason(StrEnum):
    FINISHED = "finished"
    CANCELLED = "cancelled"
    ERROR = "error"
    PREEMPTED = "preempted"


@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: RequestId
    generation: int
    cached_tokens: tuple[int, ...]  # per row: tokens whose KV came from the prefix cache
    blocks: tuple[Blocks, ...]  # per row, per group
    events: tuple[KVEvent, ...] = ()  # evictions its allocation caused


@dataclass(frozen=True, slots=True)
class Appended:
    # (request, generation it took) for every request that got new blocks, in order
    allocations: tuple[tuple[RequestId, int], ...]
    events: tuple[KVEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class Committed:
    request_id: RequestId
    generation: int | None  # taken only when the block layout changed (a windowed group let blocks go)
    freed_blocks: int = 0
    events: tuple[KVEvent, ...] = ()  # blocks stored in the prefix cache


@dataclass(frozen=True, slots=True)
class Decoded:
    """What a batch decode transition (``commit_decode``, ``decode_step``) did."""

    # (request, generation it took) for every request whose block layout changed, in order
    allocations: tuple[tuple[RequestId, int], ...]
    freed_blocks: int = 0  # blocks windowed groups let go
    events: tuple[KVEvent, ...] = ()  # blocks stored in the prefix cache, evictions


@dataclass(frozen=True, slots=True)
class TurnedAway:
    request_id: RequestId
    rows_tried: int  # the leading rows that took blocks, and gave them back
    events: tuple[KVEvent, ...] = ()  # the cached blocks their pops evicted


@dataclass(frozen=True, slots=True)
class Released:
    request_id: RequestId
    reason: ReleaseReason
    generation: int
    freed_blocks: int  # blocks that went back to the free queue
    events: tuple[KVEvent, ...] = ()  # a state saved in the cache (state groups), entries a failed step takes back


@dataclass(frozen=True, slots=True)
class WasReset:
    epoch: int
    released: tuple[RequestId, ...]
    events: tuple[KVEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefixCacheReset:
    dropped: int  # hashes dropped from the cache index
    events: tuple[KVEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class HostForgotten:
    """``forget_host``: the host tier's entries in these slots dropped (their bytes were never written)."""

    slots: tuple[int, ...]  # the slots asked
    forgotten: int  # entries dropped
    events: tuple[KVEvent, ...] = ()  # a HostBlockRemoved each


@dataclass(frozen=True, slots=True)
class Filled:
    """Token ids arrived for positions a row grew by without them (placeholders)."""

    request_id: RequestId
    events: tuple[KVEvent, ...] = ()  # blocks the ids completed, hashed and cached


@dataclass(frozen=True, slots=True)
class Truncated:
    """A row's unverified tail was cut back (rejected draft tokens); the blocks that held only cut positions
    went back to the free queue."""

    request_id: RequestId
    generation: int | None  # taken only when a block went back
    freed_blocks: int = 0


@dataclass(frozen=True, slots=True)
class MarkedReady:
    request_id: RequestId
    row: int
    ready: tuple[int, ...]  # block positions that became ready
    pending: tuple[int, ...]  # block positions still pending


def takes_generation(effect: object) -> bool | None:
    """Must the transition that had this effect take a new generation (True), must it not
    (False), or does it depend on the layout (None: a commit takes one exactly when a windowed
    group let blocks go, which the window invariant covers)?

    >>> takes_generation(Released("a", ReleaseReason.FINISHED, 3, 1)), takes_generation(Appended(()))
    (True, False)
    """
    several = effect if isinstance(effect, tuple) else (effect,)  # release_many, commit_many
    if any(isinstance(e, (Admitted, Released)) for e in several):
        return True
    if any(isinstance(e, (Appended, Decoded)) and e.allocations for e in several):
        return True
    if any(isinstance(e, Truncated) and e.freed_blocks for e in several):
        return True
    if any(isinstance(e, Committed) for e in several):
        return None
    return False


def events_of(effect: object) -> tuple[KVEvent, ...]:
    """The KV events of a transition's effect (or of a tuple of effects: ``release_many``, ``commit_many``).

    >>> events_of(Released("a", ReleaseReason.FINISHED, 3, 1))
    ()
    """
    several = effect if isinstance(effect, tuple) else (effect,)
    out: tuple[KVEvent, ...] = ()
    for e in several:
        evs = getattr(e, "events", ())
        if evs:
            out += tuple(evs)
    return out
