"""The scheduler with drafts (speculative decoding, issue 32): a decode with drafts grows by its last token and
the drafts that fit; ``on_output`` takes the accepted ones and the next token, cuts the row back and commits
through them. Against a deterministic stand-in model, every run with drafts (good, bad, through preemption,
with prefix caching) gives the outputs of the run without, every state between keeps the invariants, and
every block comes back."""

from __future__ import annotations

import random

import pytest
from returns.result import Failure

from pagedkv.core import CacheConfig, GroupKind, GroupSpec
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
from pagedkv.core.scheduler.digest import sched_digest
from pagedkv.core.verify.invariants import check_invariants
from tests.core.test_scheduler import llm, model


def _drafts(state: SchedState, r: random.Random) -> dict[object, list[int]]:
    """For each running request, drafts that are right for a while (the model's own continuation) and then
    wrong, or wholly wrong, or none."""
    out: dict[object, list[int]] = {}
    for rid in state.running:
        if rid in state.prefilling or r.random() < 0.2:
            continue
        seq = state.live[rid].prompt + state.live[rid].output
        draft: list[int] = []
        for _ in range(r.randint(1, 6)):
            tok = model(seq + tuple(draft)) if r.random() < 0.75 else r.randrange(50, 60)
            draft.append(tok)
        out[rid] = draft
    return out


@pytest.mark.parametrize("seed", range(40))
def test_drafts_give_the_outputs_of_decoding_through_preemption_and_caching(seed: int) -> None:
    r = random.Random(seed)
    bs = r.choice([2, 4])
    groups = (
        (GroupSpec("full", GroupKind.FULL), GroupSpec("local", GroupKind.SLIDING_WINDOW, window=6))
        if seed % 3 == 2
        else None
    )
    cfg = CacheConfig(
        block_size=bs,
        num_blocks=r.choice([24, 40, 200]),
        enable_prefix_caching=seed % 2 == 0,
        max_model_len=r.choice([None, 40]),
        **({"groups": groups} if groups else {}),
    )
    sched = SchedulerConfig(max_num_seqs=r.randint(1, 5), max_num_batched_tokens=r.choice([8, 16, 64]))
    reqs = [
        llm(f"r{i}", r.randint(3, 14), max_tokens=r.randint(1, 24), base=r.choice([0, 100]) + i)
        for i in range(r.randint(2, 6))
    ]
    want = _final(cfg, sched, reqs, None)
    got = _final(cfg, sched, reqs, random.Random(seed + 1000))
    assert got == want


def _final(cfg: CacheConfig, sched: SchedulerConfig, reqs: list[SeqRequest], r: random.Random | None) -> dict:
    """Each request's output at its end (what it generated, or how it was refused)."""
    s = new_scheduler(cfg, sched)
    for q in reqs:
        s = submit(s, q).unwrap()
    last: dict[object, tuple[int, ...]] = {}
    ends: dict[object, str] = {}
    steps = 0
    while s.live:
        s, plan = schedule(s, _drafts(s, r) if r is not None else None).unwrap()
        ends.update(plan.finished)
        verify = dict(plan.verify)
        sampled: dict[object, object] = {}
        for rid in plan.samples:
            seq = s.live[rid].prompt + s.live[rid].output
            if rid not in verify:
                sampled[rid] = model(seq)
                continue
            got: list[int] = []
            for d in verify[rid]:
                got.append(model(seq + tuple(got)))
                if got[-1] != d:
                    break
            else:
                got.append(model(seq + tuple(got)))
            sampled[rid] = got
            last[rid] = seq[len(s.live[rid].prompt) :] + tuple(got)
        for rid, tok in sampled.items():
            if rid not in verify:
                last[rid] = s.live[rid].output + (tok,)  # type: ignore[operator]
        s, ended = on_output(s, sampled).unwrap()
        ends.update(ended)
        assert check_invariants(s.kv) == []
        steps += 1
        assert steps < 1000
    assert s.kv.free_blocks == s.kv.config.usable_blocks  # every block back
    return {rid: (last.get(rid, ()), str(how)) for rid, how in ends.items()}


def test_drafts_are_trimmed_to_the_budget_max_tokens_and_the_length_limit() -> None:
    s = new_scheduler(
        CacheConfig(block_size=4, num_blocks=40, max_model_len=12), SchedulerConfig(max_num_batched_tokens=5)
    )
    s = submit(s, llm("a", 4, max_tokens=6)).unwrap()
    s, _ = schedule(s).unwrap()
    s, _ = on_output(s, {"a": 1}).unwrap()
    s, plan = schedule(s, {"a": [2, 3, 4, 5, 6, 7]}).unwrap()
    assert plan.verify == (("a", (2, 3, 4, 5)),) and plan.decode == () and plan.num_tokens == 5  # the budget
    assert plan.samples == ("a",) and [(r.kv_start_pos, r.query_len) for r in plan.metadata[0].rows] == [(4, 5)]
    s, _ = on_output(s, {"a": [2, 9]}).unwrap()  # one draft accepted, then 9: the row is cut back to 6
    assert s.log.tokens("a") == (1, 2, 9) and s.kv.row_len[0] == s.kv.row_computed[0] == 6
    s, plan = schedule(s, {"a": [1, 1, 1, 1]}).unwrap()
    assert plan.verify == (("a", (1, 1)),)  # max_tokens 6: three tokens left, one of them the verify's own
    s, ended = on_output(s, {"a": [1, 1, 5]}).unwrap()
    assert [rid for rid, _ in ended] == ["a"] and s.kv.free_blocks == s.kv.config.usable_blocks  # max_tokens reached
    s = submit(s, llm("b", 4, max_tokens=50)).unwrap()
    s, _ = schedule(s).unwrap()
    s, _ = on_output(s, {"b": 1}).unwrap()
    s, plan = schedule(s, {"b": [1] * 9}).unwrap()
    s, _ = on_output(s, {"b": [1, 1, 1, 1, 1]}).unwrap()  # row 9 of max_model_len 12
    s, plan = schedule(s, {"b": [1] * 9}).unwrap()
    assert plan.verify == (("b", (1, 1)),)  # the length limit: its token and two drafts reach 12


def test_bad_drafts_and_bad_verified_tokens_are_refused_with_the_state_unchanged() -> None:
    s = new_scheduler(CacheConfig(block_size=4, num_blocks=40))
    s = submit(s, llm("a", 6, max_tokens=20)).unwrap()
    s, _ = schedule(s).unwrap()
    s, _ = on_output(s, {"a": 1}).unwrap()
    for bad in ([1, 2], {"a": [1, -2]}, {"a": (1, True)}, {"a": 3}):
        got = schedule(s, bad)  # type: ignore[arg-type]
        assert isinstance(got, Failure) and got.failure().field == "drafts", bad
    assert schedule(s, {"zz": [1, 2]}).unwrap()[1].verify == ()  # a request that does not decode: dropped
    before = sched_digest(s)
    s2, plan = schedule(s, {"a": [4, 5, 6]}).unwrap()
    for bad in ({"a": [5, 1]}, {"a": [4, 5, 6, 7, 8]}, {"a": []}, {"a": [4, -1]}, {}):
        assert isinstance(on_output(s2, bad), Failure), bad
    assert sched_digest(s) == before
    s3 = cancel(s2, "a").unwrap()  # a pending verify cancelled: its blocks back
    assert s3.kv.free_blocks == s3.kv.config.usable_blocks and not s3.pending_output and not s3.sched_verify
