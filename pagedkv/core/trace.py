"""Trace contract version 1: parse events, run them through the core, and
produce one result object per event (see docs/trace.md; the format is exact).

Pure: this module takes lines of text and returns values; reading files and
printing is the CLI's business.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from returns.result import Failure, Result

from pagedkv.core.config import CacheConfig, GroupSpec, InvalidConfig
from pagedkv.core.digest import digest
from pagedkv.core.errors import KVError, invalid, is_int
from pagedkv.core.invariants import check_invariants
from pagedkv.core.metadata import KVMetadata, publish
from pagedkv.core.scheduler import (
    SchedState, SchedulerConfig, SeqRequest, StepPlan, cancel, new_scheduler, on_output, schedule, sched_digest, submit,
)  # fmt: skip
from pagedkv.core.spec import RequestSpec, RowSpec
from pagedkv.core.state import KVState, initial_state, request_blocks
from pagedkv.core.transitions import Admitted, admit, append, commit, release, reset, reset_prefix_cache

TRACE_VERSION = 1
OPS = ("admit", "append", "commit", "release", "publish", "reset", "reset_prefix_cache")
SCHEDULER_OPS = ("submit", "schedule", "output", "cancel", "error")
SCHEDULER_KEYS = ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill", "watermark_blocks", "allow_overtaking")


class TraceHeaderError(ValueError):
    """The first line is not a version-1 header with a usable config (replay exits 2)."""


def parse_header(line: str) -> CacheConfig:
    """The pool config of a trace's first line."""
    return parse_trace_header(line)[0]


def parse_trace_header(line: str) -> tuple[CacheConfig, SchedulerConfig | None]:
    """The pool config of a trace's first line, and the scheduler's when the trace drives one.

    >>> parse_header('{"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9}}').usable_blocks
    8
    """
    try:
        head = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise TraceHeaderError(f"line 1: the header is not JSON: {e}") from None
    if not isinstance(head, dict) or head.get("pagedkv_trace") != TRACE_VERSION or is_bool(head.get("pagedkv_trace")):
        raise TraceHeaderError(f'line 1: the header must be {{"pagedkv_trace": {TRACE_VERSION}, "config": {{...}}}}')
    cfg = head.get("config")
    if not isinstance(cfg, dict):
        raise TraceHeaderError('line 1: the header needs a "config" object')
    try:
        groups_raw = cfg.get("groups", [{"name": "full", "kind": "full"}])
        if not isinstance(groups_raw, list) or not all(isinstance(g, dict) for g in groups_raw):
            raise InvalidConfig("groups must be a list of objects")
        groups = tuple(
            GroupSpec(g.get("name"), g.get("kind"), g.get("window"), g.get("chunk"))
            for g in groups_raw
        )
        sched_raw = cfg.get("scheduler")
        sched = None
        if sched_raw is not None:
            if not isinstance(sched_raw, dict):
                raise InvalidConfig('"scheduler" must be an object')
            known = {k: sched_raw[k] for k in SCHEDULER_KEYS if k in sched_raw}
            sched = SchedulerConfig(**known)
        return CacheConfig(
            block_size=cfg.get("block_size"),  # type: ignore[arg-type]
            num_blocks=cfg.get("num_blocks"),  # type: ignore[arg-type]
            groups=groups,
            enable_prefix_caching=cfg.get("enable_prefix_caching", False),
            max_rows_per_request=cfg.get("max_rows_per_request"),
            max_model_len=cfg.get("max_model_len"),
            hash_namespace=cfg.get("hash_namespace", "pagedkv"),
        ), sched
    except (InvalidConfig, TypeError) as e:
        raise TraceHeaderError(f"line 1: bad config: {e}") from None


def is_bool(v: object) -> bool:
    return type(v) is bool


@dataclass(frozen=True, slots=True)
class EventResult:
    """One event's outcome: the contract's result object and any expect mismatch."""

    line: int  # 1-based line in the file
    result: dict[str, Any]
    divergence: str | None  # first mismatch against the event's "expect", if any
    state: KVState | SchedState
    violations: tuple[str, ...] = ()  # broken invariants after the event (replay with check=True)


