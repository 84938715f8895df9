"""The pure scheduler."""

from __future__ import annotations

import hashlib
from typing import Any

from returns.result import Failure

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from pagedkv.core import CacheConfig, GroupKind, GroupSpec, RowSpec, digest
from pagedkv.core.config import InvalidConfig
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.core.scheduler import (
    SchedState,
    SchedulerConfig,
    SeqRequest,
    cancel,
    new_scheduler,
    on_output,
    schedule,
    submit,
)


def model(tokens: tuple[int, ...]) -> int:
    """A deterministic stand-in for a model: the next token is a function of the whole sequence."""
    return hashlib.blake2b(repr(tokens).encode(), digest_size=2).digest()[0] % 50


ENDED: dict[object, str] = {}  # how each request of the last ``run`` ended (the state keeps live requests only)


def run(state: SchedState, max_steps: int = 200) -> tuple[SchedState, dict[object, tuple[int, ...]], list[object]]:
    outputs: dict[object, tuple[int, ...]] = {}
    preempted: list[object] = []
    ENDED.clear()
    for _ in range(max_steps):
        state, plan = schedule(state).unwrap()
        ENDED.update(plan.finished)
        preempted += plan.preempted
        assert plan.num_tokens <= state.config.max_num_batched_tokens or len(plan.diffusion) == 1
        sampled = {rid: model(state.live[rid].prompt + state.live[rid].output) for rid in plan.samples}
        for rid in sampled:
            outputs[rid] = state.live[rid].output + (sampled[rid],)
        state, ended = on_output(state, sampled).unwrap()
        ENDED.update(ended)
        assert check_invariants(state.kv) == []
        if not state.live:
            break
    return state, outputs, preempted


def llm(rid: str, n: int, max_tokens: int = 8, base: int = 0) -> SeqRequest:
    return SeqRequest(rid, tuple(range(base, base + n)), max_tokens=max_tokens)


def test_budget_decodes_first_and_chunked_prefill() -> None:
    s = new_scheduler(CacheConfig(block_size=4, num_blocks=33), SchedulerConfig(max_num_batched_tokens=8))
    s = submit(s, llm("a", 6)).unwrap()
    s = submit(s, llm("b", 12)).unwrap()
    s, plan = schedule(s).unwrap()
    assert plan.prefill == (("a", 6), ("b", 2)) and plan.decode == ()
    assert [r.query_len for r in plan.metadata[0].rows] == [6, 2]
    assert [r.seq_len for r in plan.metadata[0].rows] == [6, 2]  # keys end where the chunk ends
    s, _ = on_output(s, {"a": 7}).unwrap()
    s, plan = schedule(s).unwrap()
    assert plan.decode == ("a",) and plan.prefill == (("b", 7),)
    assert plan.metadata[1].rows[0].kv_start_pos == 6


def test_preemption_by_recompute_leaves_outputs_unchanged() -> None:
    reqs = [llm(f"r{i}", 5 + i, max_tokens=10, base=10 * i) for i in range(4)]
    roomy = new_scheduler(CacheConfig(block_size=2, num_blocks=101, enable_prefix_caching=True))
    tight = new_scheduler(CacheConfig(block_size=2, num_blocks=16, enable_prefix_caching=True))
    for r in reqs:
        roomy, tight = submit(roomy, r).unwrap(), submit(tight, r).unwrap()
    roomy, out_roomy, pre_roomy = run(roomy)
    tight, out_tight, pre_tight = run(tight)
    assert pre_roomy == [] and len(pre_tight) >= 1, pre_tight
    assert out_tight == out_roomy and all(len(o) == 10 for o in out_tight.values())
    assert ENDED == {r.request_id: "finished" for r in reqs}
    assert tight.kv.free_blocks == 15 and roomy.kv.free_blocks == 100


