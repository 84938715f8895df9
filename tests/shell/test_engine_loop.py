"""The engine's step equals the plain sequential loop: schedule, install, forward, sample each row alone,
on_output. Its batched device-side sampling, its reordered host work (the trace line and the bookkeeping
while the device runs) and its decode tokens taken from the last step's ids change no plan and no token,
and the trace it records replays digest for digest."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from typing import Any

import pytest
import torch

import pagedkv.shell.engine as engine_module
from pagedkv.core.outputs.metadata import Phase
from pagedkv.core.scheduler import SchedulerConfig, SeqRequest, new_scheduler, on_output, sched_digest, schedule, submit
from pagedkv.core.verify.trace import replay
from pagedkv.core.verify.trace_ops import plan_json
from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
from pagedkv.shell.attention import get_backend
from pagedkv.shell.engine import Engine
from pagedkv.shell.engine_args import EngineArgs
from pagedkv.shell.sampling import SamplingParams
from pagedkv.shell.sampling import request_seed
from tests.shell.test_sampling import sample  # (the one-row rule, written plainly)

CFG = replace(
    SMOLLM2_SHAPES, vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2
)
ARGS = EngineArgs(
    block_size=4, kv_cache_memory_bytes=18 * 1024, max_num_seqs=3, max_num_batched_tokens=24
)  # a pool small enough to preempt


def requests() -> list[tuple[str, list[int], SamplingParams]]:
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=9),
        SamplingParams(max_tokens=11, temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_tokens=7, temperature=1.3, top_k=12),
    ]
    return [(f"req-{i}", [(11 * i + j) % 300 for j in range(5 + 6 * i)], kinds[i % 3]) for i in range(7)]


def sequential(model: Any) -> tuple[list[dict[str, Any]], list[list[int]], list[str]]:
    """The loop written plainly: each row's logits sampled alone, tokens read from the core's requests."""
    backend = get_backend("torch")
    rank = ARGS.rank_for(model, backend)
    state = new_scheduler(
        rank.cache, SchedulerConfig(max_num_seqs=ARGS.max_num_seqs, max_num_batched_tokens=ARGS.max_num_batched_tokens)
    )
    reqs = requests()
    params = {rid: p for rid, _, p in reqs}
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
    for rid, ids, p in reqs:
        state = submit(state, SeqRequest(rid, tuple(ids), max_tokens=p.max_tokens)).unwrap()
    plans, digests = [], []
    while state.live:
        state, plan = schedule(state).unwrap()
        plans.append(plan_json(plan))
        digests.append(sched_digest(state))
        rank.worker.remove(list(plan.preempted))
        logits = {}
        for meta in plan.metadata:
            batch = rank.worker.install(meta)
            toks = []
            for row in meta.rows:
                seq = list(state.seqs[row.request_id].prompt) + out[row.request_id]
                toks += seq[row.kv_start_pos : row.seq_len]
            rows_out = model.forward(torch.tensor(toks), batch, rank.pool, backend, rank.layout)
            logits.update({row.request_id: rows_out[r] for r, row in enumerate(meta.rows)})
        sampled = {
            rid: sample(logits[rid], params[rid], request_seed(rid, params[rid]), len(out[rid])) for rid in plan.samples
        }
        for rid, tok in sampled.items():
            out[rid].append(tok)
        state, ended = on_output(state, sampled, []).unwrap()
        rank.worker.remove([rid for rid, _ in ended])
        digests.append(sched_digest(state))
    return plans, [out[rid] for rid, _, _ in reqs], digests


@pytest.fixture(scope="module")
def model() -> Any:
    return random_llama(CFG, seed=3)


def test_the_engine_step_equals_the_sequential_loop(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    want_plans, want_tokens, want_digests = sequential(model)
    assert any(p["preempted"] for p in want_plans), "the run should preempt"
    plans = []
    real = engine_module.schedule

    def seen(state: Any, drafts: Any = None) -> Any:
        assert drafts is None  # (no speculative decoding here)
        res = real(state, drafts)
        plans.append(plan_json(res.unwrap()[1]))
        return res

    monkeypatch.setattr(engine_module, "schedule", seen)
    trace = io.StringIO()
    eng = Engine(model, IdTokenizer(), ARGS, trace=trace)
    done = eng.generate(requests())
    eng.finish_trace()
    assert plans == want_plans
    assert [c.token_ids for c in done] == want_tokens
    results = list(replay(trace.getvalue().splitlines(), check=True))
    assert all(r.divergence is None and not r.violations and r.result.get("error") is None for r in results)
    ops = [json.loads(line)["op"] for line in trace.getvalue().splitlines()[1:-1]]  # (the end record is the last)
    steps = [r for r, op in zip(results, ops) if op in ("schedule", "output")]
    assert [sched_digest(r.state) for r in steps] == want_digests  # type: ignore[arg-type]


def test_decode_tokens_come_from_the_last_steps_ids(model: Any) -> None:
    """A decode batch in the order of the last step's samples takes those very ids (no host copy);
    a batch in another order is read from the requests, and both give the same tokens."""
    eng = Engine(model, IdTokenizer(), ARGS)
    for rid, ids, p in requests()[:2]:
        eng.add_request(rid, "", ids, p)
    for _ in range(3):  # both prompts prefilled, then decoding
        eng.step()
    samples, ids = eng.runner.last  # type: ignore[misc]
    meta = schedule(eng.state).unwrap()[1].metadata[0]
    rows = tuple(r.request_id for r in meta.rows)
    assert meta.phase is Phase.DECODE and rows == samples
    assert eng.runner._tokens(meta, rows, eng.state) is ids
    eng.runner.last = (tuple(reversed(samples)), ids.flip(0))
    assert (
        eng.runner._tokens(meta, rows, eng.state).tolist()
        == [eng.requests[r].completion.token_ids[-1] for r in rows]
        == ids.tolist()
    )