def replay(lines: Iterable[str], *, check: bool = False) -> Iterator[EventResult]:
    """Run a whole trace. Raises ``TraceHeaderError`` before the first event if the header is bad.

    Blank lines are skipped and not counted; every other line is an event. With
    ``check``, every invariant is checked after every event (O(pool) each).
    """
    it = iter(enumerate(lines, start=1))
    for lineno, line in it:
        if line.strip():
            cache, sched = parse_trace_header(line)
            state: KVState | SchedState = initial_state(cache) if sched is None else new_scheduler(cache, sched)
            break
    else:
        raise TraceHeaderError("line 1: the trace is empty; it needs a header")
    last_digest = _digest(state)
    previous_generation = _kv(state).generation
    i = 0
    for lineno, line in it:
        if not line.strip():
            continue
        state, result, expect = run_line(state, line, lineno)
        changed = result.pop("_changed")
        if changed:
            last_digest = _digest(state)
        ordered: dict[str, Any] = {"i": i}
        for key in ("op", "ok", "error", "generation", "free_blocks"):
            ordered[key] = result.pop(key)
        ordered["digest"] = last_digest
        ordered.update(result)  # the op's own fields come last
        divergence = None
        if expect is not None:
            divergence = first_mismatch(expect, ordered, "")
        violations: tuple[str, ...] = ()
        if check and changed:
            violations = tuple(check_invariants(_kv(state)))
            if ordered["op"] in ("admit", "release") and ordered["generation"] <= previous_generation:
                violations += (f"a successful {ordered['op']} must take a new generation",)
        previous_generation = _kv(state).generation
        yield EventResult(lineno, ordered, divergence, state, violations)
        i += 1


def _kv(state: KVState | SchedState) -> KVState:
    return state.kv if isinstance(state, SchedState) else state


def _digest(state: KVState | SchedState) -> str:
    return sched_digest(state) if isinstance(state, SchedState) else digest(state)


def run_line(
    state: KVState | SchedState, line: str, lineno: int
) -> tuple[KVState | SchedState, dict[str, Any], dict[str, Any] | None]:
    """Apply one event line; returns the next state, the partial result and the expect object."""
    op: Any = None
    expect: dict[str, Any] | None = None
    try:
        event = json.loads(line)
    except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as e:
        return state, _failed(state, None, invalid(f"line {lineno}: not a JSON object: {e}")), None
    if not isinstance(event, dict):
        return state, _failed(state, None, invalid(f"line {lineno}: an event must be a JSON object")), None
    op = event.get("op")
    op_out = op if type(op) is str else None
    if "expect" in event:
        if not isinstance(event["expect"], dict):
            return state, _failed(state, op_out, invalid(f"line {lineno}: \"expect\" must be an object")), None
        expect = event["expect"]
    ops = SCHEDULER_OPS if isinstance(state, SchedState) else OPS
    if op not in ops:
        other = "a trace with a scheduler" if isinstance(state, SchedState) else "a trace without a scheduler"
        why = f"line {lineno}: op {op!r} is not one of {list(ops)} ({other})"
        return state, _failed(state, op_out, invalid(why)), expect
    outcome = _apply_sched(state, op, event) if isinstance(state, SchedState) else _apply(state, op, event)
    if isinstance(outcome, Failure):
        err = outcome.failure()
        err = KVError(err.code, f"line {lineno}: {err.message}", err.request, err.field, err.requested, err.available)
        return state, _failed(state, op, err), expect
    new_state, extra = outcome.unwrap()
    result: dict[str, Any] = {
        "op": op, "ok": True, "error": None, "generation": _kv(new_state).generation,
        "free_blocks": _kv(new_state).free_blocks, "_changed": new_state is not state, **extra,
    }  # fmt: skip
    return new_state, result, expect


_EXTRA_FIELDS = {"admit": ("cached_tokens", "blocks"), "append": ("blocks",), "commit": ("blocks",),
                 "publish": ("rows",), "schedule": ("plan",), "output": ("finished",)}  # fmt: skip


def _failed(state: KVState | SchedState, op: str | None, err: KVError) -> dict[str, Any]:
    result: dict[str, Any] = {
        "op": op, "ok": False,
        "error": {"code": err.code.value, "permanent": err.permanent, "message": err.message},
        "generation": _kv(state).generation, "free_blocks": _kv(state).free_blocks, "_changed": False,
    }  # fmt: skip
    for key in _EXTRA_FIELDS.get(op or "", ()):
        result[key] = None
    return result


