"""The policy of one step: who runs, how many tokens each computes, whom to preempt.

``schedule(state) -> (state', StepPlan)``: decodes first (oldest first), then
chunked prefills of running requests, then new admissions from the head of the
waiting queue while the token budget, ``max_num_seqs`` and the blocks allow. A
request refused with ``NO_CAPACITY`` waits at the head (nobody overtakes it
unless ``allow_overtaking``); a permanent refusal ends it with that code.

Decode growth that hits ``NO_CAPACITY`` preempts by recompute: the newest running
request is released (``preempted``) and goes back to the front of the waiting
queue; it is admitted again with its prompt and the tokens it generated, so its
output continues unchanged (the prefix cache makes that cheap), a chunk's blocks at a
time where the whole sequence no longer fits the pool at once (a window group let blocks
go as it ran: it is readmitted as it ran).

Diffusion requests run at request level: one admission, every denoising step in
one plan entry (metadata for the first step and for the later ones), released
by the next ``on_output``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from returns.result import Failure, Result, Success

from pagedkv.core.rules.admission import admit
from pagedkv.core.rules.commit import cache_ahead
from pagedkv.core.errors import ErrorCode, InvariantError, KVError, RequestId, invalid
from pagedkv.core.outputs.metadata import KVMetadata
from pagedkv.core.rules.prefix import find_hit
from pagedkv.core.scheduler.decodes import admission_refusal, decodes, drafts_problem, grow
from pagedkv.core.scheduler.lifecycle import Move
from pagedkv.core.scheduler.planning import Planning
from pagedkv.core.scheduler.records import DiffusionRun, Prefilled, SchedState, StepPlan
from pagedkv.core.outputs.snapshot import publish
from pagedkv.core.spec import RequestSpec, RowSpec


def schedule(
    state: SchedState, drafts: Mapping[RequestId, Sequence[int]] | None = None
) -> Result[tuple[SchedState, StepPlan], KVError]:
    """Plan the next step (see the module docstring). Refused while the last plan awaits its on_output.

    ``drafts``: speculative decoding, draft token ids proposed for decoding requests (n-gram lookup, a draft
    model). A decoding request with drafts grows by its last sampled token and them, as many as fit its
    budget, ``max_tokens`` and the length limit (``StepPlan.verify``); the forward checks them and
    ``on_output`` takes what it accepted. Drafts of a request that does not decode this step are dropped."""
    if state.pending_output:
        return Failure(invalid(f"step {state.step} has not had its on_output yet", field="op"))
    if drafts:
        bad = drafts_problem(drafts)
        if bad is not None:
            return Failure(bad)
    d = Planning(state)
    decodes(d, drafts or None)
    _prefill_chunks(d)
    _admissions(d)
    return Success(_plan(d))


def _prefill_chunks(d: Planning) -> None:
    """Chunked prefills of running requests, in admission order, while the budget lasts."""
    cfg, prefilling = d.state.config, d.prefilling
    for rid in d.running if prefilling else ():
        if d.budget <= 0:
            return
        if rid in prefilling and rid in d.running:  # (a chunk's growth may have preempted it)
            slot = d.kv.requests[rid].slots[0]
            computed, length = d.kv.row_computed[slot], d.kv.row_len[slot]
            total = _sequence_len(d, rid)
            grows = cfg.grow_prefill or length < total  # (or a preempted request readmitted a chunk at a time)
            remaining = total - computed
            q = (
                min(remaining, d.budget, cfg.chunk_cap)
                if cfg.chunked_prefill
                else (remaining if remaining <= d.budget else 0)
            )
            kv_cfg = d.kv.config
            if q and grows:  # (a row near the pool's size: chunks its windows hold at once)
                q = max(1, kv_cfg.growing_chunk(total, q))
            bs = kv_cfg.block_size
            if kv_cfg.stops_at_block_end and computed % bs:  # (an align-mode state group: vLLM's aligned split)
                q = min(q, bs - computed % bs)
            if q and grows and not _grow_chunk(d, rid, computed + q):
                continue  # preempted itself: it waits, its blocks back
            if q:
                d.prefill.append((rid, q))
                d.budget -= q
                _cache_ahead(d, rid, computed + q)


def _sequence_len(d: Planning, rid: RequestId) -> int:
    """What an LLM request computes before it decodes: its prompt and what it generated before a preemption."""
    return len(d.seqs[rid].prompt) + len(d.output(rid))


def _grow_chunk(d: Planning, rid: RequestId, end: int) -> bool:
    """``grow_prefill``: the row holds tokens up to ``end`` (its next chunk's blocks), preempting the newest
    running request while the blocks are short; False when ``rid`` itself was the one preempted."""
    slot = d.kv.requests[rid].slots[0]
    length = d.kv.row_len[slot]
    if end <= length:
        return True
    req = d.seqs[rid]
    grown = grow(d, rid, list((req.prompt + d.output(rid))[length:end]))
    if isinstance(grown, KVError):  # (admission checked the whole sequence)
        raise InvariantError(f"a prefill chunk's growth was refused: {grown.message}")
    return grown


def _admissions(d: Planning) -> None:
    """Admissions from the head of the waiting queue while budget, seats and blocks allow."""
    cfg = d.state.config
    skipped: list[RequestId] = []
    while d.waiting and d.budget > 0 and len(d.running) < cfg.max_num_seqs:
        rid = d.waiting.left
        taken = _admit_head(d, rid)
        if taken == "stop":
            break
        d.waiting = d.waiting.popleft()
        if taken == "skip":
            skipped.append(rid)
    for rid in reversed(skipped):
        d.waiting = d.waiting.appendleft(rid)


def _admit_head(d: Planning, rid: RequestId) -> str:
    """Try the head of the waiting queue: "stop" (it waits, and so do those behind it), "skip" (it
    waits; later ones may overtake it), or "done" (admitted, or ended by a permanent refusal)."""
    cfg = d.state.config
    if rid in d.awaiting:  # preempted before its last id came back: it waits for it
        return "skip" if cfg.allow_overtaking else "stop"
    req = d.seqs[rid]
    output = d.output(rid) if req.rows is None else ()
    spec = replace(req, output=output).spec() if output else req.spec()
    if cfg.grow_prefill and req.rows is None:
        never = admission_refusal(d, d.kv, spec)
        if never is not None:
            d.end(rid, Move.REFUSE, never)
            return "done"
        spec = _first_chunk(d, spec)
    nothing_yet = not (d.decode or d.prefill or d.diffusion)
    keep = cfg.watermark_blocks if d.running or not nothing_yet else 0  # the watermark, for decode growth
    admitted = admit(d.kv, spec, reserve=keep, checked=True)  # (its form checked when it arrived: submit)
    if isinstance(admitted, Failure) and admitted.failure().code is ErrorCode.UNSCHEDULABLE and spec.max_hit != 0:
        # a hit can make a request need more blocks than the pool has (an align-mode state group's block taken over
        # beside its own): served without it, as it would be alone, rather than ended
        admitted = admit(d.kv, replace(spec, max_hit=0), reserve=keep, checked=True)
    if isinstance(admitted, Failure) and admitted.failure().code is ErrorCode.UNSCHEDULABLE and output:
        # a preempted request whose whole sequence no longer fits at once (a window group's blocks freed as it ran):
        # readmitted as it ran, a chunk at a time (``readmission_refusal`` let it be preempted only so)
        spec = _first_chunk(d, spec)
        admitted = admit(d.kv, spec, reserve=keep, checked=True)
    if isinstance(admitted, Failure):
        err = admitted.failure()
        if err.code is ErrorCode.NO_CAPACITY:
            return "skip" if cfg.allow_overtaking else "stop"
        d.end(rid, Move.REFUSE, err)
        return "done"
    step = admitted.unwrap()
    cached = step.effect.cached_tokens[0]
    if req.is_diffusion:
        tokens = sum(r.num_tokens - c for r, c in zip(req.rows or (), step.effect.cached_tokens))
        if tokens > d.budget and not nothing_yet:
            return "stop"  # a diffusion request's first step runs whole; wait for an emptier step
        d.apply(step)
        first = publish(d.kv, [rid], "prefill").unwrap().effect
        later = publish(d.kv, [rid], "denoise").unwrap().effect if req.steps > 1 else None
        d.diffusion.append(DiffusionRun(rid, req.steps, first, later))
        d.move(rid, Move.ADMIT_DIFFUSION)
        d.budget -= tokens
        return "done"
    remaining = spec.rows[0].num_tokens - cached  # (its first chunk's, where it grows a chunk at a time)
    q = min(remaining, d.budget, cfg.chunk_cap) if cfg.chunked_prefill else remaining
    if q > d.budget and not nothing_yet:
        return "stop"
    d.apply(step)
    d.running.append(rid)
    d.move(rid, Move.ADMIT)
    d.prefill.append((rid, q))
    d.budget -= q
    _cache_ahead(d, rid, cached + q)
    return "done"


def _first_chunk(d: Planning, spec: RequestSpec) -> RequestSpec:
    """An LLM request admitted a chunk at a time: ``spec`` with only its hit and first chunk's tokens (a row near
    the pool's size takes a smaller chunk); the later chunks' blocks grow as they are planned."""
    cfg, kv_cfg = d.state.config, d.kv.config
    row = spec.rows[0]
    total = row.num_tokens
    hit = find_hit(d.kv, spec).num_blocks * kv_cfg.block_size
    chunk = min(total - hit, d.budget, cfg.chunk_cap) if cfg.chunked_prefill else total - hit
    held = hit + max(kv_cfg.growing_chunk(total, chunk), 1)
    return replace(spec, rows=(RowSpec.of_tokens(row.tokens[:held]),))  # type: ignore[index]


def _cache_ahead(d: Planning, rid: RequestId, through: int) -> None:
    """Under vLLM's caching point, a planned prefill chunk's full blocks are cached now: a request admitted
    after it in this step can hit them (the one prefill forward writes them before any row reads them)."""
    if d.kv.config.caching_point == "schedule":
        given = d.seqs[rid].block_hashes or None  # (the prompt's, computed at submit)
        d.apply(cache_ahead(d.kv, rid, [through], hashes=given).unwrap())


def _plan(d: Planning) -> tuple[SchedState, StepPlan]:
    """The step's metadata (prefill rows' snapshot, then decode rows'), its plan, the next state."""
    state, kv = d.state, d.kv
    metadata: list[KVMetadata] = []
    if d.prefill or d.verify:  # one varlen forward: prefill chunks, rows verifying drafts (and with them the decodes)
        limits = dict(d.prefill)
        limits.update((rid, 1 + len(draft)) for rid, draft in d.verify)
        limits.update((rid, 1) for rid in (d.decode if d.verify else ()))
        metadata.append(publish(kv, list(limits), "prefill", query_limits=limits).unwrap().effect)
    if d.decode and not d.verify:
        metadata.append(publish(kv, d.decode, "decode").unwrap().effect)
    chunks: list[Prefilled] = []
    for rid, q in d.prefill:
        slot = kv.requests[rid].slots[0]
        target = kv.row_computed[slot] + q
        total = _sequence_len(d, rid)
        chunks.append(Prefilled(rid, q, target, target == total))
    samples = tuple(d.decode) + tuple(c.request_id for c in chunks if c.samples) + tuple(r for r, _ in d.verify)
    plan = StepPlan(
        state.step,
        tuple(d.decode),
        tuple(d.prefill),
        tuple(d.diffusion),
        tuple(d.preempted),
        tuple(d.ended),
        tuple(metadata),
        samples,
        tuple(d.refusals),
        tuple(d.verify),
    )
    log = d.log if d.log_edit is None else d.log_edit.persistent()
    new = SchedState(
        state.config,
        kv,
        d.waiting,
        tuple(d.running),
        d.stages.finish(),
        d.seqs,
        log,
        tuple(d.decode),
        tuple(chunks),
        tuple(r.request_id for r in d.diffusion),
        state.step + 1,
        state.arrivals,
        tuple(d.events),
        tuple(d.verify),
        d.awaiting,
    )
    return new, plan
