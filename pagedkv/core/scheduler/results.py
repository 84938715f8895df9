"""The results of a step: what the forward computed is committed, sampled tokens are kept,
what ended is released."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from returns.result import Failure, Result, Success

from pagedkv.core.ahead import truncate_many
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

    A decode that verified drafts (``StepPlan.verify``) gives a list: the drafts the forward
    accepted, in order, then the token it sampled after them (1 to len(drafts) + 1 ids; an engine
    that ends the request on one of them may give fewer). Its row is cut back past the accepted
    ones (the rejected drafts' blocks go back) and computed through them.
    """
    toks: list[Any] = [sampled.get(rid) for rid in state.sched_decode]  # checked at C speed; a bad one named below
    err = _check_sampled(state, sampled, are_token_ids(toks))
    if err is not None:
        return Failure(err)
    verified = _verified(state, sampled)
    if isinstance(verified, KVError):
        return Failure(verified)
    events: list[KVEvent] = []
    kv = _commit(state, events, verified)
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
    for rid, got in verified.items():
        for tok in got:
            log.append(rid, tok)
        if log.count(rid) >= limit(rid).max_tokens or rid in stop:
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


def _verified(state: SchedState, sampled: Mapping[RequestId, Any]) -> dict[RequestId, tuple[int, ...]] | KVError:
    """Each verifying decode's ids: the drafts it accepted (a prefix of them), then its sampled token."""
    out: dict[RequestId, tuple[int, ...]] = {}
    for rid, draft in state.sched_verify:
        got = sampled.get(rid)
        got = (got,) if type(got) is int else got
        if (not isinstance(got, (list, tuple)) or not 1 <= len(got) <= len(draft) + 1 or not are_token_ids(got)
                or tuple(got[:-1]) != draft[: len(got) - 1]):  # fmt: skip
            return invalid(f"request {shown(rid)} verified {len(draft)} drafts {shown(list(draft)):.80}; on_output "
                           f"needs the drafts it accepted, in order, then its sampled token id, got {shown(got):.80}",
                           request=rid, field="sampled")  # fmt: skip
        out[rid] = tuple(got)
    return out


def _commit(state: SchedState, events: list[KVEvent], verified: Mapping[RequestId, tuple[int, ...]]) -> KVState:
    """The step's commits: the decode batch in one transition; the rejected drafts cut off in another; the
    prefill chunks, diffusion runs and verified rows in a third; their KV events go on ``events``."""
    kv = state.kv
    if state.sched_decode:
        step = commit_decode(kv, state.sched_decode).unwrap()
        kv = step.state
        events.extend(events_of(step.effect))
    # a verifying row holds its last token and every draft: it keeps the last token and the accepted ones
    kept = {rid: kv.row_len[kv.requests[rid].slots[0]] - len(draft) + len(verified[rid]) - 1
            for rid, draft in state.sched_verify}  # fmt: skip
    cuts = [(rid, [n]) for rid, n in kept.items() if n < kv.row_len[kv.requests[rid].slots[0]]]
    if cuts:
        cut = truncate_many(kv, cuts).unwrap()
        kv = cut.state
        events.extend(events_of(cut.effect))
    if state.sched_prefill or state.sched_diffusion or kept:
        commits = [(c.request_id, [c.target]) for c in state.sched_prefill]
        commits += [(rid, [kv.row_len[x] for x in kv.requests[rid].slots]) for rid in state.sched_diffusion]
        commits += [(rid, [n]) for rid, n in kept.items()]
        many = commit_many(kv, commits).unwrap()
        kv = many.state
        events.extend(events_of(many.effect))
    return kv
