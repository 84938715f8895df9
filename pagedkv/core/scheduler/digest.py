"""A stable digest of a scheduler state: the core's canonical form, and the scheduler's own
(queues, live requests, the pending plan) as ints, strings and tuples. It covers live state only, so it
costs what the live state holds, whatever the run served before (``ended``: the form of traces recorded
before that, which also covered every request that had ended)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from pagedkv.core.errors import RequestId
from pagedkv.core.scheduler.records import SchedState, SeqRequest
from pagedkv.core.verify.digest import canonical


def sched_canonical(state: SchedState, ended: Mapping[RequestId, str] | None = None) -> tuple[Any, ...]:
    """The scheduler state's canonical form: the core's, and the queues, live requests and plan as ints,
    strings and tuples (enums as their values). ``ended``: how each request that ended so far ended, for a
    trace recorded before the digest covered live state only (its header has no scheduler ``"digest"``)."""
    order = sorted(state.live.keys(), key=lambda r: (type(r).__name__, r))
    reqs = tuple((type(r).__name__, r, _req_key(state.live[r])) for r in order)
    fin = () if ended is None else (tuple(sorted(((type(r).__name__, r, how) for r, how in ended.items()))),)
    plan = _pending_plan(state)
    cfg = state.config
    awaiting = (tuple(sorted(state.awaiting, key=lambda r: (type(r).__name__, r))),) if state.awaiting else ()
    return (
        "pagedkv-scheduler/2" if ended is None else "pagedkv-scheduler/1",
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        cfg.chunked_prefill,
        cfg.watermark_blocks,
        cfg.allow_overtaking,
        canonical(state.kv),
        tuple(state.waiting),
        state.running,
        tuple(sorted(state.prefilling, key=str)),
        reqs,
        *fin,
        plan,
        state.step,
        state.arrivals,
        *awaiting,
    )


def _pending_plan(state: SchedState) -> tuple[tuple[Any, ...], ...]:
    """The last plan's entries until its on_output (decodes, prefill chunks, diffusion runs, decodes verifying
    drafts: these only when there are any, so a run without drafts digests as before) as tuples."""
    kv = state.kv
    out: list[tuple[Any, ...]] = [
        ("decode", rid, 1, kv.row_len[kv.requests[rid].slots[0]], True) for rid in state.sched_decode
    ]
    out += [("prefill", *p) for p in state.sched_prefill]
    out += [("diffusion", rid, 0, 0, False) for rid in state.sched_diffusion]
    out += [("verify", rid, kv.row_len[kv.requests[rid].slots[0]], draft) for rid, draft in state.sched_verify]
    return tuple(out)


def _req_key(r: SeqRequest) -> tuple[Any, ...]:
    rows = (
        None if r.rows is None else tuple((x.num_tokens, x.tokens, x.prefix_len, x.target_len, x.spans) for x in r.rows)
    )
    return (r.prompt, r.max_tokens, rows, r.steps, r.extra_keys, r.output, r.arrival)


def sched_digest(state: SchedState, ended: Mapping[RequestId, str] | None = None) -> str:
    """32 hex digits that name a scheduler state (its core's included); ``ended`` as in ``sched_canonical``."""
    return hashlib.blake2b(repr(sched_canonical(state, ended)).encode(), digest_size=16).hexdigest()
