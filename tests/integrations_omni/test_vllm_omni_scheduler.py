"""vLLM-Omni 0.30's real ``RequestScheduler`` beside ``PagedKVRequestScheduler`` (the same scheduler, pagedkv's
manager installed by its ``initialize``), driven alike tick by tick: requests of CFG rows arriving, scheduled, run
(completed, failed or aborted by the runner's output), waiting ones cancelled. Compared after every call: the
scheduled request ids and the metadata each carries to the worker (block ids, cached prefix lengths; generations
each strictly increasing), the finished ids, the running and waiting counts, the whole free queue."""

from __future__ import annotations

import random
import types
from dataclasses import replace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm_omni.diffusion.sched.request_scheduler", reason="vLLM-Omni 0.30 is not installed here")

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.interface import DiffusionRequestStatus
from vllm_omni.diffusion.sched.request_scheduler import RequestScheduler
from vllm_omni.diffusion.sched.step_scheduler import StepScheduler
from vllm_omni.diffusion.worker.utils import BatchRunnerOutput, RunnerOutput
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

from pagedkv.core import free_queue
from pagedkv.integrations.vllm_omni import PagedKVDiffusionManager, PagedKVRequestScheduler, PagedKVStepScheduler
from tests.integrations_omni.test_vllm_omni_manager import kv_config, kv_requests


def schedulers(
    num_blocks: int,
    block_size: int,
    caching: bool,
    max_model_len: int,
    max_num_seqs: int,
    groups: int = 1,
    step: bool = False,
) -> list[Any]:
    od = OmniDiffusionConfig(
        model="lockstep",
        diffusion_kv_mode="paged_scheduler",
        max_num_seqs=max_num_seqs,
        diffusion_kv_max_rows_per_request=3,  # (the streams' most: the row budget is the next test's)
    )
    # what initialize reads of the VllmConfig the engine sizes the cache with (built from a model's files there)
    vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(max_model_len=max_model_len),
        max_in_flight_tokens=None,
        cache_config=types.SimpleNamespace(enable_prefix_caching=caching, prefix_caching_hash_algo="sha256"),
    )
    out = []
    for cls in (StepScheduler, PagedKVStepScheduler) if step else (RequestScheduler, PagedKVRequestScheduler):
        kv = kv_config(num_blocks, block_size, groups)
        s = cls()
        s.initialize(
            od,
            kv_cache_config=kv,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            kv_vllm_config=vllm_config,
        )
        out.append(s)
    assert isinstance(out[1]._diffusion_kv_manager, PagedKVDiffusionManager)
    return out


def request(pid: str, rows: list[tuple[int, int, tuple[int, ...]]], steps: int = 1) -> OmniDiffusionRequest:
    params = OmniDiffusionSamplingParams(seed=0, num_inference_steps=steps)
    r = OmniDiffusionRequest(prompt="p", sampling_params=params, request_id=pid)
    r.diffusion_kv_requests = tuple(kv_requests(pid, rows))
    return r


def queues(pair: list[Any]) -> tuple[list[int], list[int]]:
    pool = pair[0]._diffusion_kv_manager.native_manager.block_pool
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()], list(
        free_queue(pair[1]._diffusion_kv_manager.state)
    )


