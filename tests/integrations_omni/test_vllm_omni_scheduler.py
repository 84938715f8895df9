"""vLLM-Omni 0.30's real ``RequestScheduler`` beside ``PagedKVRequestScheduler`` (the same scheduler, pagedkv's
manager installed by its ``initialize``), driven alike tick by tick: requests of CFG rows arriving, scheduled, run
(completed, failed or aborted by the runner's output), waiting ones cancelled. Compared after every call: the
scheduled request ids and the metadata each carries to the worker (block ids, cached prefix lengths; generations
each strictly increasing), the finished ids, the running and waiting counts, the whole free queue."""

from __future__ import annotations

import random
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm_omni.diffusion.sched.request_scheduler", reason="vLLM-Omni 0.30 is not installed here")

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig  # noqa: E402
from vllm_omni.diffusion.diffusion_kv.request import DiffusionKVRequest  # noqa: E402
from vllm_omni.diffusion.request import OmniDiffusionRequest  # noqa: E402
from vllm_omni.diffusion.sched.interface import DiffusionRequestStatus  # noqa: E402
from vllm_omni.diffusion.sched.request_scheduler import RequestScheduler  # noqa: E402
from vllm_omni.diffusion.worker.utils import BatchRunnerOutput, RunnerOutput  # noqa: E402
from vllm_omni.inputs.data import OmniDiffusionSamplingParams  # noqa: E402

from pagedkv.core import free_queue  # noqa: E402
from pagedkv.integrations.vllm_omni import PagedKVDiffusionManager, PagedKVRequestScheduler  # noqa: E402


def schedulers(num_blocks: int, block_size: int, caching: bool, max_model_len: int, max_num_seqs: int) -> list[Any]:
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
    for cls in (RequestScheduler, PagedKVRequestScheduler):
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
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


def request(pid: str, rows: list[tuple[int, int, tuple[int, ...]]]) -> OmniDiffusionRequest:
    r = OmniDiffusionRequest(prompt="p", sampling_params=OmniDiffusionSamplingParams(seed=0), request_id=pid)
    r.diffusion_kv_requests = tuple(
        DiffusionKVRequest(f"{pid}-{i}", sequence_id=i, prefix_len=p, target_len=t, seq_len=p + t, cache_token_ids=tk)
        for i, (p, t, tk) in enumerate(rows)
    )
    return r


def queues(pair: list[Any]) -> tuple[list[int], list[int]]:
    pool = pair[0]._diffusion_kv_manager.native_manager.block_pool
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()], list(
        free_queue(pair[1]._diffusion_kv_manager.state)
    )


def run(seed: int, ticks: int = 150) -> None:
    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])
    pair = schedulers(
        num_blocks=rng.randint(10, 64),
        block_size=bs,
        caching=rng.random() < 0.7,
        max_model_len=rng.choice([64, 128, 256]),
        max_num_seqs=rng.choice([1, 2, 4]),
    )
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
            for s in pair:
                s.add_request(request(pid, rows))
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
        results = {pid: rng.choice(["done", "done", "done", "error", "aborted"]) for pid in ran}
        for s, out in zip(pair, outs):
            runner = BatchRunnerOutput(
                [
                    RunnerOutput(
                        pid,
                        finished=True,
                        result=DiffusionOutput(error="failed" if how == "error" else None, aborted=how == "aborted"),
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
