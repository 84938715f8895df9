"""Trace contract version 1: parse a trace, run its events, and produce one result object
per event (see docs/trace.md; the format is exact).

Pure: this module takes lines of text and returns values; reading files and
printing is the CLI's business. How each op acts on a state is ``trace_ops``'s;
writing a scheduler run as a trace is ``record``'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from returns.result import Failure

from pagedkv.core.config import CacheConfig, GroupSpec, InvalidConfig
from pagedkv.core.outputs.effects import takes_generation
from pagedkv.core.errors import KVError, invalid, is_int, shown
from pagedkv.core.scheduler import SchedState, SchedulerConfig, new_scheduler, sched_digest
from pagedkv.core.store.state import KVState, initial_state
from pagedkv.core.verify.digest import digest
from pagedkv.core.verify.invariants import admission_violations, check_invariants, copy_violations
from pagedkv.core.scheduler import steps as dit_steps
from pagedkv.core.verify.trace_ops import EXTRA_FIELDS, OPS, SCHEDULER_OPS, STEP_OPS, apply_core, apply_scheduler
from pagedkv.core.verify.trace_ops import admit_spec, apply_steps

TRACE_VERSION = 1
SCHEDULER_KEYS = ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill", "watermark_blocks", "allow_overtaking")


class TraceHeaderError(ValueError):
    """The first line is not a version-1 header with a usable config (replay exits 2)."""


REPLAY_MAX_BLOCKS = 1 << 20  # the largest pool a trace header may name (docs/trace.md)
# a scheduler trace whose digest covers live state only (its header's "scheduler" says "digest": "live"); one
# recorded before it also covered every request that had ended (replay keeps that record itself)
LIVE_DIGEST = "live"


def parse_trace_header(line: str) -> tuple[CacheConfig, SchedulerConfig | None]:
    """The pool config of a trace's first line, and the scheduler's when the trace drives one.

    >>> parse_trace_header('{"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9}}')[0].usable_blocks
    8
    """
    try:
        head = json.loads(line)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, or an integer past 4,300 digits
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
        groups = tuple(GroupSpec(g.get("name"), g.get("kind"), g.get("window"), g.get("chunk")) for g in groups_raw)
        if type(cfg.get("end_record", False)) is not bool:
            raise InvalidConfig(f'"end_record" must be true or false, got {shown(cfg["end_record"])}')
        sched_raw = cfg.get("scheduler")
        sched = None
        if sched_raw is not None:
            if not isinstance(sched_raw, dict):
                raise InvalidConfig('"scheduler" must be an object')
            if sched_raw.get("digest", LIVE_DIGEST) != LIVE_DIGEST:
                raise InvalidConfig(
                    f'the scheduler\'s "digest" must be "{LIVE_DIGEST}" (or absent), got {shown(sched_raw["digest"])}'
                )
            optional = ("grow_prefill", "long_prefill_token_threshold")  # (written only when not default)
            known = {k: sched_raw[k] for k in (*SCHEDULER_KEYS, *optional) if k in sched_raw}
            sched = SchedulerConfig(**known)
        blocks = cfg.get("num_blocks")
        if type(blocks) is int and blocks > REPLAY_MAX_BLOCKS:
            raise InvalidConfig(
                f"num_blocks {shown(blocks)} is over the {REPLAY_MAX_BLOCKS:,} a trace may replay "
                "(each event's digest reads the whole pool)"
            )
        return CacheConfig(
            block_size=cfg.get("block_size"),  # type: ignore[arg-type]
            num_blocks=cfg.get("num_blocks"),  # type: ignore[arg-type]
            groups=groups,
            enable_prefix_caching=cfg.get("enable_prefix_caching", False),
            max_rows_per_request=cfg.get("max_rows_per_request"),
            max_model_len=cfg.get("max_model_len"),
            hash_namespace=cfg.get("hash_namespace", "pagedkv"),
            free_queue=cfg.get("free_queue", "tail"),
            reset_prefix_cache=cfg.get("reset_prefix_cache", "always"),
            caching_point=cfg.get("caching_point", "commit"),
            block_hash=cfg.get("block_hash", "blake2b"),
            cache_duplicates=cfg.get("cache_duplicates", False),
            hash_lookahead=cfg.get("hash_lookahead", 0),
            kv_events=cfg.get("kv_events", True),
            host_blocks=cfg.get("host_blocks", 0),
            host_store_threshold=cfg.get("host_store_threshold", 0),
            host_tracker_size=cfg.get("host_tracker_size", 64_000),
        ), sched
    except (InvalidConfig, TypeError, ValueError) as e:
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
    ``check``, every invariant is checked after every event (O(pool) each). A trace whose header
    promises an end record (``"end_record": true``) and stops without one, whose end record counts
    other events than came before it, or that goes on after it, diverges there: it was cut short, or
    lines were lost, inserted or appended (a trace without the promise cannot tell).
    """
    it = iter(enumerate(lines, start=1))
    for lineno, line in it:
        if line.strip():
            cache, sched = parse_trace_header(line)
            state: Any = initial_state(cache) if sched is None else new_scheduler(cache, sched)
            config = json.loads(line)["config"]
            promised = config.get("end_record", False)
            # a scheduler trace recorded before its digest covered live state only: how each request ended
            ended: dict[Any, str] | None = {} if sched is not None and "digest" not in config["scheduler"] else None
            if config.get("dit_steps") is True:  # DiT step batching (core.scheduler.steps), its forward budget
                budget = dit_steps.Budget(config.get("max_forward_rows"), config.get("max_forward_tokens"))
                if (bad := budget.check()) is not None:
                    raise TraceHeaderError(f"line {lineno}: {bad.message}")
                state = dit_steps.DiTState.empty(state if isinstance(state, KVState) else state.kv, budget)
            break
    else:
        raise TraceHeaderError("line 1: the trace is empty; it needs a header")
    last_digest = _digest(state, ended)
    previous_generation = kv_of(state).generation
    i = 0
    end_at: int | None = None  # the line of the end record, once read
    for lineno, line in it:
        if not line.strip():
            continue
        before = state
        if end_at is not None:  # nothing comes after the end record
            state, result, expect = (
                state,
                _failed(state, None, invalid(f"line {lineno}: after the end record (line {end_at})")),
                None,
            )
        else:
            state, result, expect = run_line(state, line, lineno, i)
        changed = result.pop("_changed")
        effect = result.pop("_effect", None)
        if ended is not None and result["ok"]:
            _note_endings(ended, result, line)
        if changed or (ended is not None and result["ok"]):
            last_digest = _digest(state, ended)
        ordered: dict[str, Any] = {"i": i}
        for key in ("op", "ok", "error", "generation", "free_blocks"):
            ordered[key] = result.pop(key)
        ordered["digest"] = last_digest
        ordered.update(result)  # the op's own fields come last
        divergence = None
        if expect is not None:
            divergence = first_mismatch(expect, ordered, "")
        if ordered["op"] == "end" or end_at is not None:  # the trace's own end: a mismatch is a cut or added line
            divergence = divergence or (None if ordered["ok"] else ordered["error"]["message"])
            end_at = end_at or lineno
        violations: tuple[str, ...] = ()
        if check and changed:
            violations = tuple(check_invariants(kv_of(state)))
            rule = None if effect is None else takes_generation(effect)  # the checker's rule, the same predicate
            if rule is True and ordered["generation"] <= previous_generation:
                violations += (f"a successful {ordered['op']} must take a new generation",)
            elif rule is False and ordered["generation"] != previous_generation:
                violations += (f"a successful {ordered['op']} took a generation without changing a block layout",)
            if effect is not None and isinstance(before, KVState):
                violations += tuple(copy_violations(before, effect, kv_of(state)))  # (the host tier's copies, in order)
        if check and ordered["op"] == "admit" and isinstance(before, KVState):
            violations += tuple(_judge_admission(before, line, state if ordered["ok"] else None, ordered["error"]))
        previous_generation = kv_of(state).generation
        yield EventResult(lineno, ordered, divergence, state, violations)
        i += 1
    if promised and end_at is None:  # the end record never came: reported in its place
        why = (
            f"line {lineno + 1}: the trace stops after {i} events without the end record its header promises: "
            "it was cut short (or is still being written)"
        )
        result = _failed(state, "end", invalid(why))
        result.pop("_changed")
        ordered = {
            "i": i,
            **{k: result.pop(k) for k in ("op", "ok", "error", "generation", "free_blocks")},
            "digest": last_digest,
            **result,
        }
        yield EventResult(lineno + 1, ordered, why, state)


