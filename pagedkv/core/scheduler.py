"""The pure scheduler: who runs each step, how many tokens each computes, and
whom to preempt when decode growth runs out of blocks.

``schedule(state) -> (state', StepPlan)``: decodes first (oldest first), then
chunked prefills of running requests, then new admissions from the head of the
waiting queue while the token budget, ``max_num_seqs`` and the blocks allow. A
request refused with ``NO_CAPACITY`` waits at the head (nobody overtakes it
unless ``allow_overtaking``); a permanent refusal ends it with that code.

Decode growth that hits ``NO_CAPACITY`` preempts by recompute: the newest running
request is released (``preempted``) and goes back to the front of the waiting
queue; it is admitted again with its prompt and the tokens it generated, so its
output continues unchanged (the prefix cache makes that cheap).

Diffusion requests run at request level: one admission, every denoising step in
one plan entry (metadata for the first step and for the later ones), released
by the next ``on_output``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from immutables import Map
from pyrsistent import PDeque, pdeque
from returns.result import Failure, Result, Success

from pagedkv.core.config import CacheConfig, InvalidConfig
from pagedkv.core.digest import canonical
from pagedkv.core.errors import (
    ErrorCode, KVError, RequestId, are_token_ids, invalid, is_int, is_request_id, is_token_id,
)  # fmt: skip
from pagedkv.core.metadata import KVMetadata, publish
from pagedkv.core.outputs import TokenLog, TokenLogEdit
from pagedkv.core.spec import RequestSpec, RowSpec, check_request_spec
from pagedkv.core.state import KVState, initial_state
from pagedkv.core.transitions import admit, append, append_decode, commit_decode, commit_many, release, release_many


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests at most
    max_num_batched_tokens: int = 8192  # query tokens per step
    chunked_prefill: bool = True
    watermark_blocks: int = 0  # free blocks an admission leaves for decode growth
    allow_overtaking: bool = False  # may a later request be admitted past one that waits for blocks?

    def __post_init__(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            if not is_int(getattr(self, key)) or getattr(self, key) < 1:
                raise InvalidConfig(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if not is_int(self.watermark_blocks) or self.watermark_blocks < 0:
            raise InvalidConfig(f"watermark_blocks must be a non-negative integer, got {self.watermark_blocks!r}")
        for key in ("chunked_prefill", "allow_overtaking"):
            if type(getattr(self, key)) is not bool:
                raise InvalidConfig(f"{key} must be a boolean")


@dataclass(frozen=True, slots=True)
class SeqRequest:
    """What the scheduler keeps of a request.

    An LLM request has a ``prompt`` and grows ``output``; a diffusion request has
    ``rows`` (one per CFG branch) and ``steps`` denoising steps.
    """

    request_id: RequestId
    prompt: tuple[int, ...] = ()
    max_tokens: int = 16
    rows: tuple[RowSpec, ...] | None = None
    steps: int = 1
    extra_keys: tuple[str, ...] = ()
    output: tuple[int, ...] = ()
    arrival: int = 0

    @property
    def is_diffusion(self) -> bool:
        return self.rows is not None

    def spec(self) -> RequestSpec:
        """What admission sees: for an LLM request its prompt and every token it generated."""
        if self.rows is not None:
            return RequestSpec(self.request_id, self.rows, self.extra_keys)
        return RequestSpec(self.request_id, (RowSpec.of_tokens(self.prompt + self.output),), self.extra_keys)


@dataclass(frozen=True, slots=True)
class DiffusionRun:
    """A whole diffusion request in one plan entry: ``steps`` forwards, the first
    with ``first`` (phase prefill), the others with ``later`` (phase denoise)."""

    request_id: RequestId
    steps: int
    first: KVMetadata
    later: KVMetadata | None

    @property
    def phases(self) -> tuple[str, ...]:
        return ("prefill",) + ("denoise",) * (self.steps - 1)


@dataclass(frozen=True, slots=True)
class StepPlan:
    step: int
    decode: tuple[RequestId, ...]
    prefill: tuple[tuple[RequestId, int], ...]  # (request, query tokens this step)
    diffusion: tuple[DiffusionRun, ...]
    preempted: tuple[RequestId, ...]
    finished: tuple[tuple[RequestId, str], ...]  # ended by schedule itself (a permanent refusal)
    metadata: tuple[KVMetadata, ...]  # the LLM forward: prefill rows' snapshot, then decode rows'
    samples: tuple[RequestId, ...] = ()  # requests whose forward yields a token: on_output wants it

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(q for _, q in self.prefill) + sum(
            r.first.num_query_tokens for r in self.diffusion)  # fmt: skip

    @property
    def is_empty(self) -> bool:
        return not (self.decode or self.prefill or self.diffusion)


# (kind: prefill | decode | diffusion, request, query tokens, computed count after it, samples a token?)
Scheduled = tuple[str, RequestId, int, int, bool]
Prefilled = tuple[RequestId, int, int, bool]  # (request, query tokens, computed count after it, samples a token?)


@dataclass(frozen=True, slots=True)
class SchedState:
    """The scheduler's state, a value like the core's.

    Shaped for the common step (every running request decodes one token): what a
    request is (prompt, limits) sits in ``seqs`` and never changes while it runs;
    what it generated sits in ``log`` (bytes by slot); the last plan is kept as
    its decode batch, its prefill chunks and its diffusion runs.
    """

    config: SchedulerConfig
    kv: KVState
    waiting: PDeque[RequestId]
    running: tuple[RequestId, ...]  # in admission order: the newest is last
    prefilling: frozenset[RequestId]  # running requests whose prompt is not computed yet
    seqs: Map[RequestId, SeqRequest]  # waiting and running, as submitted (output empty)
    log: TokenLog  # waiting and running: the ids each generated so far
    finished: Map[RequestId, str]  # how each ended: finished, cancelled, error, or a refusal's code
    sched_decode: tuple[RequestId, ...]  # the last plan, until its on_output: its decodes,
    sched_prefill: tuple[Prefilled, ...]  # its prefill chunks,
    sched_diffusion: tuple[RequestId, ...]  # and its diffusion runs
    step: int
    arrivals: int

    @property
    def requests(self) -> Requests:
        """Waiting and running requests by id, each with what it has generated (``output``)."""
        return Requests(self.seqs, self.log)

    @property
    def scheduled(self) -> tuple[Scheduled, ...]:
        """The last plan's entries until its on_output: decodes, then prefill chunks, then diffusion runs."""
        kv = self.kv
        out: list[Scheduled] = [("decode", rid, 1, kv.row_len[kv.requests[rid].slots[0]], True)
                                for rid in self.sched_decode]  # fmt: skip
        out += [("prefill", rid, q, target, samples) for rid, q, target, samples in self.sched_prefill]
        out += [("diffusion", rid, 0, 0, False) for rid in self.sched_diffusion]
        return tuple(out)


