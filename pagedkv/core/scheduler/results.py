"""The results of a step: what the forward computed is committed, sampled tokens are kept,
what ended is released."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from returns.result import Failure, Result, Success

from pagedkv.core.commit import commit_many
from pagedkv.core.decode import commit_decode
from pagedkv.core.effects import events_of
from pagedkv.core.errors import KVError, RequestId, are_token_ids, invalid, is_token_id, shown
from pagedkv.core.events import KVEvent
from pagedkv.core.release import release_many
from pagedkv.core.scheduler.lifecycle import Event, FinishReason, advance, moved
from pagedkv.core.scheduler.records import SchedState
from pagedkv.core.state import KVState


def on_output(
    state: SchedState, sampled: Mapping[RequestId, int], finished: Iterable[RequestId] = ()
) -> Result[tuple[SchedState, tuple[tuple[RequestId, FinishReason], ...]], KVError]:
    """The step's results: commit what was computed, append sampled tokens, release what ended.

    ``sampled`` holds one token per request whose forward produced one (a decode,
    or a prefill that finished its prompt); ``finished`` names requests the engine
    ends (EOS, a stop string). ``max_tokens`` ends the others. All is checked
    before anything is applied.
    """
    toks: list[Any] = [sampled.get(rid) for rid in state.sched_decode]  # checked at C speed; a bad one named below
    err = _check_sampled(state, sampled, are_token_ids(toks))
    if err is not None:
        return Failure(err)
    events: list[KVEvent] = []
    kv = _commit(state, events)
    stop = set(finished)
    decode, chunks, runs = state.sched_decode, state.sched_prefill, state.sched_diffusion
    log, seqs, stages = state.log.edit(), state.seqs, state.stages.mutate()
    ending: list[RequestId] = []
    limit = seqs.__getitem__
    for rid, n in zip(decode, log.append_many(decode, toks)):
        if n >= limit(rid).max_tokens or rid in stop:
            ending.append(rid)
    for rid, _, _, samples in chunks:
        if samples:  # its prompt is computed: it decodes from now on
            stages[rid] = moved(stages[rid], Event.PREFILLED)
            log.append(rid, sampled[rid])
            if rid in stop or log.count(rid) >= seqs[rid].max_tokens:
                ending.append(rid)
    ending.extend(runs)
    done = state.finished
    if ending:
        released = release_many(kv, ending, "finished").unwrap()
        kv = released.state
        events.extend(events_of(released.effect))
        for rid in ending:
            advance(stages[rid], Event.FINISH)
            del stages[rid]
            seqs = seqs.delete(rid)
            log.drop(rid)
            done = done.set(rid, FinishReason.FINISHED)
    gone = set(ending)
    running = tuple(r for r in state.running if r not in gone) if gone else state.running
    new = SchedState(state.config, kv, state.waiting, running, stages.finish(), seqs, log.persistent(), done, (), (),
                     (), state.step, state.arrivals, tuple(events))  # fmt: skip
    return Success((new, tuple((rid, FinishReason.FINISHED) for rid in ending)))


def _check_sampled(state: SchedState, sampled: Mapping[RequestId, int], decodes_ok: bool) -> KVError | None:
    """Every request whose forward yields a token has a token id."""
    chunk_ids = (c.request_id for c in state.sched_prefill if c.samples)
    for rid in (*(() if decodes_ok else state.sched_decode), *chunk_ids):
        tok = sampled.get(rid)
        if not is_token_id(tok):
            return invalid(f"request {shown(rid)} computed its last token this step; on_output needs its "
                           f"sampled token id, got {shown(tok)}", request=rid, field="sampled")  # fmt: skip
    return None


def _commit(state: SchedState, events: list[KVEvent]) -> KVState:
    """The step's commits: the decode batch in one transition, the prefill chunks and diffusion runs in another;
    their KV events go on ``events``."""
    kv = state.kv
    if state.sched_decode:
        step = commit_decode(kv, state.sched_decode).unwrap()
        kv = step.state
        events.extend(events_of(step.effect))
    if state.sched_prefill or state.sched_diffusion:
        commits = [(c.request_id, [c.target]) for c in state.sched_prefill]
        commits += [(rid, [kv.row_len[x] for x in kv.requests[rid].slots]) for rid in state.sched_diffusion]
        many = commit_many(kv, commits).unwrap()
        kv = many.state
        events.extend(events_of(many.effect))
    return kv
