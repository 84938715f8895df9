"""Fault and bad-input proofing: malformed events, and a long random soak."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure

from pagedkv.core import (
    CacheConfig,
    ErrorCode,
    RequestSpec,
    RowSpec,
    admit,
    append,
    commit,
    digest,
    free_queue,
    initial_state,
    publish,
    release,
)
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.core.scheduler import (
    SchedState,
    SchedulerConfig,
    SeqRequest,
    cancel,
    new_scheduler,
    on_output,
    sched_digest,
    schedule,
    submit,
)
from pagedkv.core.verify.trace import replay

CODES = {c.value for c in ErrorCode}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# what a JSON reader never gives but a Python caller can: integers past 4,300 digits (their str() raises)
# and past 64 bits, and strings holding lone surrogates (they do not encode as UTF-8)
hostile_values = json_values | st.sampled_from([10**5000, -(10**5000), 2**64, 2**63, "\ud800", "a\udfff"])
OPS = ["admit", "append", "commit", "release", "publish", "reset", "reset_prefix_cache", "fly", None, 3]
FIELDS = ["request", "rows", "tokens", "num_tokens", "computed", "reason", "requests", "phase", "extra_keys", "expect"]


@st.composite
def events(draw: st.DrawFn) -> str:
    """Mostly well-shaped events with wrong values, some garbage, some truncated JSON."""
    kind = draw(st.sampled_from(["event", "event", "event", "garbage", "truncated"]))
    if kind == "garbage":
        return json.dumps(draw(json_values))
    ev: dict[str, Any] = {"op": draw(st.sampled_from(OPS))}
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        ev[key] = draw(json_values)
    if draw(st.booleans()):
        ev["request"] = draw(st.sampled_from(["a", "b", 1]))
        ev["rows"] = [{"num_tokens": draw(st.integers(-3, 40))}]
    line = json.dumps(ev)
    return line[: draw(st.integers(0, len(line)))] if kind == "truncated" else line


@pytest.mark.slow
@given(st.lists(events(), max_size=25))
def test_malformed_events_get_typed_errors_and_change_nothing(lines: list[str]) -> None:
    header = json.dumps(
        {"pagedkv_trace": 1, "config": {"block_size": 2, "num_blocks": 9, "enable_prefix_caching": True}}
    )
    previous = None
    for ev in replay([header, *lines]):
        r = ev.result
        assert set(r) >= {"i", "op", "ok", "error", "generation", "free_blocks", "digest"}
        if not r["ok"]:
            assert r["error"]["code"] in CODES and r["error"]["message"].startswith(f"line {ev.line}: ")
            if previous is not None:
                assert (r["digest"], r["generation"], r["free_blocks"]) == previous
        previous = (r["digest"], r["generation"], r["free_blocks"])
        assert check_invariants(ev.state) == []  # type: ignore[arg-type]


@pytest.mark.slow
@given(rid=hostile_values, rows=hostile_values, counts=hostile_values, reason=hostile_values, phase=hostile_values)
def test_transitions_refuse_wrong_types_with_typed_errors(
    rid: Any, rows: Any, counts: Any, reason: Any, phase: Any
) -> None:
    """Issue 17, defect 7: ids, counts and token ids over 4,300 digits raised ValueError while the message
    (or the hash) was made; every input is a Success or a typed Failure."""
    s = initial_state(CacheConfig(block_size=2, num_blocks=9))
    s = admit(s, RequestSpec("a", (RowSpec(3),))).unwrap().state
    before = digest(s)
    sched = new_scheduler(CacheConfig(block_size=2, num_blocks=9), SchedulerConfig())
    tokens = counts if isinstance(counts, list) else [counts]
    calls = [
        lambda: admit(s, RequestSpec("b", (RowSpec(len(tokens), tokens=tuple(tokens)),))),
        lambda: admit(s, RequestSpec("b", (RowSpec(counts),))),  # type: ignore[arg-type]
        lambda: submit(sched, SeqRequest(rid, tuple(tokens), max_tokens=counts)),  # type: ignore[arg-type]
        lambda: cancel(sched, rid),
        lambda: cancel(sched, rid, reason),
        lambda: admit(s, RequestSpec(rid, rows if isinstance(rows, tuple) else (RowSpec(rows),))),  # type: ignore[arg-type]
        lambda: append(s, rid, counts),
        lambda: append(s, "a", counts),
        lambda: commit(s, "a", counts),
        lambda: release(s, rid, reason),
        lambda: publish(s, rows, phase),
    ]
    for call in calls:
        result = call()  # never an exception: a typed refusal or a success
        if isinstance(result, Failure):
            assert result.failure().code.value in CODES and result.failure().message
        elif isinstance(result.unwrap(), SchedState):
            sched_digest(result.unwrap())  # a state it took can be digested (and so recorded and replayed)
    assert digest(s) == before


@pytest.mark.slow
def test_soak_ten_thousand_random_events_leave_every_block_free() -> None:
    rng = random.Random(1234)
    cache = CacheConfig(block_size=4, num_blocks=13, enable_prefix_caching=True)
    s = new_scheduler(cache, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32))
    ids = iter(range(10**6))
    preempted = cancelled = 0
    for _ in range(10_000):
        roll = rng.random()
        if roll < 0.25:
            base = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]])
            prompt = tuple(
                base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(4))]
            )
            s = submit(s, SeqRequest(next(ids), prompt, max_tokens=rng.randrange(1, 12))).unwrap()
        elif roll < 0.30 and s.live:
            victim = rng.choice(sorted(s.live.keys()))
            s = cancel(s, victim, rng.choice(["cancelled", "error"])).unwrap()
            cancelled += 1
        else:
            if s.pending_output:
                sampled = {rid: rng.randrange(50) for rid in plan.samples if rid in s.live}  # (not one cancelled since)
                stop = [r for r in sampled if rng.random() < 0.05]
                s, _ = on_output(s, sampled, stop).unwrap()
            else:
                s, plan = schedule(s).unwrap()
                preempted += len(plan.preempted)
    if s.pending_output:
        s, _ = on_output(s, {rid: 1 for rid in plan.samples if rid in s.live}).unwrap()
    for rid in sorted(s.live.keys()):
        s = cancel(s, rid).unwrap()
    assert preempted > 0 and cancelled > 0, (preempted, cancelled)
    assert check_invariants(s.kv) == []
    assert not s.kv.requests and s.kv.free_blocks == 12
    queue = free_queue(s.kv)
    assert sorted(queue) == list(range(1, 13))  # every usable block exactly once