def test_the_newest_running_request_is_preempted_and_goes_to_the_front() -> None:
    s = new_scheduler(CacheConfig(block_size=2, num_blocks=5))  # 4 usable blocks
    s = submit(s, llm("old", 4, max_tokens=5)).unwrap()
    s = submit(s, llm("new", 4, max_tokens=5)).unwrap()
    s = submit(s, llm("later", 1, max_tokens=1)).unwrap()
    s, plan = schedule(s).unwrap()
    assert plan.prefill == (("old", 4), ("new", 4))
    s, _ = on_output(s, {"old": 1, "new": 2}).unwrap()
    s, plan = schedule(s).unwrap()  # old's 5th token needs a block: new is preempted
    assert plan.preempted == ("new",) and plan.decode == ("old",)
    assert list(s.waiting) == ["new", "later"]
    assert s.live["new"].output == (2,)  # resumes from prompt + (2,)


def test_no_capacity_waits_at_the_head_unless_overtaking_is_allowed() -> None:
    for overtaking, admitted in ((False, ()), (True, (("small", 2),))):
        s = new_scheduler(CacheConfig(block_size=2, num_blocks=6), SchedulerConfig(allow_overtaking=overtaking))
        s = submit(s, llm("a", 6)).unwrap()
        s, _ = schedule(s).unwrap()
        s, _ = on_output(s, {"a": 1}).unwrap()
        s = submit(s, llm("big", 6)).unwrap()
        s = submit(s, llm("small", 2)).unwrap()
        s, plan = schedule(s).unwrap()
        assert plan.prefill == admitted
        assert s.waiting.left == "big"


def test_unschedulable_ends_the_request_with_that_code() -> None:
    s = new_scheduler(CacheConfig(block_size=2, num_blocks=4))
    s = submit(s, llm("huge", 40)).unwrap()
    s = submit(s, llm("ok", 2)).unwrap()
    s, plan = schedule(s).unwrap()
    assert plan.finished == (("huge", "UNSCHEDULABLE"),) and plan.prefill == (("ok", 2),)
    assert "huge" not in s.live and "huge" not in s.kv.requests  # (ended: no record of it is kept)
    assert [e.message for e in plan.refusals] == ["request 'huge' needs 20 blocks; the pool has 3 usable blocks in all"]


WINDOWS = (
    GroupSpec("full"),
    GroupSpec("w1", GroupKind.SLIDING_WINDOW, window=4),
    GroupSpec("w2", GroupKind.SLIDING_WINDOW, window=4),
)


@pytest.mark.parametrize("usable", range(15, 24))
@pytest.mark.parametrize("second_at", [3, 30])  # while the first prefills, and after it finished
def test_a_prompt_that_hits_its_own_cached_prefix_under_windows_is_served(usable: int, second_at: int) -> None:
    """Issue 28: a 36-token prompt's second copy hits 32 tokens; its window groups then hold two blocks each,
    not nine. The old admission counted every group whole (9 x 3 = 27 blocks) and refused it for good at every
    pool size from 16 blocks up, though it runs alone in each."""
    s = new_scheduler(
        CacheConfig(block_size=4, num_blocks=usable + 1, groups=WINDOWS, enable_prefix_caching=True),
        SchedulerConfig(max_num_batched_tokens=4, grow_prefill=True),
    )
    prompt = tuple(range(1, 37))
    s = submit(s, SeqRequest("a", prompt, max_tokens=2)).unwrap()
    hits, ends = {}, {}
    for step in range(300):
        if step == second_at:
            s = submit(s, SeqRequest("b", prompt, max_tokens=2)).unwrap()
        s, plan = schedule(s).unwrap()
        assert plan.finished == (), plan.refusals
        for meta in plan.metadata:
            hits.update((r.request_id, r.kv_start_pos) for r in meta.rows if r.request_id not in hits)
        s, ended = on_output(s, {r: 7 for r in plan.samples}).unwrap()
        ends.update(ended)
        assert check_invariants(s.kv) == []
        if step > second_at and not s.live:
            break
    assert ends == {"a": "finished", "b": "finished"}
    if second_at == 30 and usable > 15:  # (at 15 blocks the first's own window blocks are reused as it runs)
        assert hits["b"] == 32  # it ran on its own cached prefix


