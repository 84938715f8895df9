"""A step's decodes: each running request's next token, and the drafts it verifies (speculative decoding), as one
transition when the batch fits, else request by request, preempting the newest running request while blocks
are short (preemption by recompute: ``policy``'s module note)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from returns.result import Success

from pagedkv.core.rules.admission import growing_refusal, refusal
from pagedkv.core.errors import ErrorCode, KVError, RequestId, are_token_ids, invalid, is_request_id, shown
from pagedkv.core.rules.growth import Placeholders, append, append_decode, append_many
from pagedkv.core.rules.release import release
from pagedkv.core.scheduler.lifecycle import Move
from pagedkv.core.scheduler.planning import Planning
from pagedkv.core.spec import RequestSpec
from pagedkv.core.store.state import KVState, request_blocks


def drafts_problem(drafts: object) -> KVError | None:
    if not isinstance(drafts, Mapping):
        return invalid(f"drafts must map request ids to token-id lists, got {type(drafts).__name__}", field="drafts")
    for rid, ids in drafts.items():
        if not isinstance(ids, (list, tuple)) or not are_token_ids(ids):
            return invalid(
                f"the drafts of request {shown(rid)} must be a list of token ids, got {shown(ids):.80}",
                request=rid if is_request_id(rid) else None,
                field="drafts",
            )
    return None


def decodes(d: Planning, drafts: Mapping[RequestId, Sequence[int]] | None) -> None:
    """Decodes, oldest first: one token each (its last sampled id), and its drafts where it has any. The
    whole batch as one transition when it fits (with drafts: ``_verify_batch``); request by request,
    preempting the newest as needed, when not."""
    prefilling = d.prefilling
    candidates = (
        [rid for rid in d.running if rid not in prefilling][: d.budget] if prefilling else d.running[: d.budget]
    )
    if drafts is None:
        if not d.awaiting:
            batch = append_decode(d.kv, candidates, d.log.last_many(candidates))
        else:  # planned ahead of the last step's ids: a row whose id is not known grows by a placeholder
            batch = append_many(
                d.kv,
                [
                    (rid, [Placeholders(1)] if rid in d.awaiting else [[tok]])
                    for rid, tok in zip(candidates, d.log.last_many(candidates))
                ],
            )
        if isinstance(batch, Success):
            d.apply(batch.unwrap())
            d.decode.extend(candidates)
            d.budget -= len(candidates)
            return
    elif not d.awaiting and _verify_batch(d, candidates, drafts):
        return
    for rid in candidates:
        if rid in d.running and d.budget >= 1:
            _decode_one(d, rid, d.log.last(rid), _fitting(d, rid, drafts.get(rid, ())) if drafts else ())


def _verify_batch(d: Planning, candidates: list[RequestId], drafts: Mapping[RequestId, Sequence[int]]) -> bool:
    """Decodes with drafts as one transition, when every row grows by its token and the drafts that fit (as the
    request-by-request loop would grow them, in order) without a refusal; False, nothing changed, when not."""
    budget, items, fitted = d.budget, [], []
    for rid, token in zip(candidates, d.log.last_many(candidates)):
        if budget < 1:  # (earlier rows' drafts took the budget: it waits, as in the loop)
            continue
        draft = _fitting(d, rid, drafts.get(rid, ()), budget)
        items.append((rid, [[token, *draft]]))
        fitted.append((rid, draft))
        budget -= 1 + len(draft)
    batch = append_many(d.kv, items)
    if not isinstance(batch, Success):
        return False
    d.apply(batch.unwrap())
    for rid, draft in fitted:
        _planned(d, rid, draft)
    return True


def _fitting(d: Planning, rid: RequestId, draft: Sequence[int], budget: int | None = None) -> tuple[int, ...]:
    """As many of ``rid``'s drafts as its step can verify: the budget left after its own token (``budget``, by
    default the draft's), the tokens ``max_tokens`` still allows after the one a verify always yields, and the
    row's length limit."""
    if not draft:
        return ()
    slot = d.kv.requests[rid].slots[0]
    room = min(
        (d.budget if budget is None else budget) - 1,
        d.seqs[rid].max_tokens - d.log.count(rid) - 1,
        d.kv.config.length_limit - d.kv.row_len[slot] - 1,
    )
    return tuple(draft[: max(room, 0)])


