"""Step-level continuous batching of DiT requests (core.scheduler.steps, app.diffusion.DiTStepRunner): every
request's image after every step equals request mode's (each request alone through DiTRunner), with requests
arriving at different ticks, CFG and single-row requests mixed, one cancelled mid-way, and a pool small
enough that some wait; rows of requests at different steps run in one forward."""

from __future__ import annotations

import pytest
import torch

from pagedkv.app.diffusion import DiTRunner, DiTStepRunner
from pagedkv.core import CacheConfig, RequestSpec, admit, initial_state, publish
from pagedkv.core.scheduler.steps import DiTJob, DiTState, cancel_job, done, submit_job, tick
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.models.dit import DiT, DiTRow
from pagedkv.shell.attention import get_backend
from pagedkv.shell.rank import build_rank, plan_rank

IMAGE = 6


def requests() -> list[tuple[str, list[DiTRow], list[torch.Tensor], int, int]]:
    """(id, rows, images, steps, arrival tick): CFG (2 rows) and single-row, some with a reference image."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(6):
        ref = torch.randn(4, 8, generator=g) if i % 3 == 1 else None
        text = tuple(int(x) for x in torch.randint(0, 128, (5 + i,), generator=g))
        rows = [DiTRow(text, ref), DiTRow(text[:2], ref)] if i % 2 == 0 else [DiTRow(text, ref)]
        img = torch.randn(IMAGE, 8, generator=g)
        out.append((f"r{i}", rows, [img.clone() for _ in rows], 3 + i % 3, i // 2))
    return out


def cache_config(blocks: int) -> CacheConfig:
    return CacheConfig(block_size=4, num_blocks=blocks + 1, enable_prefix_caching=True, max_model_len=64)


def rank_for(cfg: CacheConfig):  # type: ignore[no-untyped-def]
    return build_rank(plan_rank(DiT().kv_layers(), block_size=4, dtype=torch.float32), cfg, max_rows=16, max_tokens=512)


def request_mode(
    rows: list[DiTRow], images: list[torch.Tensor], steps: int, extra: tuple[str, ...]
) -> list[torch.Tensor]:
    cfg = cache_config(40)
    s = admit(initial_state(cfg), RequestSpec("x", tuple(r.spec(IMAGE) for r in rows), extra)).unwrap().state
    first = publish(s, ["x"], "prefill").unwrap().effect
    later = publish(s, ["x"], "denoise").unwrap().effect
    return DiTRunner(DiT(), rank_for(cfg), get_backend("torch")).run(
        rows, [i.clone() for i in images], steps, first, later
    )


@pytest.mark.parametrize("blocks", [60, 24])  # 24: the pool holds three or four requests at once, the rest wait
def test_step_batching_equals_request_mode_for_every_request_every_step(blocks: int) -> None:
    reqs = requests()
    want = {rid: request_mode(rows, imgs, steps, rows[0].content_key()) for rid, rows, imgs, steps, _ in reqs}
    cfg = cache_config(blocks)
    rank = rank_for(cfg)
    runner = DiTStepRunner(DiT(), rank, get_backend("torch"))
    state = DiTState.empty(initial_state(cfg))
    pending = list(reqs)
    cancelled, waited, mixed = "r3", False, False
    while pending or state.active or state.waiting:
        for item in [p for p in pending if p[4] <= state.tick]:
            rid, rows, imgs, steps, _ = item
            runner.add(rid, rows, [i.clone() for i in imgs], steps)
            state = submit_job(
                state, DiTJob(rid, RequestSpec(rid, tuple(r.spec(IMAGE) for r in rows), rows[0].content_key()), steps)
            ).unwrap()
            pending.remove(item)
        if state.tick == 3 and any(rid == cancelled for rid, _, _ in state.active):
            state = cancel_job(state, cancelled).unwrap()  # between ticks, mid-way through its steps
            rank.worker.remove([cancelled])
        state, plan = tick(state).unwrap()
        waited |= bool(state.waiting)
        mixed |= any(len(set(f.step_index)) > 1 for f in plan.forwards)  # rows at different steps, one forward
        runner.run(plan)
        state, finished = done(state).unwrap()
        rank.worker.remove(list(finished))
        assert check_invariants(state.kv) == []
    assert mixed and (waited or blocks == 60)
    for rid, *_ in reqs:
        got = runner.history[rid]
        assert (len(got) < len(want[rid])) == (rid == cancelled)
        for a, b in zip(got, want[rid]):
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5, rid
    assert state.kv.free_blocks == cfg.usable_blocks  # every block back, the cancelled request's too
    assert runner.forwards < sum(len(h) for h in runner.history.values())  # batched: fewer forwards than steps


def test_submit_checks_the_job() -> None:
    state = DiTState.empty(initial_state(cache_config(20)))
    rows = [DiTRow((1, 2, 3))]
    spec = RequestSpec("a", tuple(r.spec(IMAGE) for r in rows))
    state = submit_job(state, DiTJob("a", spec, 2)).unwrap()
    assert submit_job(state, DiTJob("a", spec, 2)).failure().field == "request"
    assert submit_job(state, DiTJob("b", RequestSpec("b", spec.rows), 0)).failure().field == "steps"
    from pagedkv.core.spec import RowSpec

    assert submit_job(state, DiTJob("c", RequestSpec("c", (RowSpec(4),)), 2)).failure().field == "rows"
    assert cancel_job(state, "zzz").failure().code.value == "UNKNOWN_REQUEST"
    assert cancel_job(state, "a", "oops").failure().field == "reason"
    state, _ = tick(state).unwrap()
    assert tick(state).failure().field == "op"  # a tick before the last one's done
    assert cancel_job(state, "a").failure().field == "op"  # a cancel comes between ticks
    state, _ = done(state).unwrap()
    failed = cancel_job(state, "a", "error").unwrap()  # its step failed: released, every block back
    assert not failed.active and failed.kv.free_blocks == failed.kv.config.usable_blocks


def test_a_step_batching_trace_replays_event_for_event() -> None:
    """The planner's events as a trace (header ``"dit_steps": true``; ops submit, tick, done, cancel), each with
    what it gave as its expect: replay reproduces every one, invariants hold after each, and a changed
    expect is reported at its line."""
    import json

    from pagedkv.core.verify.record import row_json
    from pagedkv.core.verify.trace import replay

    cfg = cache_config(24)
    header = {
        "pagedkv_trace": 1,
        "config": {
            "block_size": 4,
            "num_blocks": 25,
            "enable_prefix_caching": True,
            "max_model_len": 64,
            "dit_steps": True,
        },
    }
    lines = [header]
    state = DiTState.empty(initial_state(cfg))
    pending = list(requests())
    while pending or state.active or state.waiting:
        for item in [p for p in pending if p[4] <= state.tick]:
            rid, rows, _, steps, _ = item
            spec = RequestSpec(rid, tuple(r.spec(IMAGE) for r in rows), rows[0].content_key())
            state = submit_job(state, DiTJob(rid, spec, steps)).unwrap()
            ev = {"op": "submit", "request": rid, "rows": [row_json(r) for r in spec.rows], "steps": steps}
            if spec.extra_keys:
                ev["extra_keys"] = list(spec.extra_keys)
            lines.append(ev)
            pending.remove(item)
        if state.tick == 3 and any(rid == "r3" for rid, _, _ in state.active):
            state = cancel_job(state, "r3").unwrap()
            lines.append({"op": "cancel", "request": "r3"})
        state, plan = tick(state).unwrap()
        forwards = [[f.phase, list(f.request_ids), list(f.step_index)] for f in plan.forwards]
        lines.append(
            {
                "op": "tick",
                "expect": {
                    "ok": True,
                    "forwards": forwards,
                    "admitted": list(plan.admitted),
                    "free_blocks": state.kv.free_blocks,
                },
            }
        )
        state, finished = done(state).unwrap()
        lines.append({"op": "done", "expect": {"ok": True, "finished": list(finished)}})
    lines.append({"op": "tick", "expect": {"ok": True, "forwards": [], "free_blocks": cfg.usable_blocks}})
    lines.append({"op": "done", "expect": {"ok": True, "finished": []}})
    lines.append({"op": "schedule", "expect": {"ok": False, "error": {"code": "INVALID"}}})  # not this trace's op
    text = [json.dumps(x) for x in lines]
    results = list(replay(text, check=True))
    assert len(results) == len(lines) - 1
    assert all(r.divergence is None and not r.violations for r in results), [r.divergence for r in results]
    k = next(i for i, x in enumerate(lines) if x.get("op") == "done" and x["expect"]["finished"])
    bad = json.loads(text[k])
    bad["expect"]["finished"] = ["nobody"]
    text[k] = json.dumps(bad)
    assert next(r for r in replay(text) if r.divergence).line == k + 1