def _apply(state: KVState, op: str, ev: Mapping[str, Any]) -> Result[tuple[KVState, dict[str, Any]], KVError]:
    if op == "admit":
        spec = _admit_spec(ev)
        if isinstance(spec, KVError):
            return Failure(spec)
        return admit(state, spec).map(lambda s: (s.state, _admitted(s.effect)))
    if op in ("append", "commit", "release") and "request" not in ev:
        return Failure(invalid(f'{op} needs a "request" id', field="request"))
    if op == "append":
        has_t, has_n = "tokens" in ev, "num_tokens" in ev
        if has_t == has_n:
            return Failure(invalid('append takes exactly one of "tokens" and "num_tokens"', field="tokens"))
        rows = ev["tokens"] if has_t else ev["num_tokens"]
        if not isinstance(rows, list) or any(type(r) is not (list if has_t else int) for r in rows):
            what = "a list of token-id lists, one per row" if has_t else "a list of counts, one per row"
            return Failure(invalid(f"append {'tokens' if has_t else 'num_tokens'} must be {what}", field="tokens"))
        rid = ev["request"]
        return append(state, rid, rows).map(lambda s: (s.state, {"blocks": _blocks(s.state, rid)}))
    if op == "commit":
        rid = ev["request"]
        return commit(state, rid, ev.get("computed")).map(  # type: ignore[arg-type]
            lambda s: (s.state, {"blocks": _blocks(s.state, rid)})
        )
    if op == "release":
        return release(state, ev["request"], ev.get("reason")).map(lambda s: (s.state, {}))  # type: ignore[arg-type]
    if op == "publish":
        return publish(state, ev.get("requests"), ev.get("phase")).map(  # type: ignore[arg-type]
            lambda s: (s.state, {"rows": _rows(s.effect)})
        )
    if op == "reset":
        return reset(state).map(lambda s: (s.state, {}))
    return reset_prefix_cache(state).map(lambda s: (s.state, {}))


def _apply_sched(
    state: SchedState, op: str, ev: Mapping[str, Any]
) -> Result[tuple[SchedState, dict[str, Any]], KVError]:
    if op == "schedule":
        return schedule(state).map(lambda sp: (sp[0], {"plan": plan_json(sp[1])}))
    if op == "output":
        sampled = ev.get("sampled", [])
        fin = ev.get("finished", [])
        if not isinstance(sampled, list) or any(not isinstance(p, list) or len(p) != 2 for p in sampled):
            return Failure(invalid('output "sampled" must be a list of [request, token] pairs', field="sampled"))
        if not isinstance(fin, list):
            return Failure(invalid('output "finished" must be a list of request ids', field="finished"))
        try:
            pairs = {rid: tok for rid, tok in sampled}
            stop = set(fin)
        except TypeError:
            return Failure(invalid("request ids must be strings or integers", field="sampled"))
        return on_output(state, pairs, stop).map(lambda so: (so[0], {"finished": [list(x) for x in so[1]]}))
    if "request" not in ev:
        return Failure(invalid(f'{op} needs a "request" id', field="request"))
    rid = ev["request"]
    if op in ("cancel", "error"):
        return cancel(state, rid, "cancelled" if op == "cancel" else "error").map(lambda s: (s, {}))
    # submit
    extra = ev.get("extra_keys", [])
    if not isinstance(extra, list) or any(type(k) is not str for k in extra):
        return Failure(invalid('"extra_keys" must be a list of strings', field="extra_keys"))
    if "rows" in ev:
        spec = _admit_spec(ev)
        if isinstance(spec, KVError):
            return Failure(spec)
        req = SeqRequest(rid, rows=spec.rows, steps=ev.get("steps", 1), extra_keys=tuple(extra))
    else:
        prompt = ev.get("prompt")
        if not isinstance(prompt, list):
            return Failure(invalid('submit needs "prompt" (token ids) or "rows" (a diffusion request)', field="prompt"))
        req = SeqRequest(rid, tuple(prompt), max_tokens=ev.get("max_tokens", 16), extra_keys=tuple(extra))
    return submit(state, req).map(lambda s: (s, {}))


def plan_json(plan: StepPlan) -> dict[str, Any]:
    """A step plan as the trace output prints it."""
    return {
        "step": plan.step, "decode": list(plan.decode), "prefill": [list(p) for p in plan.prefill],
        "diffusion": [{"request": d.request_id, "steps": d.steps} for d in plan.diffusion],
        "preempted": list(plan.preempted), "finished": [list(f) for f in plan.finished],
        "tokens": plan.num_tokens,
    }  # fmt: skip


def _admit_spec(ev: Mapping[str, Any]) -> RequestSpec | KVError:
    if "request" not in ev:
        return invalid('admit needs a "request" id', field="request")
    rows_raw = ev.get("rows")
    if not isinstance(rows_raw, list) or not rows_raw:
        return invalid('admit needs "rows": a non-empty list of row objects', field="rows")
    extra = ev.get("extra_keys", [])
    if not isinstance(extra, list) or any(type(k) is not str for k in extra):
        return invalid('"extra_keys" must be a list of strings', field="extra_keys")
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
        rows.append(RowSpec(
            num_tokens=len(r["tokens"]) if has_t else r["num_tokens"], tokens=tokens,
            prefix_len=r.get("prefix_len"), target_len=r.get("target_len"), spans=tuple(tuple(s) for s in spans),
        ))  # fmt: skip
    return RequestSpec(ev["request"], tuple(rows), tuple(extra))