class Requests(Mapping[RequestId, SeqRequest]):
    """``SchedState.requests``: a read-only view that puts each request's output back in its record."""

    __slots__ = ("seqs", "log")

    def __init__(self, seqs: Map[RequestId, SeqRequest], log: TokenLog) -> None:
        self.seqs = seqs
        self.log = log

    def __getitem__(self, rid: RequestId) -> SeqRequest:
        seq = self.seqs[rid]
        return SeqRequest(seq.request_id, seq.prompt, seq.max_tokens, seq.rows, seq.steps, seq.extra_keys,
                          self.log.tokens(rid), seq.arrival)  # fmt: skip

    def __contains__(self, rid: object) -> bool:
        try:
            return rid in self.seqs
        except TypeError:
            return False

    def __iter__(self) -> Iterator[RequestId]:
        return iter(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


def new_scheduler(cache: CacheConfig, config: SchedulerConfig = SchedulerConfig()) -> SchedState:
    return SchedState(config, initial_state(cache), pdeque(), (), frozenset(), Map(), TokenLog.empty(), Map(), (), (),
                      (), 0, 0)  # fmt: skip


def _err(code: ErrorCode, message: str, rid: RequestId | None = None) -> Failure[KVError]:
    return Failure(KVError(code, message, request=rid))


# -- inputs ------------------------------------------------------------------


def submit(state: SchedState, request: SeqRequest) -> Result[SchedState, KVError]:
    """An arrival: checked, then queued at the tail of the waiting queue."""
    if not isinstance(request, SeqRequest) or not is_request_id(request.request_id):
        return Failure(invalid("submit needs a SeqRequest with a string or integer id", field="request"))
    rid = request.request_id
    if request.rows is None:
        if not request.prompt or any(not is_int(t) or t < 0 for t in request.prompt):
            return Failure(invalid(f"request {rid!r}: prompt must be a non-empty list of token ids", request=rid,
                                   field="prompt"))  # fmt: skip
        if not is_int(request.max_tokens) or request.max_tokens < 1:
            return Failure(invalid(f"request {rid!r}: max_tokens must be a positive integer", request=rid,
                                   field="max_tokens"))  # fmt: skip
    elif not is_int(request.steps) or request.steps < 1:
        return Failure(invalid(f"request {rid!r}: steps must be a positive integer", request=rid, field="steps"))
    err = check_request_spec(replace(request, output=()).spec())
    if err is not None:
        return Failure(err)
    if rid in state.seqs:
        return _err(ErrorCode.DUPLICATE_REQUEST, f"request {rid!r} is already waiting or running", rid)
    req = replace(request, output=(), arrival=state.arrivals)
    log = state.log.edit()
    log.add(rid)
    return Success(replace(state, waiting=state.waiting.append(rid), seqs=state.seqs.set(rid, req),
                           log=log.persistent(), finished=_discard(state.finished, rid),
                           arrivals=state.arrivals + 1))  # fmt: skip


def _discard(m: Map[RequestId, str], rid: RequestId) -> Map[RequestId, str]:
    return m.delete(rid) if rid in m else m


def cancel(state: SchedState, request_id: RequestId, reason: str = "cancelled") -> Result[SchedState, KVError]:
    """End a waiting or running request (``reason``: cancelled or error); its blocks go back."""
    if not isinstance(reason, str) or reason not in ("cancelled", "error"):
        return Failure(invalid(f"cancel reason must be cancelled or error, got {reason!r}", field="reason"))
    if not is_request_id(request_id) or request_id not in state.seqs:
        return _err(ErrorCode.UNKNOWN_REQUEST, f"request {request_id!r} is not waiting or running", None)
    kv = state.kv
    if request_id in kv.requests:
        kv = release(kv, request_id, reason).unwrap().state
    log = state.log.edit()
    log.drop(request_id)
    return Success(replace(
        state, kv=kv, waiting=_without(state.waiting, request_id),
        running=tuple(r for r in state.running if r != request_id), prefilling=state.prefilling - {request_id},
        seqs=state.seqs.delete(request_id), log=log.persistent(), finished=state.finished.set(request_id, reason),
        sched_decode=tuple(r for r in state.sched_decode if r != request_id),
        sched_prefill=tuple(p for p in state.sched_prefill if p[0] != request_id),
        sched_diffusion=tuple(r for r in state.sched_diffusion if r != request_id),
    ))  # fmt: skip


def _without(q: PDeque[RequestId], rid: RequestId) -> PDeque[RequestId]:
    return q.remove(rid) if rid in q else q


# -- schedule ------------------------------------------------------------------


def schedule(state: SchedState) -> Result[tuple[SchedState, StepPlan], KVError]:
    """Plan the next step (see the module docstring). Refused while the last plan awaits its on_output."""
    if state.sched_decode or state.sched_prefill or state.sched_diffusion:
        return Failure(invalid(f"step {state.step} has not had its on_output yet", field="op"))
    cfg = state.config
    kv = state.kv
    budget = cfg.max_num_batched_tokens
    running = list(state.running)
    waiting = state.waiting
    seqs = state.seqs
    log = state.log
    log_edit: TokenLogEdit | None = None  # opened only when a request ends here
    finished = state.finished
    decode: list[RequestId] = []
    prefill: list[tuple[RequestId, int]] = []
    preempted: list[RequestId] = []
    ended: list[tuple[RequestId, str]] = []
    prefilling = state.prefilling

    def preempt(victim: RequestId) -> None:
        nonlocal kv, waiting, prefilling
        kv = release(kv, victim, "preempted").unwrap().state
        prefilling = prefilling - {victim}
        running.remove(victim)
        waiting = waiting.appendleft(victim)
        preempted.append(victim)
        if victim in decode:
            decode.remove(victim)

    # 1. decodes, oldest first: one token each (its last sampled id). The whole batch as one
    # transition when it fits; request by request (preempting as needed) when it does not.
    candidates = [rid for rid in running if rid not in prefilling][:budget] if prefilling else running[:budget]
    batch = append_decode(kv, candidates, log.last_many(candidates))
    if isinstance(batch, Success):
        kv = batch.unwrap().state
        decode.extend(candidates)
        budget -= len(candidates)
        candidates = []
    for rid in candidates:
        if rid not in running or budget < 1:
            continue
        token = log.last(rid)
        while True:
            grown = append(kv, rid, [[token]])
            if isinstance(grown, Success):
                kv = grown.unwrap().state
                decode.append(rid)
                budget -= 1
                break
            err = grown.failure()
            if err.code is not ErrorCode.NO_CAPACITY:  # max_model_len reached: it cannot go on
                kv = release(kv, rid, "error").unwrap().state
                running.remove(rid)
                seqs = seqs.delete(rid)
                log_edit = log_edit or log.edit()
                log_edit.drop(rid)
                finished = finished.set(rid, err.code.value)
                ended.append((rid, err.code.value))
                break
            victim = running[-1]
            preempt(victim)
            if victim == rid:
                break
    # 2. chunked prefills of running requests
    for rid in running if prefilling else ():
        if rid in prefilling and budget > 0:
            slot = kv.requests[rid].slots[0]
            remaining = kv.row_len[slot] - kv.row_computed[slot]
            q = min(remaining, budget) if cfg.chunked_prefill else (remaining if remaining <= budget else 0)
            if q:
                prefill.append((rid, q))
                budget -= q
    # 3. admissions from the head of the waiting queue
    diffusion: list[DiffusionRun] = []
    skipped: list[RequestId] = []
    while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
        rid = waiting.left
        req = seqs[rid]
        output = (log if log_edit is None else log_edit).tokens(rid) if req.rows is None else ()
        admitted = admit(kv, replace(req, output=output).spec() if output else req.spec())
        nothing_yet = not (decode or prefill or diffusion)
        if isinstance(admitted, Failure):
            err = admitted.failure()
            if err.code is ErrorCode.NO_CAPACITY:
                if not cfg.allow_overtaking:
                    break
                skipped.append(rid)
                waiting = waiting.popleft()
                continue
            waiting = waiting.popleft()
            seqs = seqs.delete(rid)
            log_edit = log_edit or log.edit()
            log_edit.drop(rid)
            finished = finished.set(rid, err.code.value)
            ended.append((rid, err.code.value))
            continue
        step = admitted.unwrap()
        if step.state.free_blocks < cfg.watermark_blocks and (running or not nothing_yet):
            if not cfg.allow_overtaking:
                break  # keep the watermark for decode growth; admit once blocks come back
            skipped.append(rid)
            waiting = waiting.popleft()
            continue
        cached = step.effect.cached_tokens[0]
        if req.is_diffusion:
            tokens = sum(r.num_tokens - c for r, c in zip(req.rows or (), step.effect.cached_tokens))
            if tokens > budget and not nothing_yet:
                break  # a diffusion request's first step runs whole; wait for an emptier step
            kv = step.state
            first = publish(kv, [rid], "prefill").unwrap().effect
            later = publish(kv, [rid], "denoise").unwrap().effect if req.steps > 1 else None
            diffusion.append(DiffusionRun(rid, req.steps, first, later))
            budget -= tokens
        else:
            remaining = len(req.prompt) + len(output) - cached
            q = min(remaining, budget) if cfg.chunked_prefill else remaining
            if q > budget and not nothing_yet:
                break
            kv = step.state
            running.append(rid)
            prefilling = prefilling | {rid}
            prefill.append((rid, q))
            budget -= q
        waiting = waiting.popleft()
    for rid in reversed(skipped):
        waiting = waiting.appendleft(rid)
    metadata: list[KVMetadata] = []
    if prefill:
        limits = dict(prefill)
        metadata.append(publish(kv, [r for r, _ in prefill], "prefill", query_limits=limits).unwrap().effect)
    if decode:
        metadata.append(publish(kv, decode, "decode").unwrap().effect)
    chunks: list[Prefilled] = []
    for rid, q in prefill:
        slot = kv.requests[rid].slots[0]
        target = kv.row_computed[slot] + q
        chunks.append((rid, q, target, target == kv.row_len[slot]))
    samples = tuple(decode) + tuple(rid for rid, _, _, last in chunks if last)
    plan = StepPlan(state.step, tuple(decode), tuple(prefill), tuple(diffusion), tuple(preempted), tuple(ended),
                    tuple(metadata), samples)  # fmt: skip
    new = SchedState(cfg, kv, waiting, tuple(running), prefilling, seqs, log if log_edit is None else log_edit.persistent(),
                     finished, tuple(decode), tuple(chunks), tuple(d.request_id for d in diffusion), state.step + 1,
                     state.arrivals)  # fmt: skip
    return Success((new, plan))


# -- outputs -----------------------------------------------------------------


def on_output(
    state: SchedState, sampled: Mapping[RequestId, int], finished: Iterable[RequestId] = ()
) -> Result[tuple[SchedState, tuple[tuple[RequestId, str], ...]], KVError]:
    """The step's results: commit what was computed, append sampled tokens, release what ended.

    ``sampled`` holds one token per request whose forward produced one (a decode,
    or a prefill that finished its prompt); ``finished`` names requests the engine
    ends (EOS, a stop string). ``max_tokens`` ends the others. All is checked
    before anything is applied.
    """
    stop = set(finished)
    kv = state.kv
    decode, chunks, runs = state.sched_decode, state.sched_prefill, state.sched_diffusion
    get = sampled.get
    toks: list[Any] = [get(rid) for rid in decode]  # checked at C speed; the loop below names a bad one
    ok = are_token_ids(toks)
    for rid in (*(() if ok else decode), *(c[0] for c in chunks if c[3])):
        tok = get(rid)
        if not is_token_id(tok):
            return Failure(invalid(f"request {rid!r} computed its last token this step; on_output needs its "
                                   f"sampled token id, got {tok!r}", request=rid, field="sampled"))  # fmt: skip
    # the step's commits: the decode batch in one transition, the prefill chunks and diffusion runs in another
    if decode:
        kv = commit_decode(kv, decode).unwrap().state
    if chunks or runs:
        commits = [(rid, [target]) for rid, _, target, _ in chunks]
        commits += [(rid, [kv.row_len[x] for x in kv.requests[rid].slots]) for rid in runs]
        kv = commit_many(kv, commits).unwrap().state
    log = state.log.edit()
    seqs = state.seqs
    ending: list[RequestId] = []
    prefilling = state.prefilling
    counts = log.append_many(decode, toks)
    limit = seqs.__getitem__
    for rid, n in zip(decode, counts):
        if n >= limit(rid).max_tokens or rid in stop:
            ending.append(rid)
    for rid, _, _, samples in chunks:
        if samples:
            prefilling = prefilling - {rid}
            log.append(rid, sampled[rid])
            if rid in stop or log.count(rid) >= seqs[rid].max_tokens:
                ending.append(rid)
    ending.extend(runs)
    done = state.finished
    if ending:
        kv = release_many(kv, ending, "finished").unwrap().state
        for rid in ending:
            seqs = seqs.delete(rid)
            log.drop(rid)
            done = done.set(rid, "finished")
    gone = set(ending)
    running = tuple(r for r in state.running if r not in gone) if gone else state.running
    ended = tuple((rid, "finished") for rid in ending)
    new = SchedState(state.config, kv, state.waiting, running, prefilling, seqs, log.persistent(), done, (), (), (),
                     state.step, state.arrivals)  # fmt: skip
    return Success((new, ended))


# -- digest ------------------------------------------------------------------


def sched_canonical(state: SchedState) -> tuple[Any, ...]:
    order = sorted(state.requests.keys(), key=lambda r: (type(r).__name__, r))
    reqs = tuple((type(r).__name__, r, _req_key(state.requests[r])) for r in order)
    fin = tuple(sorted(((type(r).__name__, r, how) for r, how in state.finished.items())))
    return ("pagedkv-scheduler/1", state.config.max_num_seqs, state.config.max_num_batched_tokens,
            state.config.chunked_prefill, state.config.watermark_blocks, state.config.allow_overtaking,
            canonical(state.kv), tuple(state.waiting), state.running, tuple(sorted(state.prefilling, key=str)), reqs,
            fin, state.scheduled, state.step,
            state.arrivals)  # fmt: skip


def _req_key(r: SeqRequest) -> tuple[Any, ...]:
    rows = None if r.rows is None else tuple(
        (x.num_tokens, x.tokens, x.prefix_len, x.target_len, x.spans) for x in r.rows)  # fmt: skip
    return (r.prompt, r.max_tokens, rows, r.steps, r.extra_keys, r.output, r.arrival)


def sched_digest(state: SchedState) -> str:
    return hashlib.blake2b(repr(sched_canonical(state)).encode(), digest_size=16).hexdigest()
