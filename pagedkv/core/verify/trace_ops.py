"""How each op of a trace acts on a state: the core's ops on a ``KVState``, the scheduler's on a
``SchedState``, each giving the next state, the op's own result fields and its effect."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from returns.result import Failure, Result

from pagedkv.core.rules.admission import admit, turn_away
from pagedkv.core.rules.commit import cache_ahead, commit
from pagedkv.core.rules.destination import mark_ready
from pagedkv.core.outputs.effects import Admitted
from pagedkv.core.errors import KVError, invalid, is_int, shown
from pagedkv.core.rules.growth import Placeholders, append
from pagedkv.core.outputs.metadata import KVMetadata
from pagedkv.core.rules.placeholders import fill, truncate
from pagedkv.core.rules.release import forget_host, release, reset, reset_prefix_cache
from pagedkv.core.scheduler import SchedState, SeqRequest, StepPlan, cancel, on_output, on_tokens, schedule, submit
from pagedkv.core.scheduler import forget_host as sched_forget_host
from pagedkv.core.outputs.snapshot import publish
from pagedkv.core.spec import RequestSpec, RowSpec
from pagedkv.core.store.state import KVState, request_blocks

OPS = (
    "admit",
    "append",
    "commit",
    "release",
    "publish",
    "reset",
    "reset_prefix_cache",
    "mark_ready",
    "cache_ahead",
    "fill",
    "truncate",
    "turn_away",
    "forget_host",
)
SCHEDULER_OPS = ("submit", "schedule", "output", "tokens", "cancel", "error", "forget_host")
STEP_OPS = ("submit", "tick", "done", "fail", "cancel")  # a trace of DiT step batching (header "dit_steps": true)
# fields a failed event of each op shows as null
EXTRA_FIELDS = {
    "admit": ("cached_tokens", "blocks"),
    "turn_away": ("rows_tried",),
    "forget_host": ("forgotten",),
    "append": ("blocks",),
    "commit": ("blocks",),
    "truncate": ("blocks",),
    "cache_ahead": ("blocks",),
    "publish": ("rows",),
    "schedule": ("plan",),
    "output": ("finished",),
    "tokens": ("finished",),
    "tick": ("forwards", "admitted", "refused"),
    "fail": ("finished", "failed"),
    "done": ("finished",),
}


def apply_core(
    state: KVState, op: str, ev: Mapping[str, Any]
) -> Result[tuple[KVState, dict[str, Any], object], KVError]:
    if op in ("admit", "turn_away"):
        spec = admit_spec(ev)
        if isinstance(spec, KVError):
            return Failure(spec)
        if op == "turn_away":  # vLLM-Omni's refusal of a request that does not fit now
            return turn_away(state, spec).map(lambda s: (s.state, {"rows_tried": s.effect.rows_tried}, s.effect))
        return admit(state, spec).map(lambda s: (s.state, _admitted(s.effect), s.effect))
    if op in ("append", "commit", "release", "mark_ready", "cache_ahead", "fill", "truncate") and "request" not in ev:
        return Failure(invalid(f'{op} needs a "request" id', field="request"))
    if op == "append":
        return _append(state, ev)
    if op in ("fill", "truncate"):
        return _ahead(state, op, ev)
    if op == "commit":
        rid = ev["request"]
        return commit(state, rid, ev.get("computed")).map(  # type: ignore[arg-type]
            lambda s: (s.state, {"blocks": _blocks(s.state, rid)}, s.effect)
        )
    if op == "cache_ahead":  # vLLM's caching point: full blocks cached when their step is planned
        rid = ev["request"]
        return cache_ahead(state, rid, ev.get("through")).map(  # type: ignore[arg-type]
            lambda s: (s.state, {"blocks": _blocks(s.state, rid)}, s.effect)
        )
    if op == "release":
        return release(state, ev["request"], ev.get("reason")).map(lambda s: (s.state, {}, s.effect))  # type: ignore[arg-type]
    if op == "publish":
        return publish(state, ev.get("requests"), ev.get("phase")).map(  # type: ignore[arg-type]
            lambda s: (s.state, {"rows": _rows(s.effect)}, None)
        )
    if op == "mark_ready":  # KV of [start, end) of a row arrived (destination blocks)
        return mark_ready(state, ev["request"], ev.get("row", 0), ev.get("start"), ev.get("end")).map(  # type: ignore[arg-type]
            lambda s: (s.state, {"ready": list(s.effect.ready), "pending": list(s.effect.pending)}, s.effect)
        )
    if op == "forget_host":  # host-tier entries the shell could not write (a store that failed)
        return forget_host(state, ev.get("slots")).map(lambda s: (s.state, {"forgotten": s.effect.forgotten}, s.effect))
    if op == "reset":
        return reset(state).map(lambda s: (s.state, {}, s.effect))
    return reset_prefix_cache(state).map(lambda s: (s.state, {}, s.effect))


def apply_scheduler(
    state: SchedState, op: str, ev: Mapping[str, Any]
) -> Result[tuple[SchedState, dict[str, Any], object], KVError]:
    if op == "schedule":
        drafts = ev.get("drafts", [])
        if not isinstance(drafts, list) or any(not isinstance(p, list) or len(p) != 2 for p in drafts):
            return Failure(invalid('schedule "drafts" must be a list of [request, [token, ...]] pairs', field="drafts"))
        try:
            by_request = {rid: ids for rid, ids in drafts}
        except TypeError:
            return Failure(invalid("request ids must be strings or integers", field="drafts"))
        return schedule(state, by_request).map(lambda sp: (sp[0], {"plan": plan_json(sp[1])}, None))
    if op in ("output", "tokens"):
        sampled = ev.get("sampled", [])
        fin = ev.get("finished", [])
        if not isinstance(sampled, list) or any(not isinstance(p, list) or len(p) != 2 for p in sampled):
            return Failure(
                invalid(
                    'output "sampled" must be a list of [request, token] pairs (or [request, '
                    "[token, ...]] for a decode that verified drafts)",
                    field="sampled",
                )
            )
        if not isinstance(fin, list):
            return Failure(invalid('output "finished" must be a list of request ids', field="finished"))
        try:
            pairs = {rid: tok for rid, tok in sampled}
            stop = set(fin)
        except TypeError:
            return Failure(invalid("request ids must be strings or integers", field="sampled"))
        step = on_output if op == "output" else on_tokens
        return step(state, pairs, stop).map(
            lambda so: (so[0], {"finished": [[rid, str(how)] for rid, how in so[1]]}, None)
        )
    if op == "forget_host":
        return sched_forget_host(state, ev.get("slots")).map(lambda s: (s, {"forgotten": len(s.kv_events)}, None))
    if "request" not in ev:
        return Failure(invalid(f'{op} needs a "request" id', field="request"))
    rid = ev["request"]
    if op in ("cancel", "error"):
        return cancel(state, rid, "cancelled" if op == "cancel" else "error").map(lambda s: (s, {}, None))
    # submit
    extra = ev.get("extra_keys", [])
    if not isinstance(extra, list) or any(type(k) is not str for k in extra):
        return Failure(invalid('"extra_keys" must be a list of strings', field="extra_keys"))
    if "rows" in ev:
        spec = admit_spec(ev)
        if isinstance(spec, KVError):
            return Failure(spec)
        req = SeqRequest(rid, rows=spec.rows, steps=ev.get("steps", 1), extra_keys=tuple(extra))
    else:
        prompt = ev.get("prompt")
        if not isinstance(prompt, list):
            return Failure(invalid('submit needs "prompt" (token ids) or "rows" (a diffusion request)', field="prompt"))
        most = ev.get("max_hit")
        if most is not None and not (type(most) is int and most >= 0):
            return Failure(invalid('"max_hit" must be a non-negative integer', field="max_hit"))
        req = SeqRequest(rid, tuple(prompt), max_tokens=ev.get("max_tokens", 16), extra_keys=tuple(extra), max_hit=most)
    return submit(state, req).map(lambda s: (s, {}, None))


def _append(state: KVState, ev: Mapping[str, Any]) -> Result[tuple[KVState, dict[str, Any], object], KVError]:
    """An append of token ids, of a count (the row's ids stop), or of placeholders (ids that come later)."""
    forms = [k for k in ("tokens", "num_tokens", "placeholders") if k in ev]
    if len(forms) != 1:
        if "placeholders" not in ev:  # (the message of a trace written before placeholders, unchanged)
            return Failure(invalid('append takes exactly one of "tokens" and "num_tokens"', field="tokens"))
        return Failure(invalid('append takes exactly one of "tokens", "num_tokens" and "placeholders"', field="tokens"))
    form = forms[0]
    rows = ev[form]
    if not isinstance(rows, list) or any(type(r) is not (list if form == "tokens" else int) for r in rows):
        what = "a list of token-id lists, one per row" if form == "tokens" else "a list of counts, one per row"
        return Failure(invalid(f"append {form} must be {what}", field="tokens"))
    growth = [Placeholders(n) for n in rows] if form == "placeholders" else rows
    rid = ev["request"]
    return append(state, rid, growth).map(lambda s: (s.state, {"blocks": _blocks(s.state, rid)}, s.effect))


def _ahead(state: KVState, op: str, ev: Mapping[str, Any]) -> Result[tuple[KVState, dict[str, Any], object], KVError]:
    """``fill`` (ids of positions that awaited theirs) and ``truncate`` (rows cut back)."""
    rid = ev["request"]
    if op == "fill":
        rows = ev.get("tokens")
        if not isinstance(rows, list) or any(not isinstance(r, list) for r in rows):
            return Failure(invalid('fill needs "tokens": a list of token-id lists, one per row', field="tokens"))
        return fill(state, rid, rows).map(lambda s: (s.state, {}, s.effect))
    return truncate(state, rid, ev.get("lengths")).map(  # type: ignore[arg-type]
        lambda s: (s.state, {"blocks": _blocks(s.state, rid)}, s.effect)
    )


def plan_json(plan: StepPlan) -> dict[str, Any]:
    """A step plan as the trace output prints it."""
    return {
        "step": plan.step,
        "decode": list(plan.decode),
        "prefill": [list(p) for p in plan.prefill],
        "diffusion": [{"request": d.request_id, "steps": d.steps} for d in plan.diffusion],
        "preempted": list(plan.preempted),
        "finished": [[rid, str(how)] for rid, how in plan.finished],  # plain strings, as expect holds them
        "tokens": plan.num_tokens,
        **({"verify": [[rid, list(draft)] for rid, draft in plan.verify]} if plan.verify else {}),
    }


def admit_spec(ev: Mapping[str, Any]) -> RequestSpec | KVError:
    if "request" not in ev:
        return invalid('admit needs a "request" id', field="request")
    rows_raw = ev.get("rows")
    if not isinstance(rows_raw, list) or not rows_raw:
        return invalid('admit needs "rows": a non-empty list of row objects', field="rows")
    keys = {}
    for name in ("extra_keys", "first_block_keys", "content"):
        raw = ev.get(name, [])
        if not isinstance(raw, list):
            return invalid(f'"{name}" must be a list', field=name)
        keys[name] = tuple(_tupled(k) for k in raw)  # (the spec's checks judge what is inside)
    rows = []
    for i, r in enumerate(rows_raw):
        if not isinstance(r, dict):
            return invalid(f"row {i} must be an object", field="rows")
        has_t, has_n = "tokens" in r, "num_tokens" in r
        if has_t == has_n:
            return invalid(f'row {i} takes exactly one of "tokens" and "num_tokens"', field="tokens")
        if has_t and not isinstance(r["tokens"], list):
            return invalid(f'row {i}: "tokens" must be a list of token ids', field="tokens")
        spans = r.get("spans", [])
        if not isinstance(spans, list) or any(not isinstance(s, list) or len(s) != 2 for s in spans):
            return invalid(f'row {i}: "spans" must be a list of [start, end] pairs', field="spans")
        tokens = tuple(r["tokens"]) if has_t else None
        waiting = r.get("placeholders", 0)
        if not is_int(waiting) or waiting < 0:
            return invalid(f'row {i}: "placeholders" must be a non-negative integer', field="placeholders")
        given = r.get("block_hashes", [])
        try:
            hashes = tuple(bytes.fromhex(h) for h in given)
        except (TypeError, ValueError):
            return invalid(f'row {i}: "block_hashes" must be a list of hex strings', field="block_hashes")
        rows.append(
            RowSpec(
                num_tokens=len(r["tokens"]) + waiting if has_t else r["num_tokens"],
                tokens=tokens,
                prefix_len=r.get("prefix_len"),
                target_len=r.get("target_len"),
                spans=tuple(tuple(s) for s in spans),
                pending_tokens=r.get("pending_tokens", 0),
                placeholders=waiting,
                block_hashes=hashes,
            )
        )
    return RequestSpec(
        ev["request"], tuple(rows), keys["extra_keys"], ev.get("max_hit"), keys["first_block_keys"], keys["content"]
    )


def _tupled(value: Any) -> Any:
    """A key as the core holds it: JSON lists as tuples, all the way down."""
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _admitted(e: Admitted) -> dict[str, Any]:
    return {"cached_tokens": list(e.cached_tokens), "blocks": _lists(e.blocks)}


def _blocks(state: KVState, rid: Any) -> Any:
    return _lists(request_blocks(state, rid))


def _lists(x: Any) -> Any:
    return [_lists(v) for v in x] if isinstance(x, tuple) else x


def _rows(meta: KVMetadata) -> list[dict[str, Any]]:
    return [
        {
            "request": r.request_id,
            "row": r.row,
            "seq_len": r.seq_len,
            "query_len": r.query_len,
            "kv_start_pos": r.kv_start_pos,
            "block_ids": _lists(r.block_ids),
            "slots": list(r.slots),
            "segments": [{"causal": s.causal, "q": [s.q_start, s.q_end], "kv_end": s.kv_end} for s in r.segments],
        }
        for r in meta.rows
    ]


def apply_steps(state: Any, op: str, ev: Mapping[str, Any]) -> Result[tuple[Any, dict[str, Any], object], KVError]:
    """One event of a DiT step-batching trace (``core.scheduler.steps``): submit (a diffusion request's
    rows, as in admit, and its ``steps``), tick (its forwards: phase, requests, each one's step; the admitted;
    the refused for good, with their codes), done (the finished), fail (``requests``: the failed forward's,
    ``retry``: kept at their last good step; the finished and the failed), cancel."""
    from pagedkv.core.scheduler import steps

    if op == "tick":
        return steps.tick(state).map(
            lambda sp: (
                sp[0],
                {
                    "forwards": [[f.phase, list(f.request_ids), list(f.step_index)] for f in sp[1].forwards],
                    "admitted": list(sp[1].admitted),
                    "refused": [{"request": rid, "code": e.code.value} for rid, e in sp[1].refused],
                },
                None,
            )
        )
    if op == "done":
        return steps.done(state).map(lambda sd: (sd[0], {"finished": list(sd[1])}, None))
    if op == "fail":
        retry = ev.get("retry", False)
        if type(retry) is not bool:
            return Failure(invalid(f'fail\'s "retry" must be true or false, got {shown(retry)}', field="retry"))
        return steps.fail(state, ev.get("requests"), retry).map(  # type: ignore[arg-type]
            lambda sf: (sf[0], {"finished": list(sf[1]), "failed": list(sf[2])}, None)
        )
    if "request" not in ev:
        return Failure(invalid(f'{op} needs a "request" id', field="request"))
    if op == "cancel":
        return steps.cancel_job(state, ev["request"], ev.get("reason", "cancelled")).map(lambda s: (s, {}, None))
    spec = admit_spec(ev)
    if isinstance(spec, KVError):
        return Failure(spec)
    return steps.submit_job(state, steps.DiTJob(ev["request"], spec, ev.get("steps", 1))).map(lambda s: (s, {}, None))