def _admitted(e: Admitted) -> dict[str, Any]:
    return {"cached_tokens": list(e.cached_tokens), "blocks": _lists(e.blocks)}


def _blocks(state: KVState, rid: Any) -> Any:
    return _lists(request_blocks(state, rid))


def _lists(x: Any) -> Any:
    return [_lists(v) for v in x] if isinstance(x, tuple) else x


def _rows(meta: KVMetadata) -> list[dict[str, Any]]:
    return [
        {
            "request": r.request_id, "row": r.row, "seq_len": r.seq_len, "query_len": r.query_len,
            "kv_start_pos": r.kv_start_pos, "block_ids": _lists(r.block_ids), "slots": list(r.slots),
            "segments": [{"causal": s.causal, "q": [s.q_start, s.q_end], "kv_end": s.kv_end} for s in r.segments],
        }  # fmt: skip
        for r in meta.rows
    ]


def first_mismatch(expected: Any, actual: Any, path: str) -> str | None:
    """Where ``actual`` departs from ``expected``: objects match as subsets,
    lists element by element, scalars exactly (``true`` is not ``1``).

    >>> first_mismatch({"ok": True, "error": None}, {"ok": True, "error": None, "i": 0}, "")
    >>> first_mismatch({"blocks": [[[1, 2]]]}, {"blocks": [[[1, 3]]]}, "")
    'blocks[0][0][1]: expected 2, got 3'
    """
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{path or '.'}: expected an object, got {json.dumps(actual)}"
        for key, value in expected.items():
            sub = f"{path}.{key}" if path else key
            if key not in actual:
                return f"{sub}: expected {json.dumps(value)}, but the result has no such field"
            found = first_mismatch(value, actual[key], sub)
            if found:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return f"{path}: expected {json.dumps(expected)}, got {json.dumps(actual)}"
        for k, (e, a) in enumerate(zip(expected, actual)):
            found = first_mismatch(e, a, f"{path}[{k}]")
            if found:
                return found
        return None
    if type(expected) is not type(actual) and not (is_int(expected) and type(actual) is float) or expected != actual:
        return f"{path}: expected {json.dumps(expected)}, got {json.dumps(actual)}"
    return None


# -- recording a scheduler run -------------------------------------------------


def scheduler_header(cache: CacheConfig, sched: SchedulerConfig) -> dict[str, Any]:
    """The first line of a scheduler trace (contract v1 with a "scheduler" config)."""
    groups = [{"name": g.name, "kind": g.kind.value, **({"window": g.window} if g.window else {}),
               **({"chunk": g.chunk} if g.chunk else {})} for g in cache.groups]  # fmt: skip
    return {"pagedkv_trace": TRACE_VERSION, "config": {
        "block_size": cache.block_size, "num_blocks": cache.num_blocks, "groups": groups,
        "enable_prefix_caching": cache.enable_prefix_caching, "max_rows_per_request": cache.max_rows_per_request,
        "max_model_len": cache.max_model_len, "hash_namespace": cache.hash_namespace,
        "scheduler": {k: getattr(sched, k) for k in SCHEDULER_KEYS}}}  # fmt: skip


def submit_event(req: SeqRequest) -> dict[str, Any]:
    ev: dict[str, Any] = {"op": "submit", "request": req.request_id}
    if req.rows is not None:
        rows = []
        for r in req.rows:
            row: dict[str, Any] = {"tokens": list(r.tokens)} if r.tokens is not None else {"num_tokens": r.num_tokens}
            if r.prefix_len is not None:
                row.update(prefix_len=r.prefix_len, target_len=r.target_len)
            if r.spans:
                row["spans"] = [list(sp) for sp in r.spans]
            rows.append(row)
        ev.update(rows=rows, steps=req.steps)
    else:
        ev.update(prompt=list(req.prompt), max_tokens=req.max_tokens)
    if req.extra_keys:
        ev["extra_keys"] = list(req.extra_keys)
    return ev


def output_event(sampled: Mapping[Any, int], finished: Iterable[Any] = ()) -> dict[str, Any]:
    return {"op": "output", "sampled": [[rid, tok] for rid, tok in sampled.items()], "finished": list(finished)}
