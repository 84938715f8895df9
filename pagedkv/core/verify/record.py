"""Writing a scheduler run as a trace (contract v1): the header and the input events an engine
records, so that ``pagedkv replay`` gives the same plans and digests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pagedkv.core.config import CacheConfig
from pagedkv.core.scheduler import SchedulerConfig, SeqRequest
from pagedkv.core.spec import RequestSpec, RowSpec
from pagedkv.core.verify.trace import LIVE_DIGEST, SCHEDULER_KEYS, TRACE_VERSION


def scheduler_header(cache: CacheConfig, sched: SchedulerConfig) -> dict[str, Any]:
    """The first line of a scheduler trace (contract v1 with a "scheduler" config): its digest covers live state
    only, and it ends with an end record (``end_event``)."""
    groups = [
        {
            "name": g.name,
            "kind": g.kind.value,
            **({"window": g.window} if g.window else {}),
            **({"chunk": g.chunk} if g.chunk else {}),
        }
        for g in cache.groups
    ]
    return {
        "pagedkv_trace": TRACE_VERSION,
        "config": {
            "block_size": cache.block_size,
            "num_blocks": cache.num_blocks,
            "groups": groups,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "max_rows_per_request": cache.max_rows_per_request,
            "max_model_len": cache.max_model_len,
            "hash_namespace": cache.hash_namespace,
            **policy_keys(cache),
            "end_record": True,
            "scheduler": {
                **{k: getattr(sched, k) for k in SCHEDULER_KEYS},
                **({"grow_prefill": True} if sched.grow_prefill else {}),
                **(
                    {"long_prefill_token_threshold": sched.long_prefill_token_threshold}
                    if sched.long_prefill_token_threshold
                    else {}
                ),
                "digest": LIVE_DIGEST,
            },
        },
    }


def end_event(events: int) -> dict[str, Any]:
    """A trace's last line: the number of event lines before it, so that replay tells a whole trace from one cut
    short, or with lines lost or added (the header says ``"end_record": true``)."""
    return {"op": "end", "events": events}


def policy_keys(cache: CacheConfig) -> dict[str, str | bool | int]:
    """The header keys of the policies that differ from the defaults (a default header stays as it was)."""
    keys: dict[str, tuple[str | bool | int, str | bool | int]] = {
        "free_queue": ("tail", cache.free_queue),
        "reset_prefix_cache": ("always", cache.reset_prefix_cache),
        "caching_point": ("commit", cache.caching_point),
        "block_hash": ("blake2b", cache.block_hash),
        "cache_duplicates": (False, cache.cache_duplicates),
        "hash_lookahead": (0, cache.hash_lookahead),
        "kv_events": (True, cache.kv_events),
        "host_blocks": (0, cache.host_blocks),
        "host_store_threshold": (0, cache.host_store_threshold),
        "host_tracker_size": (64_000, cache.host_tracker_size),
    }
    return {k: v for k, (default, v) in keys.items() if v != default}


def row_json(r: RowSpec) -> dict[str, Any]:
    """A row of an admit or submit event (docs/trace.md): its ids or count, and the optional fields it sets."""
    row: dict[str, Any] = {"tokens": list(r.tokens)} if r.tokens is not None else {"num_tokens": r.num_tokens}
    if r.prefix_len is not None:
        row.update(prefix_len=r.prefix_len, target_len=r.target_len)
    if r.pending_tokens:
        row["pending_tokens"] = r.pending_tokens
    if r.placeholders:
        row["placeholders"] = r.placeholders
    if r.spans:
        row["spans"] = [list(sp) for sp in r.spans]
    if r.block_hashes:
        row["block_hashes"] = [h.hex() for h in r.block_hashes]
    return row


def keys_json(spec: RequestSpec) -> dict[str, Any]:
    """An admission's extra keys as its trace line carries them (each field only when given)."""
    out: dict[str, Any] = {}
    for name in ("extra_keys", "first_block_keys", "content"):
        if getattr(spec, name):
            out[name] = _listed(getattr(spec, name))
    return out


def _listed(value: Any) -> Any:
    return [_listed(v) for v in value] if isinstance(value, tuple) else value


def submit_event(req: SeqRequest) -> dict[str, Any]:
    ev: dict[str, Any] = {"op": "submit", "request": req.request_id}
    if req.rows is not None:
        ev.update(rows=[row_json(r) for r in req.rows], steps=req.steps)
    else:
        ev.update(prompt=list(req.prompt), max_tokens=req.max_tokens)
    if req.extra_keys:
        ev["extra_keys"] = _listed(req.extra_keys)
    if req.max_hit is not None:  # (written only when set: a trace without it reads as before)
        ev["max_hit"] = req.max_hit
    return ev


def output_event(sampled: Mapping[Any, Any], finished: Iterable[Any] = ()) -> dict[str, Any]:
    """An output line: ``[request, token]`` a sampled request, ``[request, [token, ...]]`` a decode that verified
    drafts (the accepted ones, then its sampled token), ``[request, null]`` a token whose id comes later."""
    return {
        "op": "output",
        "sampled": [[rid, tok if tok is None or type(tok) is int else list(tok)] for rid, tok in sampled.items()],
        "finished": list(finished),
    }
