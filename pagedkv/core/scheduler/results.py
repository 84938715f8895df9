"""The results of a step: what the forward computed is committed, sampled tokens are kept,
what ended is released."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, cast

from returns.result import Failure, Result, Success

from pagedkv.core.rules.commit import commit_many
from pagedkv.core.rules.decode import commit_decode
from pagedkv.core.outputs.effects import events_of
from pagedkv.core.errors import (
    KVError,
    RequestId,
    are_token_ids,
    invalid,
    is_request_id,
    is_token_id,
    ordered_ids,
    shown,
)
from pagedkv.core.outputs.events import KVEvent
from pagedkv.core.rules.placeholders import fill_many, truncate_many
from pagedkv.core.rules.release import release_many
from pagedkv.core.scheduler.inputs import ended
from pagedkv.core.scheduler.lifecycle import FinishReason, Move, advance, moved
from pagedkv.core.scheduler.records import SchedState
from pagedkv.core.store.state import KVState


def on_output(
    state: SchedState, sampled: Mapping[RequestId, Any], finished: Iterable[RequestId] = ()
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

    Ahead of the ids (overlapped scheduling): a token given as ``None`` is one the forward sampled whose id
    is not known yet. It counts toward ``max_tokens``, the request's next decode grows by a placeholder,
    and ``on_tokens`` gives the id before anything reads it (a request whose last id is still awaited
    cannot be given ``None`` again, nor verify drafts).
    """
    if not isinstance(sampled, Mapping) or not _is_collection(finished):
        return Failure(_bad_arguments("on_output", sampled, finished))
    toks: list[Any] = [sampled.get(rid) for rid in state.sched_decode]  # checked at C speed; a bad one named below
    fast = are_token_ids(toks)  # (a None among the decodes fails it; the last prefill chunks are few)
    ahead = (
        frozenset()
        if fast and all(sampled.get(c.request_id) is not None for c in state.sched_prefill if c.samples)
        else frozenset(rid for rid, v in sampled.items() if v is None)
    )
    err = _check_sampled(state, sampled, fast, ahead) or _outside_plan(state, sampled, finished)
    if err is not None:
        return Failure(err)
    if ahead:
        toks = [0 if t is None else t for t in toks]  # (a placeholder in the log until on_tokens)
    verified = _verified(state, sampled)
    if isinstance(verified, KVError):
        return Failure(verified)
    events: list[KVEvent] = []
    kv = _commit(state, events, verified)
    log, seqs, stages = state.log.edit(), state.seqs, state.stages.mutate()
    ending = _logged(state, sampled, toks, verified, set(finished), log, stages)
    if ending:
        released = release_many(kv, ending, "finished").unwrap()
        kv = released.state
        events.extend(events_of(released.effect))
        for rid in ending:
            advance(stages[rid], Move.FINISH)
            del stages[rid]
            seqs = seqs.delete(rid)
            log.drop(rid)
    gone = set(ending)
    running = tuple(r for r in state.running if r not in gone) if gone else state.running
    awaiting = (state.awaiting | ahead) - gone if ahead or state.awaiting else state.awaiting
    new = SchedState(
        state.config,
        kv,
        state.waiting,
        running,
        stages.finish(),
        seqs,
        log.persistent(),
        (),
        (),
        (),
        state.step,
        state.arrivals,
        tuple(events),
        (),
        awaiting,
    )
    return Success((new, tuple((rid, FinishReason.FINISHED) for rid in ending)))


