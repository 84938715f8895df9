"""What pagedkv's vLLM manager sends out of each call it completes: the core's KV events as vLLM's own event
objects (with the adapter, session and extra keys of the request that stored the blocks, and hashes in the
form ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` asks for), and vLLM's KV cache residency metrics (its
``KVCacheMetricsCollector`` told of every block popped, allocated and touched, in vLLM's order).

A call's transitions run in a ``Transaction`` on a value of the state; only a call that completes is kept
(``EventStream.keep``), so a refused call sends nothing and counts nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from returns.result import Failure

from pagedkv.core.config import CacheConfig
from pagedkv.core.outputs.effects import events_of
from pagedkv.core.errors import KVError
from pagedkv.core.outputs.events import BlockStored
from pagedkv.core.rules.prefix import Hit
from pagedkv.core.spec import RequestSpec
from pagedkv.core.rules.hashing import BlockKeys
from pagedkv.core.store.state import KVState
from pagedkv.integrations.vllm.events import EventTypes, RequestFields, int64_hash, to_vllm
from pagedkv.integrations.vllm.requests import event_fields


class Refused(Exception):
    """A transition of a manager call was refused: the call is dropped whole."""

    def __init__(self, what: str, error: KVError) -> None:
        super().__init__(what)
        self.what, self.error = what, error

    def manager_error(self) -> ManagerError:
        """Where the core refused what vLLM's own manager would have done (a bug): what the caller raises."""
        return ManagerError(f"the core refused {self.what}: {self.error.code.value}: {self.error.message}")


class ManagerError(RuntimeError):
    """The core refused what vLLM's scheduler asked, where vLLM's own manager would have done it; the manager
    is left as it was before the call."""


class Transaction:
    """One manager call's transitions, applied to a value of the state (``state``) and their effects kept
    in order; the manager takes the state only when the call completes. ``touched`` and ``allocated`` are
    the blocks the call took from the cache and from the free queue, in vLLM's order (hits first, then new
    blocks, group by group), for the residency metrics."""

    __slots__ = ("base", "state", "effects", "touched", "allocated")

    def __init__(self, state: KVState) -> None:
        self.base = self.state = state
        self.effects: list[Any] = []
        self.touched: list[int] = []
        self.allocated: list[int] = []

    def apply(self, result: Any, what: str) -> Any:
        if isinstance(result, Failure):
            raise Refused(what, result.failure())
        step = result.unwrap()
        self.state = step.state
        self.effects.append(step.effect)
        return step


class _Place:
    """Where a queued call's events go in the stream (filled in when the queue is applied)."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: list[Any] = []


class EventStream:
    """The manager's outgoing KV events and metrics (module docstring)."""

    def __init__(self, config: CacheConfig, enabled: bool, *, caching: bool, metrics: Any, blocks: int) -> None:
        from vllm import envs
        from vllm.distributed import kv_events
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        self.config, self.enabled, self.caching, self.metrics = config, enabled, caching, metrics
        self._types = EventTypes(kv_events.BlockStored, kv_events.BlockRemoved, kv_events.AllBlocksCleared)
        # hashes as vLLM's events carry them (its maybe_convert_block_hash), the setting read once
        self._external: Callable[[bytes], int | bytes] = (
            int64_hash if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else bytes
        )
        # the KVCacheBlock objects handed to the scheduler carry block ids only, one per id, made once
        self.blocks = [KVCacheBlock(i) for i in range(blocks)]
        self.blocks[0].is_null = True
        self._events: list[Any] = []  # vLLM's event objects, or _Place

    def keep(self, txn: Transaction, request: Any) -> KVState:
        """A completed call: its events (the request's fields on its stores) and its metrics; its state."""
        if self.enabled:
            fields = None
            for effect in txn.effects:
                events = events_of(effect)
                if events:
                    fields = fields or (None if request is None else event_fields(request))
                    self._send(events, fields)
        if self.metrics is not None:
            for b in txn.touched:
                self.metrics.on_block_accessed(self.blocks[b])
            self.allocated(txn.allocated)
        return txn.state

    def allocated(self, blocks: Sequence[int]) -> None:
        """The metrics of blocks a queued call took from the free queue (told at once: they read no state)."""
        if self.metrics is not None:
            for b in blocks:
                if self.caching:  # vLLM's pool forgets a popped block's metrics (its eviction) first
                    self.metrics.on_block_evicted(self.blocks[b])
                self.metrics.on_block_allocated(self.blocks[b])

    def hold_place(self) -> _Place | None:
        """A place in the stream for the events of a queued call (None where events are off)."""
        if not self.enabled:
            return None
        place = _Place()
        self._events.append(place)
        return place

    def keep_queued(self, txn: Transaction, calls: Sequence[tuple[_Place | None, Any, Sequence[Any]]]) -> KVState:
        """The queue applied: each queued call's core events (``calls``: its place, its request, its events) as
        vLLM's, in the place it held; the state."""
        if self.enabled:
            for place, request, events in calls:
                if events and place is not None:
                    place.events = to_vllm(
                        events, self.config, request=event_fields(request), external=self._external, types=self._types
                    )
        return txn.state

    def announce(self, hit: Hit, spec: RequestSpec, fields: RequestFields) -> None:
        """``kv_cache_report_mode="full"``: the hit's blocks stored again, group by group, from block 0 (vLLM's
        ``emit_cached_block_events``: the cache is untouched, the consumer learns of the reuse)."""
        bs, ahead, hashes = self.config.block_size, self.config.hash_lookahead, hit.hashes[0]
        tokens = spec.rows[0].tokens or ()
        keys = BlockKeys.of(spec.extra_keys, content=spec.content, first=spec.first_block_keys)
        stores = [
            BlockStored(
                h,
                hashes[j - 1] if j else None,
                tuple(tokens[j * bs : (j + 1) * bs]),
                g,
                b,
                keys.raw(j, bs, ahead),
                tuple(tokens[(j + 1) * bs : (j + 1) * bs + ahead]) if ahead else None,
            )
            for g, ids in enumerate(hit.ids[0])
            for j, (h, b) in enumerate(zip(hashes, ids))
        ]
        self._send(tuple(stores), fields)

    def reset_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.reset()

    def take(self) -> list[Any]:
        """The events since the last call, as vLLM's own objects (built so as they were kept)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return [e for x in events for e in (x.events if isinstance(x, _Place) else (x,))]

    def _send(self, events: Sequence[Any], fields: RequestFields | None) -> None:
        if events:
            self._events.extend(
                to_vllm(
                    events, self.config, request=fields or RequestFields(), external=self._external, types=self._types
                )
            )
