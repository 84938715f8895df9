"""A stable digest of a scheduler state: the core's canonical form, and the scheduler's own
(queues, requests, outcomes, the pending plan) as ints, strings and tuples."""

from __future__ import annotations

import hashlib
from typing import Any

from pagedkv.core.scheduler.records import SchedState, SeqRequest
from pagedkv.core.verify.digest import canonical


def sched_canonical(state: SchedState) -> tuple[Any, ...]:
    """The scheduler state's canonical form: the core's, and the queues, requests, outcomes and plan
    as ints, strings and tuples (enums as their values)."""
    order = sorted(state.live.keys(), key=lambda r: (type(r).__name__, r))
    reqs = tuple((type(r).__name__, r, _req_key(state.live[r])) for r in order)
    fin = tuple(sorted(((type(r).__name__, r, str(how)) for r, how in state.finished.items())))
    plan = _pending_plan(state)
    cfg = state.config
    awaiting = (tuple(sorted(state.awaiting, key=lambda r: (type(r).__name__, r))),) if state.awaiting else ()
    return ("pagedkv-scheduler/1", cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.chunked_prefill,
            cfg.watermark_blocks, cfg.allow_overtaking, canonical(state.kv), tuple(state.waiting), state.running,
            tuple(sorted(state.prefilling, key=str)), reqs, fin, plan, state.step, state.arrivals,
            *awaiting)  # fmt: skip


def _pending_plan(state: SchedState) -> tuple[tuple[Any, ...], ...]:
    """The last plan's entries until its on_output (decodes, prefill chunks, diffusion runs, decodes verifying
    drafts: these only when there are any, so a run without drafts digests as before) as tuples."""
    kv = state.kv
    out: list[tuple[Any, ...]] = [("decode", rid, 1, kv.row_len[kv.requests[rid].slots[0]], True)
                                  for rid in state.sched_decode]  # fmt: skip
    out += [("prefill", *p) for p in state.sched_prefill]
    out += [("diffusion", rid, 0, 0, False) for rid in state.sched_diffusion]
    out += [("verify", rid, kv.row_len[kv.requests[rid].slots[0]], draft) for rid, draft in state.sched_verify]
    return tuple(out)


def _req_key(r: SeqRequest) -> tuple[Any, ...]:
    rows = None if r.rows is None else tuple(
        (x.num_tokens, x.tokens, x.prefix_len, x.target_len, x.spans) for x in r.rows)  # fmt: skip
    return (r.prompt, r.max_tokens, rows, r.steps, r.extra_keys, r.output, r.arrival)


def sched_digest(state: SchedState) -> str:
    """32 hex digits that name a scheduler state (its core's included)."""
    return hashlib.blake2b(repr(sched_canonical(state)).encode(), digest_size=16).hexdigest()
