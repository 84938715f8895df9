"""Issue 31: pagedkv's KV cache manager under vLLM's async scheduling and speculative decoding, against
vLLM's own, step by step.

vLLM's engine core is emulated as it drives the scheduler (tests/integrations/vllm_harness.drive): under
async scheduling two batches are in flight (step N+1 is scheduled before step N's sampled tokens come
back, ``num_output_placeholders``), with speculative decoding the fake drafter's proposals reach the
scheduler after each step (or, async, stand behind the scheduler's -1 placeholders) and the fake target
model accepts a deterministic share of them; rejected drafts roll ``num_computed_tokens`` back. Every
step's scheduled requests and token counts, draft ids, block ids, hits, preemptions, endings, KV events
and stats are identical, and every block is free at the end. Skipped where vLLM is not installed (CI);
run in ../shared/peers' venv:

    /work/peers-venv/bin/python -m pytest -q tests/integrations/test_vllm_placeholders.py
"""

from __future__ import annotations

import pytest

from tests.integrations.vllm_harness import (
    Layout,
    Speculation,
    Workload,
    drive,
    drive_reading_state,
    first_difference,
    make_scheduler,
    scheduler_classes,
    vllm_available,
)

pytestmark = pytest.mark.skipif(vllm_available() is not None, reason=vllm_available() or "")

ASYNC = {"async_scheduling": True}
V2 = {"async_scheduling": True, "v2_runner": True}

