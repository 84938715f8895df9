"""Step-level continuous batching of diffusion (DiT) requests: a pure planner of denoising ticks.

Request mode (``policy``) plans a diffusion request whole: one admission, every step in one plan entry.
Here each ``tick`` advances every active request by one denoising step, and admits waiting requests
(first come, first served) between ticks while their blocks fit. A request's first step writes its whole
sequence (phase ``prefill``), later steps only its target span (phase ``denoise``). The tick's requests
are batched into one forward per segment structure: rows whose causal flags agree share a snapshot
(every later step of every request is one full span, so they all batch together; first steps batch with
first steps of the same layout). CFG rows are a request's rows: they are admitted, stepped and released
together. A request finishes, is cancelled or fails on its own (``done``, ``cancel``). Active requests are
never preempted: their blocks are fixed at admission and a preempted DiT request would have to restart
from its latent, so a request that does not fit waits instead.

    s = StepState.empty(kv)
    s = submit_job(s, DiTJob("img", spec, steps=30)).unwrap()
    s, plan = tick(s).unwrap()          # TickPlan: forwards (phase, request ids, metadata, their step index)
    ... run each forward ...
    s, finished = done(s).unwrap()
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from returns.result import Failure, Result, Success

from pagedkv.core.admission import admit
from pagedkv.core.commit import commit
from pagedkv.core.errors import ErrorCode, KVError, RequestId, invalid, shown
from pagedkv.core.metadata import KVMetadata
from pagedkv.core.release import release
from pagedkv.core.snapshot import publish
from pagedkv.core.spec import RequestSpec
from pagedkv.core.state import KVState


@dataclass(frozen=True, slots=True)
class DiTJob:
    """A diffusion request: its rows (one per CFG branch, ``RowSpec`` with prefix and target) and steps."""

    request_id: RequestId
    spec: RequestSpec
    steps: int


@dataclass(frozen=True, slots=True)
class Forward:
    """One forward of a tick: the requests whose rows run together, and the step each is at."""

    phase: str  # "prefill" (a request's first step) or "denoise"
    request_ids: tuple[RequestId, ...]
    step_index: tuple[int, ...]  # per request: which of its steps this is (0 for prefill)
    metadata: KVMetadata


@dataclass(frozen=True, slots=True)
class TickPlan:
    tick: int
    forwards: tuple[Forward, ...]
    admitted: tuple[RequestId, ...]  # admitted before this tick


@dataclass(frozen=True, slots=True)
class StepState:
    """The KV state and the diffusion requests: waiting (not admitted) and active (request, steps, done)."""

    kv: KVState
    waiting: tuple[DiTJob, ...]
    active: tuple[tuple[RequestId, int, int], ...]
    tick: int = 0
    planned: tuple[RequestId, ...] = ()  # the requests the last tick stepped, until its done

    @staticmethod
    def empty(kv: KVState) -> StepState:
        return StepState(kv, (), ())


def submit_job(state: StepState, job: DiTJob) -> Result[StepState, KVError]:
    """Queue ``job`` (its rows must be diffusion rows; its id new)."""
    rid = job.request_id
    if rid in state.kv.requests or any(j.request_id == rid for j in state.waiting):
        return Failure(invalid(f"request {shown(rid)} is already submitted", request=rid, field="request"))
    if type(job.steps) is not int or job.steps < 1:
        return Failure(invalid(f"request {shown(rid)}: steps must be a positive integer, got {shown(job.steps)}",
                               request=rid, field="steps"))  # fmt: skip
    if not job.spec.rows or any(not r.is_diffusion for r in job.spec.rows):
        return Failure(invalid(f"request {shown(rid)}: every row must be a diffusion row (prefix and target)",
                               request=rid, field="rows"))  # fmt: skip
    return Success(StepState(state.kv, (*state.waiting, job), state.active, state.tick, state.planned))


def tick(state: StepState) -> Result[tuple[StepState, TickPlan], KVError]:
    """Admit what fits (in order; the first that does not fit stops admission), then plan one step of every
    active request, one forward per segment structure."""
    if state.planned:
        return Failure(invalid("tick before the last tick's done: its steps have not been reported", field="op"))
    kv, waiting, active = state.kv, list(state.waiting), list(state.active)
    admitted: list[RequestId] = []
    while waiting:
        job = waiting[0]
        step = admit(kv, job.spec)
        if isinstance(step, Failure):
            if step.failure().code is ErrorCode.NO_CAPACITY and (active or admitted):
                break  # it waits for blocks others give back
            return Failure(step.failure())  # refused for good (too long for the pool, say): the caller decides
        kv = step.unwrap().state
        waiting.pop(0)
        active.append((job.request_id, job.steps, 0))
        admitted.append(job.request_id)
    groups: dict[tuple[str, object], list[tuple[RequestId, int]]] = {}
    for rid, _steps, done_ in active:
        phase = "prefill" if done_ == 0 else "denoise"
        alone = publish(kv, [rid], phase)
        if isinstance(alone, Failure):
            return Failure(alone.failure())
        flags = {tuple(s.causal for s in row.segments) for row in alone.unwrap().effect.rows}
        key = (phase, next(iter(flags))) if len(flags) == 1 else (phase, rid)  # (rows that differ: a forward alone)
        groups.setdefault(key, []).append((rid, done_))
    forwards = []
    for (phase, _), members in groups.items():
        meta = publish(kv, [rid for rid, _ in members], phase)
        if isinstance(meta, Failure):
            return Failure(meta.failure())
        forwards.append(Forward(phase, tuple(r for r, _ in members), tuple(d for _, d in members),
                                meta.unwrap().effect))  # fmt: skip
    new = StepState(kv, tuple(waiting), tuple(active), state.tick + 1,
                    tuple(rid for f in forwards for rid in f.request_ids))  # fmt: skip
    return Success((new, TickPlan(state.tick, tuple(forwards), tuple(admitted))))


def done(state: StepState) -> Result[tuple[StepState, tuple[RequestId, ...]], KVError]:
    """The last tick's forwards ran: each request is one step further (its rows committed after its first
    step); those whose steps are all done are released and returned."""
    kv = state.kv
    ran = set(state.planned)
    active: list[tuple[RequestId, int, int]] = []
    finished: list[RequestId] = []
    for rid, steps, done_ in state.active:
        if rid not in ran:
            active.append((rid, steps, done_))
            continue
        if done_ == 0:  # the first step computed every row
            req = kv.requests[rid]
            step = commit(kv, rid, [kv.row_len[s] for s in req.slots])
            if isinstance(step, Failure):
                return Failure(step.failure())
            kv = step.unwrap().state
        if done_ + 1 == steps:
            rel = release(kv, rid, "finished")
            if isinstance(rel, Failure):
                return Failure(rel.failure())
            kv = rel.unwrap().state
            finished.append(rid)
        else:
            active.append((rid, steps, done_ + 1))
    return Success((StepState(kv, state.waiting, tuple(active), state.tick), tuple(finished)))


def steps_digest(state: StepState) -> str:
    """The state's digest: the core's and the queues' (replay compares it event by event)."""
    from pagedkv.core.verify.digest import digest as kv_digest  # (verify imports this module: not at the top)

    queues = (kv_digest(state.kv), [(repr(j.request_id), j.steps) for j in state.waiting],
              [(repr(r), n, d) for r, n, d in state.active], state.tick, [repr(r) for r in state.planned])  # fmt: skip
    return hashlib.blake2b(repr(queues).encode(), digest_size=16).hexdigest()


def cancel_job(state: StepState, request_id: RequestId, reason: str = "cancelled") -> Result[StepState, KVError]:
    """Drop a waiting request, or release an active one (between ticks); its blocks go back. ``reason``
    ``"error"`` for a request whose step failed (the core then takes back what it cached ahead)."""
    if reason not in ("cancelled", "error"):
        return Failure(invalid(f'reason must be "cancelled" or "error", got {shown(reason)}', field="reason"))
    if state.planned:
        return Failure(invalid("cancel between a tick and its done: a request cancels between ticks", field="op"))
    if any(j.request_id == request_id for j in state.waiting):
        return Success(StepState(state.kv, tuple(j for j in state.waiting if j.request_id != request_id),
                                 state.active, state.tick))  # fmt: skip
    if not any(rid == request_id for rid, _, _ in state.active):
        return Failure(KVError(ErrorCode.UNKNOWN_REQUEST, f"request {shown(request_id)} is not submitted",
                               request=request_id))  # fmt: skip
    rel = release(state.kv, request_id, reason)
    if isinstance(rel, Failure):
        return Failure(rel.failure())
    return Success(StepState(rel.unwrap().state, state.waiting,
                             tuple(a for a in state.active if a[0] != request_id), state.tick))  # fmt: skip
