"""Overlapped scheduling (issue 32): the engine plans and launches step N+1 before it reads step N's ids. Its
completions equal the engine's that waits (greedy and seeded, batched, through preemption, stop tokens and
``max_tokens``), its recorded trace replays digest for digest with the invariants checked after every event,
nothing leaks, and a failed step ends its requests and those whose ids it lost, the engine serving on."""

from __future__ import annotations

import io

import pytest
import torch

from pagedkv.core.config import InvalidConfig
from pagedkv.core.verify.trace import replay
from pagedkv.models.llama import IdTokenizer, random_llama
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams
from tests.shell.test_speculative import CFG, CFG_POOL, _prompts


class StopAt(IdTokenizer):  # stop tokens the random model samples now and then
    stop_token_ids = frozenset({7, 19, 33})


@pytest.fixture(scope="module")
def model() -> object:
    torch.manual_seed(0)
    return random_llama(CFG)


def _serve(
    model: object, prompts: list[list[int]], params: SamplingParams, overlap: bool, tok: object = None, **kw: object
) -> tuple:
    trace = io.StringIO()
    eng = Engine(model, tok or StopAt(), block_size=4, async_scheduling=overlap, trace=trace, **kw)
    done = eng.generate([(f"p{i}", p, params) for i, p in enumerate(prompts)])
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks and not eng.worker.rows  # everything back
    eng.finish_trace()
    lines = trace.getvalue().splitlines()
    results = list(replay(lines, check=True))
    assert len(results) == len(lines) - 1 and all(r.divergence is None and not r.violations for r in results)
    return [(c.token_ids, c.finish_reason) for c in done], eng, lines


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(max_tokens=30, temperature=1.0, seed=2),
        SamplingParams(temperature=0.0, max_tokens=2),
    ],
)
def test_overlap_gives_the_completions_of_waiting(model: object, params: SamplingParams) -> None:
    prompts = _prompts(6, seed=4)
    kw = dict(kv_cache_memory_bytes=4 * CFG_POOL, max_num_seqs=5)  # (a small pool: its digests and checks are quick)
    want, _, _ = _serve(model, prompts, params, False, **kw)
    got, eng, lines = _serve(model, prompts, params, True, **kw)
    assert got == want and eng.stats.generated_tokens == sum(len(t) for t, _ in want)
    assert any('"op": "tokens"' in x for x in lines)
    if params.max_tokens > 2:
        assert any(r == "stop" for _, r in want)


def test_overlap_through_preemption(model: object) -> None:
    prompts = _prompts(5, seed=2)
    params = SamplingParams(max_tokens=48, temperature=0.7, seed=3)
    kw = dict(kv_cache_memory_bytes=CFG_POOL, max_num_seqs=5, max_num_batched_tokens=64)
    want, ref, _ = _serve(model, prompts, params, False, IdTokenizer(), **kw)  # (no stop token: they all grow)
    got, eng, _ = _serve(model, prompts, params, True, IdTokenizer(), **kw)
    assert got == want and ref.stats.preemptions and eng.stats.preemptions


def test_a_failed_step_ends_its_requests_and_those_whose_ids_it_lost(model: object) -> None:
    prompts = _prompts(4, seed=5)
    eng = Engine(model, StopAt(), block_size=4, async_scheduling=True, max_num_seqs=4)
    real, calls = model.forward, [0]

    def flaky(*a: object) -> object:
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("injected")
        return real(*a)

    eng.runner.model = type("M", (), {"forward": staticmethod(flaky), "device": model.device, "config": model.config})()
    done = eng.generate([(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=12)) for i, p in enumerate(prompts)])
    assert any(c.finish_reason == "error" and "injected" in (c.error or "") for c in done)
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks and not eng.worker.rows and not eng.state.awaiting
    eng.runner.model = model
    (again,) = eng.generate([("q", prompts[0], SamplingParams(temperature=0.0, max_tokens=5))])  # and it serves on
    (clean,) = Engine(model, StopAt(), block_size=4).generate(
        [("q", prompts[0], SamplingParams(temperature=0.0, max_tokens=5))]
    )
    assert again.token_ids == clean.token_ids


def test_speculation_and_overlap_together_are_refused() -> None:
    with pytest.raises(InvalidConfig, match="not served yet"):
        Engine(random_llama(CFG), IdTokenizer(), async_scheduling=True, speculative_config={"method": "ngram"})