def test_diffusion_runs_at_request_level_with_its_phases() -> None:
    rows = (
        RowSpec(10, prefix_len=6, target_len=4, spans=((6, 10),)),
        RowSpec(8, prefix_len=4, target_len=4, spans=((4, 8),)),
    )
    s = new_scheduler(CacheConfig(block_size=4, num_blocks=13))
    s = submit(s, SeqRequest("img", rows=rows, steps=3)).unwrap()
    s, plan = schedule(s).unwrap()
    (run_,) = plan.diffusion
    assert run_.phases == ("prefill", "denoise", "denoise")
    assert [r.query_len for r in run_.first.rows] == [10, 8]
    assert run_.later is not None and [(r.kv_start_pos, r.query_len) for r in run_.later.rows] == [(6, 4), (4, 4)]
    assert s.kv.free_blocks == 7
    s, ended = on_output(s, {}).unwrap()
    assert ended == (("img", "finished"),) and s.kv.free_blocks == 12


def test_cancel_and_error_release_everything() -> None:
    s = new_scheduler(CacheConfig(block_size=2, num_blocks=20))
    s = submit(s, llm("a", 5)).unwrap()
    s = submit(s, llm("b", 5)).unwrap()
    s = submit(s, llm("w", 5)).unwrap()
    s, _ = schedule(s).unwrap()
    s = cancel(s, "a").unwrap()
    s = cancel(s, "w").unwrap()
    s = cancel(s, "b", "error").unwrap()
    assert s.kv.free_blocks == 19 and not s.live and not s.pending_output
    assert isinstance(cancel(s, "a"), Failure)


def test_refusals_change_nothing() -> None:
    s = new_scheduler(CacheConfig(block_size=2, num_blocks=20))
    s = submit(s, llm("a", 5)).unwrap()
    assert submit(s, llm("a", 5)).failure().code.value == "DUPLICATE_REQUEST"
    assert submit(s, SeqRequest("e", ())).failure().code.value == "INVALID"
    s, _ = schedule(s).unwrap()
    before = digest(s.kv)
    assert schedule(s).failure().code.value == "INVALID"  # the last plan awaits its on_output
    assert on_output(s, {}).failure().field == "sampled"
    assert digest(s.kv) == before


def test_a_long_prefill_threshold_caps_each_requests_chunk_and_rides_the_trace_header() -> None:
    """vLLM's ``long_prefill_token_threshold``: one request's chunk takes at most that many prompt tokens a step,
    whatever the budget leaves (the next request's chunk takes the rest); the outputs are those without the cap.
    A trace header carries it only when set, and reads back to the same config."""
    import json

    from pagedkv.core.config import InvalidConfig
    from pagedkv.core.verify.record import scheduler_header
    from pagedkv.core.verify.trace import parse_trace_header

    cache = CacheConfig(block_size=4, num_blocks=65)
    capped = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=16)
    s = new_scheduler(cache, capped)
    s = submit(s, llm("a", 50)).unwrap()
    s = submit(s, llm("b", 10, base=60)).unwrap()
    s, plan = schedule(s).unwrap()
    assert plan.prefill == (("a", 16), ("b", 10))  # (64 tokens of budget: a's chunk capped, b's whole)
    s, _ = on_output(s, {"b": 1}).unwrap()
    s, plan = schedule(s).unwrap()
    assert plan.decode == ("b",) and plan.prefill == (("a", 16),)
    free = new_scheduler(cache, SchedulerConfig(max_num_batched_tokens=64))
    outs = {}
    for name, state in (("capped", new_scheduler(cache, capped)), ("free", free)):
        for r in (llm("a", 50), llm("b", 10, base=60)):
            state = submit(state, r).unwrap()
        outs[name] = run(state)[1]
    assert outs["capped"] == outs["free"]
    header = scheduler_header(cache, capped)
    assert header["config"]["scheduler"]["long_prefill_token_threshold"] == 16
    assert parse_trace_header(json.dumps(header))[1] == capped
    assert "long_prefill_token_threshold" not in scheduler_header(cache, SchedulerConfig())["config"]["scheduler"]
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidConfig, match="long_prefill_token_threshold"):
            SchedulerConfig(long_prefill_token_threshold=bad)  # type: ignore[arg-type]