def _logged(
    state: SchedState,
    sampled: Mapping[RequestId, Any],
    toks: list[Any],
    verified: Mapping[RequestId, tuple[int, ...]],
    stop: set[RequestId],
    log: Any,
    stages: Any,
) -> list[RequestId]:
    """The step's tokens into the log (decodes, last prefill chunks, verifying decodes; a prefilled request
    moves to decoding); the requests that end: a stop the engine named, ``max_tokens``, a diffusion run."""
    decode, limit = state.sched_decode, state.seqs.__getitem__
    ending: list[RequestId] = []
    for rid, n in zip(decode, log.append_many(decode, toks)):
        if n >= limit(rid).max_tokens or rid in stop:
            ending.append(rid)
    for rid, _, _, samples in state.sched_prefill:
        if samples:  # its prompt is computed: it decodes from now on
            stages[rid] = moved(stages[rid], Move.PREFILLED)
            log.append(rid, sampled[rid] or 0)
            if rid in stop or log.count(rid) >= limit(rid).max_tokens:
                ending.append(rid)
    for rid, got in verified.items():
        for tok in got:
            log.append(rid, tok)
        if log.count(rid) >= limit(rid).max_tokens or rid in stop:
            ending.append(rid)
    return ending + list(state.sched_diffusion)


def _check_sampled(
    state: SchedState, sampled: Mapping[RequestId, Any], decodes_ok: bool, ahead: frozenset[RequestId]
) -> KVError | None:
    """Every request whose forward yields a token has a token id, or ``None`` (its id comes with ``on_tokens``)."""
    chunk_ids = (c.request_id for c in state.sched_prefill if c.samples)
    for rid in (*(() if decodes_ok else state.sched_decode), *chunk_ids):
        tok = sampled.get(rid)
        if tok is None and rid in ahead and rid not in state.awaiting:
            continue
        if not is_token_id(tok):
            again = " (its last id is still awaited: on_tokens first)" if rid in state.awaiting and tok is None else ""
            return invalid(
                f"request {shown(rid)} computed its last token this step; on_output needs its "
                f"sampled token id{again}, got {shown(tok)}",
                request=rid,
                field="sampled",
            )
    return None


def _outside_plan(state: SchedState, sampled: Mapping[RequestId, Any], finished: Iterable[RequestId]) -> KVError | None:
    """A token, or an ending, for a request the last plan did not sample: refused (an engine that hands the
    scheduler tokens of the wrong requests has lost track of its batch). Every sampled request has a token once
    ``_check_sampled`` passed, so ``sampled`` holds no other when its size is theirs."""
    n = len(state.sched_decode) + len(state.sched_verify) + sum(1 for c in state.sched_prefill if c.samples)
    if len(sampled) == n and not finished:
        return None
    samples = {
        *state.sched_decode,
        *(rid for rid, _ in state.sched_verify),
        *(c.request_id for c in state.sched_prefill if c.samples),
    }
    for field, rids in (("sampled", sampled), ("finished", finished)):
        for rid in rids:
            if not is_request_id(rid) or rid not in samples:
                return invalid(
                    f"request {shown(rid)} computed no token in step {state.step - 1}; on_output takes "
                    f"{field} only for the requests the plan sampled",
                    field=field,
                )
    return None


def _is_collection(value: object) -> bool:
    """Request ids to end: a list, tuple or set (a str would be read as its characters)."""
    return type(value) in (list, tuple, set, frozenset)


def _bad_arguments(op: str, sampled: object, finished: object) -> KVError:
    if not isinstance(sampled, Mapping):
        return invalid(
            f"{op} needs sampled: a mapping of request id to token id, got {shown(sampled):.80}", field="sampled"
        )
    return invalid(f"{op} needs finished: a list of request ids, got {shown(finished):.80}", field="finished")


