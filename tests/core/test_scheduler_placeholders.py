"""The scheduler planning ahead of its ids (overlapped scheduling, issue 32): ``on_output`` with ``None`` for a
token not read yet, the next ``schedule`` growing such rows by a placeholder, ``on_tokens`` giving the ids (and
ending requests that stopped on them) while that plan is in flight. Against a stand-in model, every run ahead
(through preemption, prefix caching, stop tokens and ``max_tokens``) gives the outputs of the run that waits,
keeps the invariants after every transition, and gives every block back."""

from __future__ import annotations

import random

import pytest
from returns.result import Failure

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, commit, initial_state
from pagedkv.core.rules.growth import Placeholders, append
from pagedkv.core.rules.placeholders import fill, fill_many
from pagedkv.core.scheduler import (
    SchedState,
    SchedulerConfig,
    SeqRequest,
    new_scheduler,
    on_output,
    on_tokens,
    schedule,
    submit,
)
from pagedkv.core.scheduler.digest import sched_digest
from pagedkv.core.store.state import row_known
from pagedkv.core.verify.invariants import check_invariants
from tests.core.test_scheduler import llm, model

STOP = 7  # the stand-in model's stop token


def _truth(s: SchedState, rid: object) -> int:
    return model(s.live[rid].prompt + s.live[rid].output)


def serve(cfg: CacheConfig, sched: SchedulerConfig, reqs: list[SeqRequest], ahead: bool) -> dict[object, list[int]]:
    """Every request to its end; the outputs the engine would hand out (a stop token included)."""
    s = new_scheduler(cfg, sched)
    for q in reqs:
        s = submit(s, q).unwrap()
    out: dict[object, list[int]] = {}
    pending: dict[object, int] | None = None
    for _ in range(1000):
        plan = None
        if s.live:
            s, plan = schedule(s).unwrap()
        if pending is not None:  # the last step's ids come back while this plan is in flight
            s, _ = on_tokens(s, pending, [r for r, t in pending.items() if t == STOP]).unwrap()
            assert check_invariants(s.kv) == []
            pending = None
        if plan is None:
            break
        toks = {rid: _truth(s, rid) for rid in plan.samples if rid in s.live}
        for rid, t in toks.items():
            out.setdefault(rid, []).append(t)
        if ahead:
            s, _ = on_output(s, {rid: None for rid in toks}).unwrap()
            pending = toks
        else:
            s, _ = on_output(s, toks, [r for r, t in toks.items() if t == STOP]).unwrap()
        assert check_invariants(s.kv) == []
    assert not s.live and s.kv.free_blocks == s.kv.config.usable_blocks and not s.awaiting
    return out


@pytest.mark.parametrize("seed", range(40))
def test_planning_ahead_gives_the_outputs_of_waiting(seed: int) -> None:
    r = random.Random(seed)
    cfg = CacheConfig(
        block_size=r.choice([2, 4]),
        num_blocks=r.choice([20, 40, 200]),
        enable_prefix_caching=seed % 2 == 0,
        max_model_len=r.choice([None, 30]),
    )
    sched = SchedulerConfig(max_num_seqs=r.randint(1, 5), max_num_batched_tokens=r.choice([8, 16, 64]))
    reqs = [
        llm(f"r{i}", r.randint(3, 14), max_tokens=r.randint(1, 24), base=r.choice([0, 100]) + i)
        for i in range(r.randint(2, 6))
    ]
    assert serve(cfg, sched, reqs, True) == serve(cfg, sched, reqs, False)