def _note_endings(ended: dict[Any, str], result: dict[str, Any], line: str) -> None:
    """A scheduler trace of the old digest: how each request ended so far, as its state once kept it (a submit
    takes its id out again)."""
    op = result["op"]
    if op == "schedule":
        ended.update((rid, how) for rid, how in result["plan"]["finished"])
    elif op in ("output", "tokens"):
        ended.update((rid, how) for rid, how in result["finished"])
    elif op in ("cancel", "error", "submit"):
        rid = json.loads(line)["request"]
        if op == "submit":
            ended.pop(rid, None)
        else:
            ended[rid] = "cancelled" if op == "cancel" else "error"


def _judge_admission(before: KVState, line: str, after: KVState | None, error: dict[str, Any] | None) -> list[str]:
    """``admission_violations`` of an admit line (the model checker's judgement of an admission)."""
    spec = admit_spec(json.loads(line))
    if isinstance(spec, KVError):
        return []
    return admission_violations(before, spec, after, None if error is None else error["code"])


def kv_of(state: Any) -> KVState:
    """The core's state inside a replayed state (a scheduler's, a DiT step planner's, or the core's own)."""
    return state.kv if isinstance(state, (SchedState, dit_steps.DiTState)) else state


def _digest(state: Any, ended: dict[Any, str] | None = None) -> str:
    if isinstance(state, dit_steps.DiTState):
        return dit_steps.steps_digest(state)
    return sched_digest(state, ended) if isinstance(state, SchedState) else digest(state)


