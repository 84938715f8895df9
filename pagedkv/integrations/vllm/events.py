"""pagedkv's KV events in vLLM's wire format (vLLM 0.33 and 0.34: ``vllm.distributed.kv_events``, unchanged between them): msgspec
structs of the same names, fields, order, defaults and tags, so the msgpack bytes are the ones vLLM's
own types produce (tests/integrations/test_vllm_events.py holds them byte for byte against bytes vLLM encoded) and
vLLM's decoder reads them. Block hashes go out as int64, vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
rule applied to pagedkv's 16-byte chain hashes (the low 64 bits of the big-endian integer). A run of
blocks one request stored in one group, each the parent of the next, is one ``BlockStored``, as vLLM
sends it.

    batch = to_vllm_batch(step.effect.events, cache_config, ts=time.time())
    wire = encode(batch)            # what vLLM's ZmqEventPublisher sends as a batch's payload
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import msgspec

from pagedkv.core.config import CacheConfig
from pagedkv.core.outputs.events import AllBlocksCleared as CoreCleared
from pagedkv.core.outputs.events import BlockRemoved as CoreRemoved
from pagedkv.core.outputs.events import BlockStored as CoreStored
from pagedkv.core.outputs.events import BlockOffloaded, HostBlockRemoved
from pagedkv.core.outputs.events import KVEvent
from pagedkv.core.rules.kinds import GroupKind

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # the host tier's (core/store/host.py): as vLLM's offloading connector publishes its CPU tier
SPEC_KIND = {
    GroupKind.FULL: "full_attention",
    GroupKind.SLIDING_WINDOW: "sliding_window",
    GroupKind.CHUNKED_LOCAL: "chunked_local_attention",
    GroupKind.MLA: "mla_attention",
    GroupKind.MAMBA: "mamba",
    GroupKind.MAMBA_ALIGN: "mamba",
}  # (vLLM's KVCacheSpecKind values)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged by class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def int64_hash(block_hash: bytes) -> int:
    """vLLM's int form of a block hash: the big-endian integer's low 64 bits (stable across processes).

    >>> int64_hash(bytes(range(16)))
    579005069656919567
    """
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)


class RequestFields(NamedTuple):
    """What a ``BlockStored`` carries of the request that stored its blocks (vLLM's manager sets them)."""

    lora_id: int | None = None
    lora_name: str | None = None
    session_id: str | None = None


def event_keys(keys: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A block's extra keys as vLLM's events carry them (its ``to_event_extra_keys``): untagged, a bare LoRA
    name and a bare salt, an ``(identifier, offset)`` pair for a multimodal input; None for a block without.

    >>> event_keys((("lora", "a", "/p"), ("mm", "img", -1), ("cache_salt", "s")))
    ('a', ('img', -1), 's')
    """
    if not keys:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


def _by_group(events: Iterable[KVEvent]) -> list[KVEvent]:
    """Each run of consecutive stores ordered by group (stable): a commit stores block by block across
    groups, vLLM group by group; stores of different groups are independent, so nothing else moves."""
    out: list[KVEvent] = []
    run: list[CoreStored] = []
    for ev in [*events, None]:
        if isinstance(ev, CoreStored):
            run.append(ev)
            continue
        ordered: list[CoreStored] = sorted(run, key=_group)
        out.extend(ordered)
        run = []
        if ev is not None:
            out.append(ev)
    return out


def _group(ev: CoreStored) -> int:
    return ev.group


class EventTypes(NamedTuple):
    """The classes ``to_vllm`` builds: this module's structs, or vLLM's own (``vllm.distributed.kv_events``: the same
    names, fields and defaults), as the manager hands them to vLLM's scheduler."""

    stored: Any
    removed: Any
    cleared: Any


OURS = EventTypes(BlockStored, BlockRemoved, AllBlocksCleared)


def to_vllm(
    events: Iterable[KVEvent],
    config: CacheConfig,
    medium: str | None = MEDIUM_GPU,
    *,
    request: RequestFields | None = None,
    external: Callable[[bytes], int | bytes] = int64_hash,
    types: EventTypes = OURS,
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """pagedkv's events as vLLM's, in order (a run of stores group by group); consecutive stores of one
    chain in one group merged into one ``BlockStored``, as vLLM sends a request's newly full blocks. The host
    tier's (``BlockOffloaded``, ``HostBlockRemoved``) go out with ``medium="CPU"`` as vLLM's offloading connector
    sends its CPU tier's; a load back (``BlockOnloaded``) is announced by nobody, as there.
    ``request``: the stores carry its adapter and session and each block's extra keys, as vLLM's manager
    sends them; ``external``: a hash as the events carry it (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``:
    the int64 form, or the bytes); ``types``: the classes built (vLLM's own, where its scheduler takes them)."""
    stored_cls, removed_cls, cleared_cls = types
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    lora_id, lora_name, session_id = request if request is not None else (None, None, None)
    last: tuple[int, bytes] | None = None  # (group, hash) of the block the last BlockStored ended with
    for ev in _by_group(events):
        if isinstance(ev, CoreStored):
            if out and last == (ev.group, ev.parent_hash) and isinstance(out[-1], stored_cls):
                prev = out[-1]
                prev.block_hashes.append(external(ev.block_hash))
                prev.token_ids.extend(ev.token_ids)
                if prev.extra_keys is not None:
                    prev.extra_keys.append(event_keys(ev.extra_keys) if ev.extra_keys else None)
                if prev.lookahead_token_ids is not None and ev.lookahead is not None:
                    prev.lookahead_token_ids.append(list(ev.lookahead))
            else:
                g = config.groups[ev.group]
                keys = None if request is None else [event_keys(ev.extra_keys) if ev.extra_keys else None]
                out.append(
                    stored_cls(
                        block_hashes=[external(ev.block_hash)],
                        parent_block_hash=None if ev.parent_hash is None else external(ev.parent_hash),
                        token_ids=list(ev.token_ids),
                        block_size=config.block_size,
                        lora_id=lora_id,
                        medium=medium,
                        lora_name=lora_name,
                        extra_keys=keys,
                        group_idx=ev.group,
                        kv_cache_spec_kind=SPEC_KIND[g.kind],
                        kv_cache_spec_sliding_window=g.window,
                        session_id=session_id,
                        lookahead_token_ids=None if ev.lookahead is None else [list(ev.lookahead)],
                    )
                )
            last = (ev.group, ev.block_hash)
            continue
        last = None
        if isinstance(ev, BlockOffloaded):  # (vLLM's offloading connector's store: the hash and group alone)
            out.append(_host_stored(external(ev.block_hash), ev.group, stored_cls))
        elif isinstance(ev, HostBlockRemoved):  # (one removal a run of a group's, as the connector batches them)
            tail = out[-1] if out else None
            if isinstance(tail, removed_cls) and tail.medium == MEDIUM_CPU and tail.group_idx == ev.group:
                tail.block_hashes.append(external(ev.block_hash))
            else:
                out.append(removed_cls(block_hashes=[external(ev.block_hash)], medium=MEDIUM_CPU, group_idx=ev.group))
        elif isinstance(ev, CoreRemoved):
            out.append(removed_cls(block_hashes=[external(ev.block_hash)], medium=medium, group_idx=ev.group))
        elif isinstance(ev, CoreCleared):
            out.append(cleared_cls())
    return out


def _host_stored(block_hash: int | bytes, group: int, cls: Any) -> BlockStored:
    """A block the host tier keeps, as vLLM's offloading connector announces a block its CPU tier stored (its
    events tracker's payload without self-describing events: the hash and the group, ``block_size`` 0)."""
    return cls(  # type: ignore[no-any-return]
        block_hashes=[block_hash],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=MEDIUM_CPU,
        lora_name=None,
        group_idx=group,
    )


def to_vllm_batch(
    events: Iterable[KVEvent],
    config: CacheConfig,
    *,
    ts: float,
    medium: str | None = MEDIUM_GPU,
    data_parallel_rank: int | None = None,
) -> KVEventBatch:
    """One batch of a step's events, as vLLM's publisher sends them."""
    return KVEventBatch(ts=ts, events=to_vllm(events, config, medium), data_parallel_rank=data_parallel_rank)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    return _DECODER.decode(payload)