def run(seed: int, ticks: int = 150, step: bool = False) -> None:
    """One fuzzed stream on both schedulers; ``step``: vLLM-Omni's StepScheduler pair, each request taking 1-4
    denoising steps (a step a tick, requests joining and leaving between steps)."""
    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])
    pair = schedulers(
        num_blocks=rng.randint(10, 64),
        block_size=bs,
        caching=rng.random() < 0.7,
        max_model_len=rng.choice([64, 128, 256]),
        max_num_seqs=rng.choice([1, 2, 4]),
        groups=rng.choice([1, 1, 2]),
        step=step,
    )
    total: dict[str, int] = {}
    done: dict[str, int] = {}
    prompts = [tuple(rng.randrange(1000) for _ in range(rng.randint(1, 60))) for _ in range(4)]
    gens: list[list[int]] = [[], []]
    waiting: list[str] = []
    for t in range(ticks):
        for k in range(rng.choice([0, 0, 1, 1, 2])):  # arrivals
            pid, target = f"r{t}-{k}", rng.randint(1, 40)
            rows = []
            for i in range(rng.choice([1, 2, 2, 3])):
                toks = (
                    rng.choice(prompts)
                    if i == 0 or rng.random() < 0.5
                    else tuple(rng.randrange(1000) for _ in range(rng.randint(0, 12)))
                )
                rows.append((len(toks), target, toks))
            total[pid], done[pid] = (rng.randint(1, 4) if step else 1), 0
            for s in pair:
                s.add_request(request(pid, rows, total[pid]))
            waiting.append(pid)
        if waiting and rng.random() < 0.05:  # a waiting request cancelled
            pid = waiting.pop(rng.randrange(len(waiting)))
            for s in pair:
                if s.get_request_state(pid) is not None and pid not in s._running:
                    s.finish_requests(pid, DiffusionRequestStatus.FINISHED_ABORTED)
        outs = [s.schedule() for s in pair]
        seen = []
        for i, out in enumerate(outs):
            new = []
            for n in out.scheduled_new_reqs:
                md = n.diffusion_kv_metadata
                if md is not None:
                    gens[i].append(md.allocation_generation)
                    new.append((n.request_id, [(q.block_ids, q.cached_prefix_len) for q in md.sequences]))
                else:
                    new.append((n.request_id, None))
            seen.append((new, sorted(out.finished_req_ids), out.num_running_reqs, out.num_waiting_reqs))
        assert seen[0] == seen[1], f"seed {seed} tick {t}: vLLM-Omni {seen[0]}, pagedkv {seen[1]}"
        q = queues(pair)
        assert q[0] == q[1], f"seed {seed} tick {t}: free queues differ"
        ran = [pid for pid, _ in seen[0][0]] + list(outs[0].scheduled_cached_reqs.request_ids)
        results = {pid: rng.choice(["done", "done", "done", "done", "error", "aborted"]) for pid in ran}
        for pid in ran:
            done[pid] += 1
        for s, out in zip(pair, outs):
            runner = BatchRunnerOutput(
                [
                    RunnerOutput(
                        pid,
                        step_index=done[pid],
                        finished=done[pid] >= total[pid],
                        result=None
                        if how == "done" and done[pid] < total[pid]
                        else DiffusionOutput(error="failed" if how == "error" else None, aborted=how == "aborted"),
                    )
                    for pid, how in results.items()
                ]
            )
            s.update_from_output(out, runner)
        waiting = [pid for pid in waiting if pid not in results]
        q = queues(pair)
        assert q[0] == q[1], f"seed {seed} tick {t}: free queues differ after the outputs"
    for g in gens:
        assert g == sorted(set(g))


@pytest.mark.parametrize("seed", range(40))
def test_the_real_request_scheduler_schedules_alike_on_both_managers(seed: int) -> None:
    run(seed)


@pytest.mark.parametrize("seed", range(30))
def test_the_real_step_scheduler_schedules_alike_on_both_managers(seed: int) -> None:
    run(seed, step=True)


def test_one_configuration_line_selects_pagedkvs_engine_and_its_scheduler() -> None:
    """``engine_backend: pagedkv.integrations.vllm_omni.PagedKVDiffusionEngine`` resolves, through vLLM-Omni's own
    resolution, to pagedkv's engine, whose schedulers (``PagedKVRequestScheduler`` for request batches,
    ``PagedKVStepScheduler`` under step execution) run on pagedkv's manager; KV prefetch is refused before anything
    runs. (The engine's constructor starts workers and loads a model: only its scheduler choice runs here.)"""
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine, DiffusionExecutionMode

    from pagedkv.integrations.vllm_omni import PagedKVDiffusionEngine, Unsupported

    od = OmniDiffusionConfig(
        model="one-line",
        diffusion_kv_mode="paged_scheduler",
        max_num_seqs=2,
        diffusion_kv_max_rows_per_request=2,
        engine_backend="pagedkv.integrations.vllm_omni.PagedKVDiffusionEngine",
    )
    engine_class = DiffusionEngine.resolve_engine_class(od)
    assert engine_class is PagedKVDiffusionEngine
    kv = kv_config(32, 8)
    vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(max_model_len=128),
        max_in_flight_tokens=None,
        cache_config=types.SimpleNamespace(enable_prefix_caching=True, prefix_caching_hash_algo="sha256"),
    )
    kw = dict(kv_cache_config=kv, scheduler_block_size=8, hash_block_size=8, kv_vllm_config=vllm_config)
    engine = engine_class.__new__(engine_class)
    engine.execution_mode = DiffusionExecutionMode.REQUEST_BATCH
    engine._init_scheduler(od, None, **kw)
    assert isinstance(engine.scheduler, PagedKVRequestScheduler)
    assert isinstance(engine.scheduler._diffusion_kv_manager, PagedKVDiffusionManager)
    engine.execution_mode = DiffusionExecutionMode.STEP_BATCH
    engine._init_scheduler(od, None, **kw)
    assert isinstance(engine.scheduler, PagedKVStepScheduler)
    assert isinstance(engine.scheduler._diffusion_kv_manager, PagedKVDiffusionManager)
    with pytest.raises(Unsupported, match="KV prefetch"):
        PagedKVRequestScheduler().initialize(replace(od, omni_kv_config={"enable_kv_async_prefetch": True}), **kw)