def run_line(
    state: KVState | SchedState, line: str, lineno: int, index: int = 0
) -> tuple[KVState | SchedState, dict[str, Any], dict[str, Any] | None]:
    """Apply one event line (``index``: the event lines before it); returns the next state, the partial result
    and the expect object."""
    op: Any = None
    expect: dict[str, Any] | None = None
    try:
        event = json.loads(line)
    except (ValueError, RecursionError) as e:  # bad JSON, bad bytes, or an integer past 4,300 digits
        return state, _failed(state, None, invalid(f"line {lineno}: not a JSON object: {e}")), None
    if not isinstance(event, dict):
        return state, _failed(state, None, invalid(f"line {lineno}: an event must be a JSON object")), None
    op = event.get("op")
    op_out = op if type(op) is str else None
    if "expect" in event:
        if not isinstance(event["expect"], dict):
            return state, _failed(state, op_out, invalid(f'line {lineno}: "expect" must be an object')), None
        expect = event["expect"]
    if op == "end":  # any trace's last line: how many event lines came before it
        events = event.get("events")
        if not is_int(events) or events != index:
            why = (
                f"line {lineno}: the end record counts {shown(events)} events; {index} came before it: lines were "
                "lost or inserted"
            )
            return state, _failed(state, "end", invalid(why)), expect
        return (
            state,
            {
                "op": "end",
                "ok": True,
                "error": None,
                "generation": kv_of(state).generation,
                "free_blocks": kv_of(state).free_blocks,
                "_changed": False,
            },
            expect,
        )
    steps = isinstance(state, dit_steps.DiTState)
    ops = STEP_OPS if steps else SCHEDULER_OPS if isinstance(state, SchedState) else OPS
    if op not in ops:
        other = (
            "a trace of DiT step batching"
            if steps
            else "a trace with a scheduler"
            if isinstance(state, SchedState)
            else "a trace without a scheduler"
        )
        why = f"line {lineno}: op {shown(op)} is not one of {list(ops)} ({other})"
        return state, _failed(state, op_out, invalid(why)), expect
    outcome = (
        apply_steps(state, op, event)
        if steps
        else apply_scheduler(state, op, event)
        if isinstance(state, SchedState)
        else apply_core(state, op, event)
    )
    if isinstance(outcome, Failure):
        err = outcome.failure()
        err = KVError(err.code, f"line {lineno}: {err.message}", err.request, err.field, err.requested, err.available)
        return state, _failed(state, op, err), expect
    new_state, extra, effect = outcome.unwrap()
    result: dict[str, Any] = {
        "op": op,
        "ok": True,
        "error": None,
        "generation": kv_of(new_state).generation,
        "free_blocks": kv_of(new_state).free_blocks,
        "_changed": new_state is not state,
        "_effect": effect,
        **extra,
    }
    return new_state, result, expect


def _failed(state: KVState | SchedState, op: str | None, err: KVError) -> dict[str, Any]:
    result: dict[str, Any] = {
        "op": op,
        "ok": False,
        "error": {"code": err.code.value, "permanent": err.permanent, "message": err.message},
        "generation": kv_of(state).generation,
        "free_blocks": kv_of(state).free_blocks,
        "_changed": False,
    }
    for key in EXTRA_FIELDS.get(op or "", ()):
        result[key] = None
    return result


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
