"""The DiT step planner (core.scheduler.steps) as a state machine: submit, tick, done, fail (with and without
retry) and cancel in any order, under a random forward budget. After every step the core's invariants hold,
every forward fits the budget and the worker's rows, the queues agree with the core, an idle pool has every block
back, and a first step never starts from a cached prefix that no request of that prompt ever completed (the
prefix a failed first step would have poisoned)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from returns.result import Failure

from pagedkv.core import CacheConfig, RequestSpec, initial_state
from pagedkv.core.scheduler.steps import Budget, DiTJob, DiTState, cancel_job, done, fail, submit_job, tick
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.models.dit import DiTRow

PROMPTS = [(1, 2, 3, 4, 5, 6, 7), (1, 2, 3, 4, 9, 9, 9, 9, 9), (11, 12, 13)]  # two share a block's worth
IDS = ["a", "b", "c", "d", "e", 5]


class StepMachine(RuleBasedStateMachine):
    @initialize(rows=st.sampled_from([2, 3, 4]), tokens=st.sampled_from([24, 40]), blocks=st.sampled_from([12, 30]))
    def start(self, rows: int, tokens: int, blocks: int) -> None:
        cfg = CacheConfig(block_size=4, num_blocks=blocks + 1, enable_prefix_caching=True, max_model_len=48)
        self.state = DiTState.empty(initial_state(cfg), Budget(rows=rows, tokens=tokens))
        self.prompt: dict[Any, tuple[tuple[int, ...], ...]] = {}  # request -> its rows' token ids
        self.completed: set[tuple[int, ...]] = set()  # rows some request computed a first step of

    @rule(rid=st.sampled_from(IDS), p=st.integers(0, 2), cfg=st.booleans(), steps=st.integers(1, 3))
    def submit(self, rid: Any, p: int, cfg: bool, steps: int) -> None:
        rows = [DiTRow(PROMPTS[p]), DiTRow(PROMPTS[p][:2])] if cfg else [DiTRow(PROMPTS[p])]
        job = DiTJob(rid, RequestSpec(rid, tuple(r.spec(6) for r in rows)), steps)
        before = self.state
        got = submit_job(self.state, job)
        if isinstance(got, Failure):
            assert self.state is before
            return
        self.state = got.unwrap()
        self.prompt[rid] = tuple(tuple(r.tokens or ()) for r in job.spec.rows)

    @precondition(lambda self: not self.state.planned)
    @rule()
    def step(self) -> None:
        self.state, plan = tick(self.state).unwrap()
        b = self.state.budget
        for f in plan.forwards:
            assert len(f.metadata.rows) <= b.rows and sum(r.query_len for r in f.metadata.rows) <= b.tokens
            for row in f.metadata.rows if f.phase == "prefill" else ():
                mine, c = self.prompt[row.request_id][row.row], row.kv_start_pos
                assert c == 0 or any(t[:c] == mine[:c] for t in self.completed), (row, "a prefix no first step wrote")
        assert sum(len(self.state.kv.requests[r].slots) for r, _, _ in self.state.active) <= b.rows
        assert set(self.state.planned) == {r for r, _, _ in self.state.active}
        for rid, _ in plan.refused:
            self.prompt.pop(rid, None)

    def _ran(self, finished: tuple[Any, ...], ended: tuple[Any, ...], before: DiTState) -> None:
        first = {rid for rid, _, d in before.active if d == 0 and rid in before.planned}
        for rid in first - set(ended) - set(self.failed):
            self.completed.update(self.prompt[rid])
        for rid in (*finished, *ended):
            self.prompt.pop(rid, None)

    @precondition(lambda self: bool(self.state.planned))
    @rule()
    def report(self) -> None:
        before, self.failed = self.state, ()
        self.state, finished = done(self.state).unwrap()
        self._ran(finished, (), before)

    @precondition(lambda self: bool(self.state.planned))
    @rule(data=st.data(), retry=st.booleans())
    def failed_forward(self, data: Any, retry: bool) -> None:
        before = self.state
        ids = data.draw(st.lists(st.sampled_from(before.planned), min_size=1, unique=True))
        self.failed = tuple(ids)
        self.state, finished, ended = fail(before, ids, retry).unwrap()
        assert set(ended) == (set() if retry else set(ids))
        assert all(rid not in self.state.kv.requests for rid in ended)
        self._ran(finished, ended, before)

    @precondition(lambda self: not self.state.planned)
    @rule(rid=st.sampled_from(IDS))
    def cancel(self, rid: Any) -> None:
        got = cancel_job(self.state, rid)
        if not isinstance(got, Failure):
            self.state = got.unwrap()
            self.prompt.pop(rid, None)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "state"):
            return
        kv = self.state.kv
        assert check_invariants(kv) == []
        active = {r for r, _, _ in self.state.active}
        assert set(kv.requests) == active and not active & {j.request_id for j in self.state.waiting}
        if not active:
            assert kv.free_blocks == kv.config.usable_blocks


test_dit_step_state_machine = StepMachine.TestCase  # examples and steps: the Hypothesis profile (conftest)


@pytest.mark.parametrize("caching_point", ["commit", "schedule"])
def test_the_old_way_round_a_failed_first_step_poisoned_the_cache(caching_point: str) -> None:
    """What ``fail`` replaces: done (which commits and caches the prefix) then cancel with ``error``. A later
    request of the prompt then hits blocks the failed step never wrote; after ``fail`` it hits nothing."""
    cfg = CacheConfig(
        block_size=4, num_blocks=21, enable_prefix_caching=True, max_model_len=48, caching_point=caching_point
    )
    rows = [DiTRow(PROMPTS[0] * 2)]

    def spec(rid: str) -> RequestSpec:
        return RequestSpec(rid, tuple(r.spec(6) for r in rows))

    for way in ("done+cancel", "fail"):
        s = submit_job(DiTState.empty(initial_state(cfg)), DiTJob("a", spec("a"), 3)).unwrap()
        s, _ = tick(s).unwrap()  # the forward fails
        if way == "fail":
            s = fail(s, ["a"]).unwrap()[0]
        else:
            s = cancel_job(done(s).unwrap()[0], "a", "error").unwrap()
        s = submit_job(s, DiTJob("b", spec("b"), 3)).unwrap()
        s, plan = tick(s).unwrap()
        hit = plan.forwards[0].metadata.rows[0].kv_start_pos
        assert hit == (12 if way == "done+cancel" else 0), way