CASES = {  # name: (pool blocks, layout, workload options, scheduler options)
    "async, full attention, 60 blocks": (60, Layout(), {"num_requests": 120}, ASYNC),
    "async, window 32, 60 blocks": (60, Layout(windows=(32,)), {"num_requests": 120, "seed": 1}, ASYNC),
    "async, V2 runner, windows 32 and 64, 90 blocks": (
        90,
        Layout(windows=(32, 64)),
        {"num_requests": 120, "seed": 2},
        V2,
    ),
    "async, watermark, resets, repeats": (
        80,
        Layout(windows=(48,)),
        {"num_requests": 120, "seed": 3, "reset_every": 7, "idle_after": 100, "repeats": 0.4},
        {**ASYNC, "watermark": 0.1},
    ),
    "async, long hits under window 16, 64-token chunks": (
        40,
        Layout(windows=(16,)),
        {"num_requests": 80, "seed": 4, "long_prompts": 0.4, "repeats": 0.4, "max_prompt": 440},
        {**ASYNC, "max_num_batched_tokens": 64},
    ),
    "async, caching off": (60, Layout(windows=(32,)), {"num_requests": 80, "seed": 5}, {**ASYNC, "caching": False}),
    "async, Mamba (align), repeats": (60, Layout(mamba=1), {"num_requests": 120, "seed": 22, "repeats": 0.4}, ASYNC),
    "ngram k=1": (
        60,
        Layout(),
        {"num_requests": 100, "seed": 6, "repeats": 0.4},
        {"speculation": Speculation("ngram", 1)},
    ),
    "ngram k=2, padding after full hits": (
        60,
        Layout(),
        {"num_requests": 100, "seed": 7, "repeats": 0.5},
        {"speculation": Speculation("ngram", 2)},
    ),
    "ngram k=4, window 32, LoRA and salts": (
        60,
        Layout(windows=(32,)),
        {"num_requests": 100, "seed": 8, "repeats": 0.3, "lora_every": 3, "salt_every": 4},
        {"speculation": Speculation("ngram", 4), "hash_algo": "sha256"},
    ),
    "ngram k=8, windows 32 and 64": (
        90,
        Layout(windows=(32, 64)),
        {"num_requests": 100, "seed": 9},
        {"speculation": Speculation("ngram", 8)},
    ),
    "async ngram k=2, V2 runner": (
        60,
        Layout(),
        {"num_requests": 100, "seed": 10, "repeats": 0.4},
        {**V2, "speculation": Speculation("ngram", 2)},
    ),
    "async ngram k=4, V2 runner, window 32, metrics": (
        60,
        Layout(windows=(32,)),
        {"num_requests": 100, "seed": 11},
        {**V2, "speculation": Speculation("ngram", 4), "metrics": True},
    ),
    "async ngram k=8, V2 runner, report mode full": (
        90,
        Layout(),
        {"num_requests": 100, "seed": 12, "report_every": 3, "repeats": 0.4},
        {**V2, "speculation": Speculation("ngram", 8)},
    ),
    # EAGLE: k lookahead slots past the drafts; its block hashes cover the token after each block (vLLM 0.33's
    # default) or, with that off, a hit matches one block past it and gives it back
    "eagle k=1": (
        60,
        Layout(),
        {"num_requests": 100, "seed": 13, "repeats": 0.4},
        {"speculation": Speculation("eagle", 1)},
    ),
    "eagle k=3, window 32, report mode full": (
        60,
        Layout(windows=(32,)),
        {"num_requests": 100, "seed": 14, "repeats": 0.4, "report_every": 3},
        {"speculation": Speculation("eagle", 3)},
    ),
    "eagle k=8, LoRA and salts, sha256": (
        90,
        Layout(),
        {"num_requests": 100, "seed": 15, "repeats": 0.3, "lora_every": 3, "salt_every": 4},
        {"speculation": Speculation("eagle", 8), "hash_algo": "sha256"},
    ),
    "eagle k=2, block drop": (
        60,
        Layout(),
        {"num_requests": 100, "seed": 16, "repeats": 0.5},
        {"speculation": Speculation("eagle", 2, lookahead_hashes=False)},
    ),
    "eagle k=4, block drop, windows 32 and 64": (
        90,
        Layout(windows=(32, 64)),
        {"num_requests": 100, "seed": 17, "repeats": 0.5},
        {"speculation": Speculation("eagle", 4, lookahead_hashes=False)},
    ),
    "async eagle k=2, V1 runner, window 16": (
        60,
        Layout(windows=(16,)),
        {"num_requests": 100, "seed": 18, "repeats": 0.4},
        {**ASYNC, "speculation": Speculation("eagle", 2)},
    ),
    "async eagle k=3, V2 runner, block drop, window 32": (
        60,
        Layout(windows=(32,)),
        {"num_requests": 100, "seed": 19, "repeats": 0.5},
        {**V2, "speculation": Speculation("eagle", 3, lookahead_hashes=False)},
    ),
    "async eagle k=5, V2 runner, salts, metrics": (
        60,
        Layout(),
        {"num_requests": 100, "seed": 20, "repeats": 0.4, "salt_every": 3},
        {**V2, "speculation": Speculation("eagle", 5), "metrics": True},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ahead_of_tokens_pagedkv_decides_as_vllms_own_step_by_step(name: str) -> None:
    blocks, layout, work, options = CASES[name]
    theirs_cls, ours_cls = scheduler_classes(options.get("async_scheduling", False))
    theirs_sched = make_scheduler(theirs_cls, blocks, layout, **options)
    ahead: list[int] = []  # after each step: the requests whose sampled tokens are still in flight

    def on_step(step: int) -> None:
        ahead.append(sum(1 for r in theirs_sched.requests.values() if r.num_output_placeholders > 0))

    theirs = drive(theirs_sched, Workload(**work), on_step=on_step)
    ours_sched = make_scheduler(ours_cls, blocks, layout, **options)
    ours, read = drive_reading_state(ours_sched, Workload(**work))  # (decisions unchanged by the reads)
    assert first_difference(theirs, ours) is None
    assert read > 0
    # what the setup is for happened (a test that cannot fail proves nothing)
    n = work["num_requests"]
    assert len({r for rec in theirs for r in rec.finished}) >= n - 1
    assert sum(len(rec.preempted) for rec in theirs) > 0 or options.get("watermark") or blocks >= 90
    if options.get("async_scheduling"):  # steps scheduled while the last one's tokens were not back yet
        assert sum(1 for k in ahead if k > 1) > len(theirs) // 5
    else:
        assert not any(ahead)
    spec = options.get("speculation")
    if spec is not None:
        drafts = [d for rec in theirs for d in rec.drafts.values()]
        assert len(drafts) > 100 and max(map(len, drafts)) == spec.k
        if not options.get("async_scheduling"):  # real draft ids, and the -1 padding of a request a hit
            assert any(t > 0 for d in drafts for t in d)  # took to its last token
            if work.get("repeats", 0) >= 0.4 and (spec.method != "eagle" or spec.lookahead_hashes):  # (a dropped
                assert any(t < 0 for d in drafts for t in d)  # block leaves a hit a block short of the last token)
        stored = [ev for rec in theirs for ev in rec.events if type(ev).__name__ == "BlockStored"]
        lookahead = [ev for ev in stored if ev.lookahead_token_ids is not None]
        if spec.method == "eagle" and spec.lookahead_hashes:  # every store names the token after each block
            assert stored and len(lookahead) == len(stored)
        else:
            assert not lookahead
        if spec.method == "eagle":  # hits (the drop gives back a block: hits end a block short of the run)
            assert sum(1 for rec in theirs for hit in rec.hits.values() if hit) > 5
    from pagedkv.core.verify.invariants import check_invariants

    state = ours_sched.kv_cache_manager.state
    assert check_invariants(state) == [] and not state.requests
    assert state.free_blocks == blocks - 1


def test_a_scheduler_class_that_does_not_match_async_scheduling_is_refused() -> None:
    from pagedkv.integrations.vllm import PagedKVAsyncScheduler, PagedKVScheduler
    from pagedkv.integrations.vllm.version import Unsupported

    with pytest.raises(Unsupported, match="PagedKVAsyncScheduler"):
        make_scheduler(PagedKVScheduler, 40, Layout(), async_scheduling=True)
    with pytest.raises(Unsupported, match="without async scheduling"):
        make_scheduler(PagedKVAsyncScheduler, 40, Layout())