def _verified(state: SchedState, sampled: Mapping[RequestId, Any]) -> dict[RequestId, tuple[int, ...]] | KVError:
    """Each verifying decode's ids: the drafts it accepted (a prefix of them), then its sampled token."""
    out: dict[RequestId, tuple[int, ...]] = {}
    for rid, draft in state.sched_verify:
        got = sampled.get(rid)
        got = (got,) if type(got) is int else got
        if (
            not isinstance(got, (list, tuple))
            or not 1 <= len(got) <= len(draft) + 1
            or not are_token_ids(got)
            or tuple(got[:-1]) != draft[: len(got) - 1]
        ):
            return invalid(
                f"request {shown(rid)} verified {len(draft)} drafts {shown(list(draft)):.80}; on_output "
                f"needs the drafts it accepted, in order, then its sampled token id, got {shown(got):.80}",
                request=rid,
                field="sampled",
            )
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
    kept = {
        rid: kv.row_len[kv.requests[rid].slots[0]] - len(draft) + len(verified[rid]) - 1
        for rid, draft in state.sched_verify
    }
    cuts = [(rid, [n]) for rid, n in kept.items() if n < kv.row_len[kv.requests[rid].slots[0]]]
    if cuts:
        cut = truncate_many(kv, cuts).unwrap()
        kv = cut.state
        events.extend(events_of(cut.effect))
    if state.sched_prefill or state.sched_diffusion or kept:
        commits = [(c.request_id, [c.target]) for c in state.sched_prefill]
        commits += [(rid, [kv.row_len[x] for x in kv.requests[rid].slots]) for rid in state.sched_diffusion]
        commits += [(rid, [n]) for rid, n in kept.items()]
        seqs = state.seqs  # (the prompts' block hashes, computed at submit: never hashed again)
        given = {rid: seqs[rid].block_hashes for rid, _ in commits if seqs[rid].block_hashes}
        many = commit_many(kv, commits, hashes=given or None).unwrap()
        kv = many.state
        events.extend(events_of(many.effect))
    return kv


def on_tokens(
    state: SchedState, sampled: Mapping[RequestId, int], finished: Iterable[RequestId] = ()
) -> Result[tuple[SchedState, tuple[tuple[RequestId, FinishReason], ...]], KVError]:
    """The ids an earlier ``on_output`` gave as ``None`` (overlapped scheduling: the next step was planned and
    launched before they were read): each request still awaiting one takes it, in its log and in the row
    position its next decode grew by (a placeholder, now filled: blocks it completes can be cached).
    ``finished`` names requests the engine ends on them (a stop token or string): they end now, their blocks
    back, dropped from the plan in flight (its forward ran for them; the engine drops what it gave). Ids and
    endings of requests no longer live (one that reached ``max_tokens`` ended at its output) are ignored.
    All is checked before anything is applied; the state is as it was on a refusal."""
    if not isinstance(sampled, Mapping) or not _is_collection(finished):
        return Failure(_bad_arguments("on_tokens", sampled, finished))
    live = ordered_ids([rid for rid in state.awaiting if rid in state.seqs])
    for field, rids in (("sampled", sampled), ("finished", finished)):
        for rid in rids:  # a live request that awaits no id: not this output's (an ended one's are ignored)
            if not is_request_id(rid) or (rid in state.seqs and rid not in state.awaiting):
                return Failure(
                    invalid(
                        f"request {shown(rid)} awaits no token id; on_tokens takes {field} only for "
                        "the requests an earlier output gave as None",
                        field=field,
                    )
                )
    got = [sampled.get(rid) for rid in live]
    if not are_token_ids(got):  # (the first one that is not, named)
        rid = next(rid for rid, tok in zip(live, got) if not is_token_id(tok))
        return Failure(
            invalid(
                f"request {shown(rid)} awaits the id of its last token; on_tokens needs it, got "
                f"{shown(sampled.get(rid))}",
                request=rid,
                field="sampled",
            )
        )
    log, kv, tokens = state.log.edit(), state.kv, cast(list[int], got)
    log.set_last_many(live, tokens)
    admitted = kv.requests
    # each admitted one's row fills the position its next decode grew by (a row that did not grow, or keeps no ids,
    # takes nothing: ``awaiting_only``)
    fills = [(rid, [[tok]]) for rid, tok in zip(live, tokens) if rid in admitted]
    events: list[KVEvent] = []
    if fills:
        step = fill_many(kv, fills, awaiting_only=True).unwrap()
        kv = step.state
        events.extend(events_of(step.effect))
    new = replace(state, kv=kv, log=log.persistent(), awaiting=frozenset())
    ending = ordered_ids(list({rid for rid in finished if rid in state.seqs}))  # (one order)
    for rid in ending:
        new = ended(new, rid, "finished")
        events.extend(new.kv_events)
    return Success((replace(new, kv_events=tuple(events)), tuple((rid, FinishReason.FINISHED) for rid in ending)))
