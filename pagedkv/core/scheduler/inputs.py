"""What arrives from outside a step: a request (``submit``), or its end (``cancel``)."""

from __future__ import annotations

from dataclasses import replace

from pyrsistent import PDeque
from returns.result import Failure, Result, Success

from pagedkv.core.rules.caching import chain_of
from pagedkv.core.errors import (
    INT_ID_LIMIT,
    ErrorCode,
    KVError,
    RequestId,
    are_token_ids,
    fail,
    invalid,
    is_int,
    is_request_id,
    is_seq,
    shown,
)
from pagedkv.core.rules.hashing import BlockKeys
from pagedkv.core.rules.release import forget_host as core_forget_host
from pagedkv.core.rules.release import release
from pagedkv.core.scheduler.lifecycle import Move, advance, moved
from pagedkv.core.scheduler.records import SchedState, SeqRequest
from pagedkv.core.spec import check_request_spec


def submit(state: SchedState, request: SeqRequest) -> Result[SchedState, KVError]:
    """An arrival: checked, then queued at the tail of the waiting queue."""
    err = _check(state, request)
    if err is not None:
        return Failure(err)
    rid = request.request_id
    req = replace(_as_tuples(request), arrival=state.arrivals)
    cfg = state.kv.config
    if req.rows is None and cfg.enable_prefix_caching:  # (hashed once here, never at each try to admit it)
        keys = BlockKeys.of(req.extra_keys, kind=cfg.block_hash)
        req = replace(req, block_hashes=chain_of(cfg, state.kv.cache.root, req.prompt, keys))
    log = state.log.edit()
    log.add(rid)
    return Success(
        replace(
            state,
            waiting=state.waiting.append(rid),
            stages=state.stages.set(rid, moved(None, Move.SUBMIT)),
            seqs=state.seqs.set(rid, req),
            log=log.persistent(),
            arrivals=state.arrivals + 1,
            kv_events=(),
        )
    )


def _check(state: SchedState, request: object) -> KVError | None:
    if not isinstance(request, SeqRequest) or not is_request_id(request.request_id):
        return invalid("submit needs a SeqRequest with a string or integer id", field="request")
    rid = request.request_id
    if request.rows is None:
        if not is_seq(request.prompt) or not request.prompt or not are_token_ids(request.prompt):
            return invalid(
                f"request {shown(rid)}: prompt must be a non-empty list of token ids", request=rid, field="prompt"
            )
        if not is_int(request.max_tokens) or not 1 <= request.max_tokens < INT_ID_LIMIT:
            return invalid(
                f"request {shown(rid)}: max_tokens must be a positive integer", request=rid, field="max_tokens"
            )
    elif not is_int(request.steps) or request.steps < 1:
        return invalid(f"request {shown(rid)}: steps must be a positive integer", request=rid, field="steps")
    if request.rows is not None and not is_seq(request.rows):
        return invalid(f"request {shown(rid)}: rows must be a tuple of RowSpec", request=rid, field="rows")
    if not is_seq(request.extra_keys):
        return invalid(f"request {shown(rid)}: extra_keys must be a tuple of keys", request=rid, field="extra_keys")
    err = check_request_spec(_as_tuples(request).spec())
    if err is not None:
        return err
    if rid in state.seqs:
        return KVError(ErrorCode.DUPLICATE_REQUEST, f"request {shown(rid)} is already waiting or running", request=rid)
    return None


def _as_tuples(request: SeqRequest) -> SeqRequest:
    """A checked request as the state keeps it: its lists as tuples, no output yet."""
    rows = None if request.rows is None else tuple(request.rows)
    return replace(request, prompt=tuple(request.prompt), rows=rows, extra_keys=tuple(request.extra_keys), output=())


def cancel(state: SchedState, request_id: RequestId, reason: str = "cancelled") -> Result[SchedState, KVError]:
    """End a waiting or running request (``reason``: cancelled or error); its blocks go back."""
    if not isinstance(reason, str) or reason not in ("cancelled", "error"):
        return Failure(invalid(f"cancel reason must be cancelled or error, got {shown(reason)}", field="reason"))
    if not is_request_id(request_id) or request_id not in state.seqs:
        return fail(ErrorCode.UNKNOWN_REQUEST, f"request {shown(request_id)} is not waiting or running", None)
    return Success(ended(state, request_id, reason))


def forget_host(state: SchedState, slots: object) -> Result[SchedState, KVError]:
    """The core's ``forget_host`` under the scheduler: host-tier entries the shell could not write dropped (a store
    that failed); their ``HostBlockRemoved`` in ``kv_events``."""
    return core_forget_host(state.kv, slots).map(lambda s: replace(state, kv=s.state, kv_events=s.effect.events))


def ended(state: SchedState, request_id: RequestId, reason: str) -> SchedState:
    """``state`` without the live request ``request_id`` (its blocks back, out of the queues, the log and a plan
    in flight), which ended with ``reason``: cancelled, error, or finished (a stop token whose id came late)."""
    advance(state.stages[request_id], Move.FINISH if reason == "finished" else Move.CANCEL)
    kv, events = state.kv, state.kv_events[:0]
    if request_id in kv.requests:
        released = release(kv, request_id, reason).unwrap()
        kv, events = released.state, released.effect.events
    log = state.log.edit()
    log.drop(request_id)
    return replace(
        state,
        kv=kv,
        waiting=_without(state.waiting, request_id),
        running=tuple(r for r in state.running if r != request_id),
        stages=state.stages.delete(request_id),
        seqs=state.seqs.delete(request_id),
        log=log.persistent(),
        sched_decode=tuple(r for r in state.sched_decode if r != request_id),
        sched_prefill=tuple(p for p in state.sched_prefill if p[0] != request_id),
        sched_diffusion=tuple(r for r in state.sched_diffusion if r != request_id),
        kv_events=events,
        sched_verify=tuple(v for v in state.sched_verify if v[0] != request_id),
        awaiting=state.awaiting - {request_id},
    )


def _without(q: PDeque[RequestId], rid: RequestId) -> PDeque[RequestId]:
    return q.remove(rid) if rid in q else q