def test_ahead_refusals_leave_the_state_as_it_was() -> None:
    s = new_scheduler(CacheConfig(block_size=4, num_blocks=40, enable_prefix_caching=True))
    s = submit(s, llm("a", 6, max_tokens=20)).unwrap()
    s = submit(s, llm("b", 5, max_tokens=20)).unwrap()
    s, _ = schedule(s).unwrap()
    s, _ = on_output(s, {"a": None, "b": 3}).unwrap()
    assert s.awaiting == {"a"} and s.log.count("a") == 1
    s2, plan = schedule(s).unwrap()  # "a" grows by a placeholder
    row = s2.kv.requests["a"].slots[0]
    assert plan.decode == ("a", "b") and s2.kv.row_len[row] == 7
    before = sched_digest(s2)
    assert isinstance(on_output(s2, {"a": None, "b": 4}), Failure)  # "a" still awaits its last id
    assert isinstance(on_tokens(s2, {"b": 1}), Failure)  # the id "a" awaits is missing
    assert isinstance(on_tokens(s2, {"a": -1}), Failure)
    assert sched_digest(s2) == before
    s3, ended = on_tokens(s2, {"a": 11, "zz": 4}, ["a"]).unwrap()  # "a" stopped on it: gone from the plan in flight
    assert ended == (("a", "finished"),) and s3.sched_decode == ("b",) and "a" not in s3.live and not s3.awaiting
    s4, _ = on_output(s3, {"b": 5}).unwrap()
    assert s4.live["b"].output == (3, 5) and not check_invariants(s4.kv)


def test_a_run_ahead_is_a_trace_that_replays() -> None:
    """The recorder's lines for a run ahead (outputs with null tokens, tokens events) replay digest for digest."""
    import io

    from pagedkv.core.verify.trace import replay
    from pagedkv.shell.recorder import Recorder

    cfg, sched = CacheConfig(block_size=2, num_blocks=20, enable_prefix_caching=True), SchedulerConfig(max_num_seqs=3)
    out = io.StringIO()
    rec = Recorder(out, cfg, sched)
    s = new_scheduler(cfg, sched)
    for q in [llm(f"r{i}", 5 + i, max_tokens=9, base=3 * i) for i in range(4)]:
        s = submit(s, q).unwrap()
        rec.submit(q, s)
    pending = None
    while s.live or pending:
        plan = None
        if s.live:
            s, plan = schedule(s).unwrap()
            rec.schedule(s, plan)
        if pending is not None:
            stops = [r for r, t in pending.items() if t == STOP]
            s, ended = on_tokens(s, pending, stops).unwrap()
            rec.tokens(pending, stops, s, ended)
            pending = None
        if plan is None:
            break
        toks = {rid: _truth(s, rid) for rid in plan.samples if rid in s.live}
        s, ended = on_output(s, {rid: None for rid in toks}).unwrap()
        rec.output({rid: None for rid in toks}, (), s, ended)
        pending = toks
    rec.end()
    lines = out.getvalue().splitlines()
    assert any('"op": "tokens"' in x for x in lines) and any("null" in x for x in lines)
    results = list(replay(lines, check=True))
    assert len(results) == len(lines) - 1 and all(r.divergence is None and not r.violations for r in results)


def test_fill_many_awaiting_only_skips_a_row_that_awaits_nothing() -> None:
    """``on_tokens``' fill: a row that grew by a placeholder takes its id; one that did not grow since (not scheduled
    in the step after) takes nothing, where ``fill`` refuses an id no position awaits; a row that keeps no ids
    likewise; the state is the plain ``fill``'s for the row that grew."""
    s = initial_state(CacheConfig(block_size=2, num_blocks=16, enable_prefix_caching=True))
    for rid in ("grew", "still"):
        s = admit(s, RequestSpec(rid, (RowSpec.of_tokens([1, 2, 3]),))).unwrap().state
        s = commit(s, rid, [3]).unwrap().state
    s = admit(s, RequestSpec("count", (RowSpec(3),))).unwrap().state  # (a row of a count: it keeps no ids)
    s = append(s, "grew", [Placeholders(1)]).unwrap().state
    assert isinstance(fill_many(s, [("still", [[9]])]), Failure)  # (plain: an id no position awaits is refused)
    assert isinstance(fill_many(s, [("count", [[9]])]), Failure)
    step = fill_many(s, [("grew", [[9]]), ("still", [[9]]), ("count", [[9]])], awaiting_only=True).unwrap()
    alone = fill(s, "grew", [[9]]).unwrap().state
    slot = {rid: step.state.requests[rid].slots[0] for rid in ("grew", "still", "count")}
    assert row_known(step.state, slot["grew"]) == 4 == row_known(alone, slot["grew"])
    assert row_known(step.state, slot["still"]) == row_known(s, slot["still"]) == 3
    assert step.state.row_len[slot["count"]] == s.row_len[slot["count"]]
    assert len(step.state.cache) == len(alone.cache) and check_invariants(step.state) == []
