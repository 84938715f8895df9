"""DiT step batching when things go wrong (issue 35): a failed forward's requests are taken back in one transition
(``fail``: nothing of a failed first step is cached, so a later request of the same prompt computes it; or
``retry``: the step runs again), ``submit`` refuses what admission refuses for good and checks ids before hashing
them, a job refused for good at the head of the queue is ended and the queue moves on, every forward stays within
the budget the worker was built for, and replay (``--page-map`` too) runs every such trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedkv.app.diffusion import DiTStepRunner
from pagedkv.core import RequestSpec, initial_state
from pagedkv.core.scheduler.steps import Budget, DiTJob, DiTState, cancel_job, done, fail, submit_job, tick
from pagedkv.core.spec import RowSpec
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.core.verify.record import row_json
from pagedkv.models.dit import DiT, DiTRow
from pagedkv.shell.attention import get_backend
from pagedkv.shell.rank import build_rank, plan_rank
from tests.core.test_dit_steps import IMAGE, cache_config, request_mode, requests


def job(rid: object, rows: list[DiTRow], steps: int = 3) -> DiTJob:
    return DiTJob(rid, RequestSpec(rid, tuple(r.spec(IMAGE) for r in rows), rows[0].content_key()), steps)  # type: ignore[arg-type]


def step_mode(runner: DiTStepRunner, budget: Budget, count: int = 4) -> tuple[dict[object, list[torch.Tensor]], bool]:
    """The first ``count`` of ``requests()`` through step batching on ``runner`` (its rank's geometry), arriving at
    their ticks: each one's images, and whether a forward held rows at different steps."""
    state, pending, mixed = DiTState.empty(initial_state(runner.rank.cache), budget), requests()[:count], False
    for rid, rows, imgs, steps, _ in pending:
        runner.add(rid, rows, [i.clone() for i in imgs], steps)
    while pending or state.active or state.waiting:
        for item in [p for p in pending if p[4] <= state.tick]:
            state = submit_job(state, job(item[0], item[1], item[3])).unwrap()
            pending.remove(item)
        state, plan = tick(state).unwrap()
        mixed |= any(len(set(f.step_index)) > 1 for f in plan.forwards)
        runner.run(plan)
        state, finished = done(state).unwrap()
        runner.rank.worker.remove(list(finished))
    return {rid: runner.take(rid) for rid, *_ in requests()[:count]}, mixed


def rank(cfg, rows: int = 16, tokens: int = 512):  # type: ignore[no-untyped-def]
    return build_rank(
        plan_rank(DiT().kv_layers(), block_size=4, dtype=torch.float32), cfg, max_rows=rows, max_tokens=tokens
    )


def drive(
    state: DiTState, runner: DiTStepRunner, *, broken: set[object] = frozenset(), retry: bool = False, ticks: int = 50
) -> DiTState:  # type: ignore[assignment]
    """Tick until idle; a forward holding a request of ``broken`` raises (its first time only, with ``retry``)."""
    for _ in range(ticks):
        if not (state.active or state.waiting):
            return state
        state, plan = tick(state).unwrap()
        for f in plan.forwards:
            assert len(f.metadata.rows) <= runner.rank.worker.max_rows  # the worker never refuses a forward
        try:
            for f in plan.forwards:
                if broken & set(f.request_ids):
                    runner.failed_forward = f
                    raise RuntimeError("a device fault")
                runner.run_forward(f)
        except RuntimeError:
            failed = runner.failed_forward.request_ids
            state, finished, ended = fail(state, failed, retry).unwrap()
            broken = broken - set(failed) if retry else broken
            assert (ended == ()) == retry
        else:
            state, finished = done(state).unwrap()
        runner.rank.worker.remove(
            list(finished)
            + [r for r in getattr(runner.failed_forward, "request_ids", ()) if r not in {a[0] for a in state.active}]
        )
        assert check_invariants(state.kv) == []
    raise AssertionError("not idle")


def test_a_failed_first_step_caches_nothing_and_a_retried_one_runs_again() -> None:
    (_, rows, imgs, steps, _), *_ = requests()
    want = request_mode(rows, imgs, steps, rows[0].content_key())
    cfg = cache_config(40)
    runner = DiTStepRunner(DiT(), rank(cfg), get_backend("torch"))
    state = submit_job(DiTState.empty(initial_state(cfg)), job("a", rows, steps)).unwrap()
    runner.add("a", rows, [i.clone() for i in imgs], steps)
    state = drive(state, runner, broken={"a"})
    assert runner.take("a") == [] and state.kv.free_blocks == cfg.usable_blocks
    assert state.kv.prefix_hits == 0 and not state.active
    # the same prompt again: nothing of the failed step is cached (it was 12 tokens before), it computes them all
    state = submit_job(state, job("b", rows, steps)).unwrap()
    runner.add("b", rows, [i.clone() for i in imgs], steps)
    s1, plan = tick(state).unwrap()
    assert [r.kv_start_pos for r in plan.forwards[0].metadata.rows] == [0] * len(rows)
    state = drive(state, runner)
    got = runner.take("b")
    assert len(got) == steps and all(((a - b).abs().max() / b.abs().max()) < 1e-5 for a, b in zip(got, want))
    # retry: the failed first step runs again at the next tick, and the images equal request mode's
    state = submit_job(state, job("c", rows, steps)).unwrap()
    runner.add("c", rows, [i.clone() for i in imgs], steps)
    state = drive(state, runner, broken={"c"}, retry=True)
    got = runner.take("c")
    assert len(got) == steps and all(((a - b).abs().max() / b.abs().max()) < 1e-5 for a, b in zip(got, want))
    assert state.kv.free_blocks == cfg.usable_blocks


def test_fail_is_checked_and_leaves_the_others_going() -> None:
    reqs = requests()[:3]
    cfg = cache_config(60)
    state = DiTState.empty(initial_state(cfg))
    for rid, rows, _, steps, _ in reqs:
        state = submit_job(state, job(rid, rows, steps)).unwrap()
    assert fail(state, ["r0"]).failure().field == "op"  # no tick outstanding
    state, plan = tick(state).unwrap()
    assert fail(state, ["zz"]).failure().field == "requests" and fail(state, []).failure().field == "requests"
    assert fail(state, [["r0"]]).failure().field == "requests"  # an unhashable id: a typed refusal
    s2, finished, ended = fail(state, ["r1"]).unwrap()
    assert ended == ("r1",) and finished == () and [a[0] for a in s2.active] == ["r0", "r2"]
    assert all(d == 1 for _, _, d in s2.active) and not s2.planned  # the others' first steps are done
    assert "r1" not in s2.kv.requests and check_invariants(s2.kv) == []


def test_submit_refuses_what_admission_refuses_for_good_and_checks_ids_first() -> None:
    cfg = cache_config(20)  # 20 usable blocks, max_model_len 64
    state = DiTState.empty(initial_state(cfg), Budget(rows=2, tokens=40))
    rows = [DiTRow((1, 2, 3))]
    state = submit_job(state, job("a", rows)).unwrap()
    spec = job("x", rows).spec
    cases = {
        1.5: ("INVALID", "request"),
        ("a",): ("INVALID", "request"),
        "long": ("UNSCHEDULABLE", None),  # a row past max_model_len
        "rows": ("UNSCHEDULABLE", None),  # 3 CFG rows, a forward holds 2
        "pending": ("INVALID", "rows"),  # KV arriving from elsewhere: the planner has no mark_ready
    }
    for rid, (code, field) in cases.items():
        if rid == "long":
            j = DiTJob(rid, RequestSpec(rid, (RowSpec(70, prefix_len=30, target_len=40),)), 2)
        elif rid == "rows":
            j = DiTJob(rid, RequestSpec(rid, spec.rows * 3), 2)
        elif rid == "pending":
            r = spec.rows[0]
            j = DiTJob(
                rid,
                RequestSpec(
                    rid, (RowSpec(r.num_tokens, prefix_len=r.prefix_len, target_len=r.target_len, pending_tokens=4),)
                ),
                2,
            )
        else:
            j = DiTJob(rid, RequestSpec("b", spec.rows), 2)  # type: ignore[arg-type]
        e = submit_job(state, j).failure()
        assert e.code.value == code and (field is None or e.field == field), (rid, e)
    assert len(state.waiting) == 1 and state.kv.free_blocks == cfg.usable_blocks  # nothing changed
    assert cancel_job(state, ["a"]).failure().field == "request"  # type: ignore[arg-type]


def test_a_job_refused_for_good_at_the_head_is_ended_and_the_queue_moves_on() -> None:
    cfg = cache_config(20)
    rows = [DiTRow((1, 2, 3))]
    bad = DiTJob("bad", RequestSpec("bad", (RowSpec(70, prefix_len=30, target_len=40),)), 2)  # (an older queue's)
    state = DiTState(initial_state(cfg), (bad, job("ok", rows, 2)), ())
    state, plan = tick(state).unwrap()
    assert [(rid, e.code.value) for rid, e in plan.refused] == [("bad", "UNSCHEDULABLE")]
    assert plan.admitted == ("ok",) and [f.request_ids for f in plan.forwards] == [("ok",)]


def test_forwards_stay_within_the_budget_and_a_burst_waits_a_tick() -> None:
    """Six requests (9 rows, first steps of 11-20 tokens) arrive at once; a worker of 3 rows and 40 tokens a
    forward: every forward fits it, at most 3 rows are active, a tick admits at most 40 first-step tokens, and every image equals
    request mode's."""
    reqs = requests()
    want = {rid: request_mode(rows, imgs, steps, rows[0].content_key()) for rid, rows, imgs, steps, _ in reqs}
    cfg = cache_config(60)
    runner = DiTStepRunner(DiT(), rank(cfg, rows=3, tokens=40), get_backend("torch"))
    state = DiTState.empty(initial_state(cfg), Budget(rows=3, tokens=40))
    for rid, rows, imgs, steps, _ in reqs:
        state = submit_job(state, job(rid, rows, steps)).unwrap()
        runner.add(rid, rows, [i.clone() for i in imgs], steps)
    admitted_per_tick = []
    while state.active or state.waiting:
        state, plan = tick(state).unwrap()
        admitted_per_tick.append(len(plan.admitted))
        for f in plan.forwards:
            assert len(f.metadata.rows) <= 3 and sum(r.query_len for r in f.metadata.rows) <= 40
            runner.run_forward(f)
        state, finished = done(state).unwrap()
        runner.rank.worker.remove(list(finished))
    assert max(admitted_per_tick) < len(reqs)  # the burst was spread over ticks
    for rid, *_ in reqs:
        got = runner.take(rid)
        assert len(got) == len(want[rid]) and all(
            ((a - b).abs().max() / b.abs().max()) < 1e-5 for a, b in zip(got, want[rid])
        )
    assert runner.history == {} and runner.work == {}


def test_replay_and_the_page_map_run_fail_refused_and_bad_ids(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the page map needs matplotlib (pip install 'pagedkv[plot]')")
    from pagedkv.app.cli import main

    (_, rows, _, steps, _), *_ = requests()
    spec = job("a", rows, steps).spec
    submit = {
        "op": "submit",
        "rows": [row_json(r) for r in spec.rows],
        "steps": steps,
        "extra_keys": list(spec.extra_keys),
    }
    lines = [
        {
            "pagedkv_trace": 1,
            "config": {
                "block_size": 4,
                "num_blocks": 41,
                "enable_prefix_caching": True,
                "max_model_len": 64,
                "dit_steps": True,
                "max_forward_rows": 4,
            },
        },
        {**submit, "request": "a"},
        {"op": "tick", "expect": {"ok": True, "admitted": ["a"]}},
        {
            "op": "submit",
            **{k: v for k, v in submit.items() if k != "op"},
            "request": ["a", 1],
            "expect": {"ok": False, "error": {"code": "INVALID"}},
        },
        {"op": "fail", "requests": ["a"], "expect": {"ok": True, "failed": ["a"], "finished": []}},
        {**submit, "request": "b"},
        {"op": "tick", "expect": {"ok": True, "forwards": [["prefill", ["b"], [0]]]}},
        {"op": "done"},
    ]
    trace = tmp_path / "steps.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    png = tmp_path / "map.png"
    assert main(["replay", str(trace), "--page-map", str(png), "--check"]) == 0
    assert png.stat().st_size > 0