def _planned(d: Planning, rid: RequestId, draft: tuple[int, ...]) -> None:
    """``rid`` grew by its token and ``draft``: a decode, or a verify of its drafts, out of the budget."""
    if draft:
        d.verify.append((rid, draft))
    else:
        d.decode.append(rid)
    d.budget -= 1 + len(draft)


def _decode_one(d: Planning, rid: RequestId, token: int, draft: tuple[int, ...] = ()) -> None:
    ahead = rid in d.awaiting  # (its last id not known yet: a placeholder, and no drafts after it)
    draft = () if ahead else draft
    grown = grow(d, rid, Placeholders(1) if ahead else [token, *draft])
    if grown is True:
        _planned(d, rid, draft)
    elif grown is not False:  # max_model_len reached, or more than the whole pool holds: it cannot go on
        d.apply(release(d.kv, rid, "error").unwrap())
        d.running.remove(rid)
        d.end(rid, Move.OVERRUN, grown)


def grow(d: Planning, rid: RequestId, tokens: list[int] | Placeholders) -> bool | KVError:
    """``rid``'s row grows by ``tokens``, preempting while the blocks are short: True when it grew, False when
    ``rid`` itself was the one preempted (it waits, its blocks back), or the refusal that is not about blocks: its
    length past ``max_model_len``, or (``UNSCHEDULABLE``) more than the pool holds with ``rid`` alone in it.

    The one preempted is the newest running request that could be admitted again (``readmission_refusal``): a
    request in company is never ended for want of blocks it would have alone, and none is preempted into a
    recompute that could never be admitted (one whose windows would hold a whole chunk again, say). Where none
    could come back, the newest goes as before; ``rid`` itself then ends, refused."""
    alone: bool = False  # (judged at the first shortage: only a request that runs short pays)
    while True:
        grown = append(d.kv, rid, [tokens])
        if isinstance(grown, Success):
            d.apply(grown.unwrap())
            return True
        err = grown.failure()
        if err.code is not ErrorCode.NO_CAPACITY:
            return err
        if not alone:
            too_big = alone_refusal(d.kv, rid, err)
            if too_big is not None:
                return too_big
            alone = True
        victim = next((v for v in reversed(d.running) if readmission_refusal(d, v) is None), d.running[-1])
        never = readmission_refusal(d, rid) if victim == rid else None
        if never is not None:
            return never
        d.preempt(victim)
        if victim == rid:
            return False


def alone_refusal(kv: KVState, rid: RequestId, short: KVError) -> KVError | None:
    """Why ``rid``'s growth, refused with ``short`` (``NO_CAPACITY``: the blocks it needs), could not be served
    even with ``rid`` alone in the pool (every other request's blocks back): ``UNSCHEDULABLE``, or None."""
    held = len({b for row in request_blocks(kv, rid) for blocks in row for b in blocks if b})
    usable = kv.config.usable_blocks
    need = short.requested or 0
    if held + need <= usable:
        return None
    return KVError(
        ErrorCode.UNSCHEDULABLE,
        f"request {shown(rid)} needs {held + need} blocks to grow; the pool has {usable} usable blocks in all",
        request=rid,
        requested=held + need,
        available=usable,
    )


def readmission_refusal(d: Planning, rid: RequestId) -> KVError | None:
    """Why running ``rid``, preempted now, could never be admitted again (its prompt and what it generated, as the
    waiting queue's head would be judged with its blocks back): then it is not preempted, it ends."""
    req = d.seqs[rid]
    kv = release(d.kv, rid, "preempted").unwrap().state
    return admission_refusal(d, kv, replace(req, output=d.output(rid)).spec(), readmitted=True)


def admission_refusal(d: Planning, kv: KVState, spec: RequestSpec, *, readmitted: bool = False) -> KVError | None:
    """Why the scheduler can never admit ``spec`` into ``kv``'s pool, whatever the pool holds then: ``refusal``
    (its blocks at once), or under ``grow_prefill`` ``growing_refusal`` (a chunk's at a time), as for a
    ``readmitted`` (preempted) request, which takes its blocks a chunk at a time where they do not fit at once."""
    if (d.state.config.grow_prefill or readmitted) and spec.rows[0].prefix_len is None:
        return growing_refusal(kv, spec, checked=True)  # (checked when the request arrived)
    return refusal(kv, spec, checked=True)
