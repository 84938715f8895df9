"""Step-level continuous batching of diffusion (DiT) requests: a pure planner of denoising ticks.

Request mode (``policy``) plans a diffusion request whole: one admission, every step in one plan entry.
Here each ``tick`` advances every active request by one denoising step, and admits waiting requests
(first come, first served) between ticks while their blocks fit. A request's first step writes its whole
sequence (phase ``prefill``), later steps only its target span (phase ``denoise``). The tick's requests
are batched into forwards per segment structure: rows whose causal flags agree share a snapshot (every later
step of every request is one full span, so they all batch together; first steps batch with first steps of
the same layout), packed up to the forward budget (``Budget``: the rows and query tokens one forward of the
worker holds). CFG rows are a request's rows: they are admitted, stepped and released together. A request
finishes, is cancelled or fails on its own (``done``, ``cancel``, ``fail``). Active requests are never
preempted: their blocks are fixed at admission and a preempted DiT request would have to restart from its
latent, so a request that does not fit waits instead.

    s = DiTState.empty(kv, Budget(rows=16, tokens=2048))
    s = submit_job(s, DiTJob("img", spec, steps=30)).unwrap()
    s, plan = tick(s).unwrap()          # TickPlan: forwards (phase, request ids, metadata, their step index)
    ... run each forward ...
    s, finished = done(s).unwrap()      # or, a forward failed: s, finished, failed = fail(s, its ids).unwrap()
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from returns.result import Failure, Result, Success

from pagedkv.core.rules.admission import admit, refusal
from pagedkv.core.rules.commit import commit
from pagedkv.core.errors import ErrorCode, KVError, RequestId, invalid, is_int, is_request_id, shown
from pagedkv.core.outputs.metadata import KVMetadata
from pagedkv.core.rules.release import release
from pagedkv.core.outputs.snapshot import publish
from pagedkv.core.spec import RequestSpec
from pagedkv.core.store.state import KVState


@dataclass(frozen=True, slots=True)
class DiTJob:
    """A diffusion request: its rows (one per CFG branch, ``RowSpec`` with prefix and target) and steps."""

    request_id: RequestId
    spec: RequestSpec
    steps: int


@dataclass(frozen=True, slots=True)
class Budget:
    """What the worker holds (None: no limit): ``rows``, the rows installed at once (its ``max_rows`` buffer rows:
    every active request's rows stay installed, so admission waits while they would not fit), and ``tokens``, the
    query tokens of one forward (its ``max_tokens``, or ``max_num_batched_tokens``). The planner never plans a
    forward the worker refuses."""

    rows: int | None = None
    tokens: int | None = None

    def check(self) -> KVError | None:
        for name in ("rows", "tokens"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                return invalid(
                    f"the forward budget's {name} must be a positive integer or None, got {shown(v)}", field=name
                )
        return None


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
    refused: tuple[tuple[RequestId, KVError], ...] = ()  # waiting requests ended: admission refuses them for good


@dataclass(frozen=True, slots=True)
class DiTState:
    """The KV state and the diffusion requests: waiting (not admitted) and active (request, steps, done)."""

    kv: KVState
    waiting: tuple[DiTJob, ...]
    active: tuple[tuple[RequestId, int, int], ...]
    tick: int = 0
    planned: tuple[RequestId, ...] = ()  # the requests the last tick stepped, until its done (or fail)
    budget: Budget = Budget()

    @staticmethod
    def empty(kv: KVState, budget: Budget = Budget()) -> DiTState:
        return DiTState(kv, (), (), budget=budget)


def submit_job(state: DiTState, job: DiTJob) -> Result[DiTState, KVError]:
    """Queue ``job``: its id new, its rows diffusion rows, and nothing admission would refuse for good (the
    pool, ``max_model_len``, row limits, a first step over the forward budget); refused with the reason,
    the state unchanged."""
    rid = job.request_id
    if not is_request_id(rid):
        return Failure(invalid(f"a request id must be a string or a 64-bit integer, got {shown(rid)}", field="request"))
    if rid in state.kv.requests or any(j.request_id == rid for j in state.waiting):
        return Failure(invalid(f"request {shown(rid)} is already submitted", request=rid, field="request"))
    if type(job.steps) is not int or job.steps < 1:
        return Failure(
            invalid(
                f"request {shown(rid)}: steps must be a positive integer, got {shown(job.steps)}",
                request=rid,
                field="steps",
            )
        )
    if not isinstance(job.spec, RequestSpec) or job.spec.request_id != rid:
        return Failure(
            invalid(f"request {shown(rid)}: its spec must be a RequestSpec of that id", request=rid, field="spec")
        )
    if not job.spec.rows or any(not r.is_diffusion or r.pending_tokens for r in job.spec.rows):
        return Failure(
            invalid(
                f"request {shown(rid)}: every row must be a diffusion row (prefix and target) computed "
                "here (no pending_tokens)",
                request=rid,
                field="rows",
            )
        )
    err = refusal(state.kv, job.spec) or _over_budget(state.budget, job.spec)
    if err is not None:
        return Failure(err)
    return Success(replace(state, waiting=(*state.waiting, job)))


def _over_budget(budget: Budget, spec: RequestSpec) -> KVError | None:
    """A request no forward of the budget can hold: more rows, or a first step of more query tokens (its
    whole rows, as without a prefix hit)."""
    rid, rows, tokens = spec.request_id, len(spec.rows), sum(r.num_tokens for r in spec.rows)
    if budget.rows is not None and rows > budget.rows:
        return KVError(
            ErrorCode.UNSCHEDULABLE,
            f"request {shown(rid)} has {rows} rows; the worker holds {budget.rows}",
            request=rid,
        )
    if budget.tokens is not None and tokens > budget.tokens:
        return KVError(
            ErrorCode.UNSCHEDULABLE,
            f"request {shown(rid)}'s first step computes {tokens} tokens; a forward holds {budget.tokens}",
            request=rid,
        )
    return None


def tick(state: DiTState) -> Result[tuple[DiTState, TickPlan], KVError]:
    """Admit what fits (in order; the first that does not fit stops admission; one refused for good is ended
    with its reason and the queue moves on; first steps admitted in a tick hold at most one forward's tokens),
    then plan one step of every active request, in forwards of one segment structure within the budget."""
    if state.planned:
        return Failure(invalid("tick before the last tick's done: its steps have not been reported", field="op"))
    kv, waiting, active, budget = state.kv, list(state.waiting), list(state.active), state.budget
    admitted: list[RequestId] = []
    refused: list[tuple[RequestId, KVError]] = []
    fresh = 0  # first-step tokens admitted this tick
    held = sum(len(kv.requests[rid].slots) for rid, _, _ in active)  # rows installed in the worker
    while waiting:
        job = waiting[0]
        tokens, rows = sum(r.num_tokens for r in job.spec.rows), len(job.spec.rows)
        if admitted and budget.tokens is not None and fresh + tokens > budget.tokens:
            break  # a burst waits: a tick takes one forward's worth of first steps
        if (active or admitted) and budget.rows is not None and held + rows > budget.rows:
            break  # the worker's rows are taken: it waits for a request to end
        step = admit(kv, job.spec)
        if isinstance(step, Failure):
            error = step.failure()
            if error.code is ErrorCode.NO_CAPACITY and (active or admitted):
                break  # it waits for blocks others give back
            refused.append((job.request_id, error))  # (with nothing running, no capacity is for good)
            waiting.pop(0)
            continue
        kv = step.unwrap().state
        waiting.pop(0)
        active.append((job.request_id, job.steps, 0))
        admitted.append(job.request_id)
        fresh, held = fresh + tokens, held + rows
    forwards = _forwards(kv, active, budget)
    if isinstance(forwards, KVError):
        return Failure(forwards)
    new = DiTState(
        kv, tuple(waiting), tuple(active), state.tick + 1, tuple(rid for f in forwards for rid in f.request_ids), budget
    )
    return Success((new, TickPlan(state.tick, tuple(forwards), tuple(admitted), tuple(refused))))


def _forwards(kv: KVState, active: list[tuple[RequestId, int, int]], budget: Budget) -> list[Forward] | KVError:
    """One step of every active request: grouped by phase and segment structure, each group packed in order
    into forwards of at most the budget's rows and tokens."""
    groups: dict[tuple[str, object], list[tuple[RequestId, int, int, int]]] = {}
    for rid, _steps, done_ in active:
        phase = "prefill" if done_ == 0 else "denoise"
        alone = publish(kv, [rid], phase)
        if isinstance(alone, Failure):
            error: KVError = alone.failure()
            return error
        metas = alone.unwrap().effect.rows
        flags = {tuple(s.causal for s in row.segments) for row in metas}
        key = (phase, next(iter(flags))) if len(flags) == 1 else (phase, rid)  # (rows that differ: a forward alone)
        groups.setdefault(key, []).append((rid, done_, len(metas), sum(r.query_len for r in metas)))
    parts: list[tuple[str, list[tuple[RequestId, int]]]] = []
    for (phase, _), members in groups.items():
        part: list[tuple[RequestId, int]] = []
        rows = tokens = 0
        for rid, done_, n, q in members:
            if part and (
                (budget.rows is not None and rows + n > budget.rows)
                or (budget.tokens is not None and tokens + q > budget.tokens)
            ):
                parts.append((phase, part))
                part, rows, tokens = [], 0, 0
            part.append((rid, done_))
            rows, tokens = rows + n, tokens + q
        parts.append((phase, part))
    forwards = []
    for phase, part in parts:
        meta = publish(kv, [rid for rid, _ in part], phase)
        if isinstance(meta, Failure):
            error = meta.failure()
            return error
        forwards.append(Forward(phase, tuple(r for r, _ in part), tuple(d for _, d in part), meta.unwrap().effect))
    return forwards


def done(state: DiTState) -> Result[tuple[DiTState, tuple[RequestId, ...]], KVError]:
    """The last tick's forwards ran: each request is one step further (its rows committed after its first
    step); those whose steps are all done are released and returned."""
    return _advance(state, frozenset(), retry=False).map(lambda r: (r[0], r[1]))


def fail(
    state: DiTState, request_ids: list[RequestId] | tuple[RequestId, ...], retry: bool = False
) -> Result[tuple[DiTState, tuple[RequestId, ...], tuple[RequestId, ...]], KVError]:
    """The last tick's forwards ran, those of ``request_ids`` failed: in one transition, every other request is
    one step further (as ``done``), and each failed one ends with reason ``error`` (nothing of its failed step
    is cached: a first step's rows are never committed; its blocks go back), or with ``retry`` stays active at
    its last good step (the next tick runs that step again). -> (state, finished, ended with error)."""
    if not state.planned:
        return Failure(invalid("fail comes between a tick and its done: no tick is outstanding", field="op"))
    if not isinstance(request_ids, (list, tuple)) or not request_ids:
        return Failure(
            invalid(f"fail needs the failed forward's request ids, got {shown(request_ids)}", field="requests")
        )
    for rid in request_ids:
        if not is_request_id(rid) or rid not in state.planned:
            return Failure(invalid(f"request {shown(rid)} was not stepped by the last tick", field="requests"))
    return _advance(state, frozenset(request_ids), retry=retry is True)


def _advance(
    state: DiTState, failed: frozenset[RequestId], retry: bool
) -> Result[tuple[DiTState, tuple[RequestId, ...], tuple[RequestId, ...]], KVError]:
    kv = state.kv
    ran = set(state.planned)
    active: list[tuple[RequestId, int, int]] = []
    finished: list[RequestId] = []
    ended: list[RequestId] = []
    for rid, steps, done_ in state.active:
        if rid not in ran or (rid in failed and retry):
            active.append((rid, steps, done_))
            continue
        reason = "error" if rid in failed else "finished" if done_ + 1 == steps else None
        if done_ == 0 and rid not in failed:  # the first step computed every row
            req = kv.requests[rid]
            step = commit(kv, rid, [kv.row_len[s] for s in req.slots])
            if isinstance(step, Failure):
                return Failure(step.failure())
            kv = step.unwrap().state
        if reason is None:
            active.append((rid, steps, done_ + 1))
            continue
        rel = release(kv, rid, reason)
        if isinstance(rel, Failure):
            return Failure(rel.failure())
        kv = rel.unwrap().state
        (ended if rid in failed else finished).append(rid)
    new = DiTState(kv, state.waiting, tuple(active), state.tick, (), state.budget)
    return Success((new, tuple(finished), tuple(ended)))


def steps_digest(state: DiTState) -> str:
    """The state's digest: the core's and the queues' (replay compares it event by event)."""
    from pagedkv.core.verify.digest import digest as kv_digest  # (verify imports this module: not at the top)

    queues = (
        kv_digest(state.kv),
        [(repr(j.request_id), j.steps) for j in state.waiting],
        [(repr(r), n, d) for r, n, d in state.active],
        state.tick,
        [repr(r) for r in state.planned],
        (state.budget.rows, state.budget.tokens),
    )
    return hashlib.blake2b(repr(queues).encode(), digest_size=16).hexdigest()


def cancel_job(state: DiTState, request_id: RequestId, reason: str = "cancelled") -> Result[DiTState, KVError]:
    """Drop a waiting request, or release an active one (between ticks); its blocks go back. ``reason``
    ``"error"`` for a request the caller gives up on (the core then takes back what it cached ahead); a step
    that failed is ``fail``'s."""
    if reason not in ("cancelled", "error"):
        return Failure(invalid(f'reason must be "cancelled" or "error", got {shown(reason)}', field="reason"))
    if not is_request_id(request_id):
        return Failure(
            invalid(f"a request id must be a string or a 64-bit integer, got {shown(request_id)}", field="request")
        )
    if state.planned:
        return Failure(
            invalid(
                "cancel between a tick and its done: a request cancels between ticks (a failed "
                "forward's requests: fail)",
                field="op",
            )
        )
    if any(j.request_id == request_id for j in state.waiting):
        return Success(replace(state, waiting=tuple(j for j in state.waiting if j.request_id != request_id)))
    if not any(rid == request_id for rid, _, _ in state.active):
        return Failure(
            KVError(ErrorCode.UNKNOWN_REQUEST, f"request {shown(request_id)} is not submitted", request=request_id)
        )
    rel = release(state.kv, request_id, reason)
    if isinstance(rel, Failure):
        return Failure(rel.failure())
    return Success(replace(state, kv=rel.unwrap().state, active=tuple(a for a in state.active if a[0] != request_id)))