LAYOUTS = {
    "full": (GroupSpec("full"),),
    "windows": WINDOWS,
    "window8": (GroupSpec("full"), GroupSpec("w", GroupKind.SLIDING_WINDOW, window=8)),
    "chunked": (GroupSpec("full"), GroupSpec("c", GroupKind.CHUNKED_LOCAL, chunk=8)),
    "mamba": (GroupSpec("mamba", GroupKind.MAMBA), GroupSpec("full")),
    "mamba_align": (GroupSpec("full"), GroupSpec("mamba", GroupKind.MAMBA_ALIGN)),
}


def served(cache: CacheConfig, sched: SchedulerConfig, reqs: list[SeqRequest], later: int) -> dict[object, object]:
    """How each of ``reqs`` ended through the scheduler (the second half submitted ``later`` steps in), and what
    each generated: ``{id: (reason, output)}``."""
    s = new_scheduler(cache, sched)
    first, rest = reqs[: max(1, len(reqs) // 2)], reqs[max(1, len(reqs) // 2) :]
    for r in first:
        s = submit(s, r).unwrap()
    ends: dict[object, object] = {}
    outputs: dict[object, tuple[int, ...]] = {}
    for step in range(3000):
        if step == later:
            for r in rest:
                s = submit(s, r).unwrap()
        s, plan = schedule(s).unwrap()
        ends.update(plan.finished)
        sampled = {rid: model(s.live[rid].prompt + s.live[rid].output) for rid in plan.samples}
        for rid, tok in sampled.items():
            outputs[rid] = s.live[rid].output + (tok,)
        s, ended = on_output(s, sampled).unwrap()
        ends.update(ended)
        assert check_invariants(s.kv) == []
        if step >= later and not s.live:
            break
    else:
        raise AssertionError(f"not done after 3000 steps: {sorted(map(str, s.live))} live")
    return {rid: (ends[rid], outputs.get(rid, ())) for rid in ends}


@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    usable=st.integers(4, 28),
    grow_prefill=st.booleans(),
    caching=st.booleans(),
    budget=st.sampled_from([4, 8, 16, 64]),
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)), min_size=2, max_size=4),
    later=st.integers(0, 12),
)
@example(  # (a hit that needs more blocks than the pool: an align-mode state group's; served without it now)
    layout="mamba_align",
    usable=11,
    grow_prefill=False,
    caching=True,
    budget=4,
    lengths=[(4, 1, 0), (37, 1, 0)],
    later=0,
)
@example(  # (a preempted request whose whole sequence no longer fits: readmitted a chunk at a time now)
    layout="window8", usable=16, grow_prefill=False, caching=True, budget=4, lengths=[(31, 7, 0), (31, 6, 0)], later=0
)
def test_a_request_served_alone_in_the_empty_pool_is_served_in_company(
    layout: str, usable: int, grow_prefill: bool, caching: bool, budget: int, lengths: list[Any], later: int
) -> None:
    """Issue 60: under ``grow_prefill`` with window groups, a 36-token prompt that ran alone in a pool of 16 blocks
    was ended ``UNSCHEDULABLE`` in company: issue 45's rule ended it when it ran short instead of preempting a newer
    request. Whatever the pool, the groups and the company, a request that is served alone is served, with the same
    tokens."""
    try:
        cache = CacheConfig(block_size=4, num_blocks=usable + 1, groups=LAYOUTS[layout], enable_prefix_caching=caching)
    except InvalidConfig:
        assume(False)
    sched = SchedulerConfig(max_num_batched_tokens=budget, grow_prefill=grow_prefill)
    reqs = [llm(f"r{i}", n, max_tokens=m, base=100 * b) for i, (n, m, b) in enumerate(lengths)]
    together = served(cache, sched, reqs, later)
    for r in reqs:
        alone = served(cache, sched, [r], 0)[r.request_id]
        if alone[0] == "finished":
            assert together[r.request_id] == alone, (r.request_id, together)
