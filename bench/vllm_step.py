"""vLLM's real v1 scheduler step with its own KV cache manager vs pagedkv's, same run, GC on.

Continuous batching at N running requests: every request has a prompt of about 250 tokens (a quarter
share one of 8 system prompts, so admissions hit the prefix cache), decodes a geometric number of tokens
(mean 128) and ends; each step a new request replaces each one that ended, so the step carries
admissions, prefix hits, block growth at block boundaries and frees, as a serving engine's does. The pool
holds every running request's whole sequence (no preemption). Timed: ``schedule()`` plus
``update_from_output()`` per step (the scheduler's own work is the same code in both columns), and
within it the manager's calls (``allocate_slots``, ``get_computed_blocks``, ``free``, ``get_blocks``,
``take_events``), all through the same timing wrapper. KV events on (as a router-fed deployment runs).
Collections of CPython's GC per step, all generations, from ``gc.callbacks``.

Needs vLLM (../shared/peers' venv, with pagedkv installed there):

    /work/peers-venv/bin/python bench/vllm_step.py --n 64,256,1024 --steps 300
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.integrations.vllm_harness import BLOCK_SIZE, Layout, make_scheduler, sampled  # noqa: E402

TIMED = ("allocate_slots", "get_computed_blocks", "free", "get_blocks", "take_events")


class Gc:
    """Counts CPython's collections while active."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.count += 1


def timed_manager(manager: Any, spent: list[int]) -> None:
    """Wrap the manager's calls the scheduler makes (the same wrapper for both managers)."""
    clock = time.perf_counter_ns
    for name in TIMED:
        fn = getattr(manager, name)

        def wrapper(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[0] += clock() - t0

        setattr(manager, name, wrapper)


def run(scheduler_cls: type, n: int, steps: int, seed: int) -> dict[str, float]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput

    rng = random.Random(seed)
    systems = [[rng.randrange(1, 1000) for _ in range(128)] for _ in range(8)]
    max_len = 1024
    blocks = n * (max_len // BLOCK_SIZE) + 64
    sched = make_scheduler(scheduler_cls, blocks, Layout(), max_num_seqs=n, max_num_batched_tokens=n + 4096,
                           max_model_len=max_len + 64)  # fmt: skip
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256_cbor)
    from vllm.v1.request import Request

    counter = [0]

    def new_request() -> Any:
        i = counter[0]
        counter[0] += 1
        head = systems[rng.randrange(8)] if rng.random() < 0.25 else []
        prompt = head + [rng.randrange(1, 1000) for _ in range(250 - len(head) + rng.randrange(-40, 40))]
        out = min(1 + int(rng.expovariate(1 / 128)), max_len - len(prompt))
        return Request(f"q{i}", prompt, SamplingParams(max_tokens=out, ignore_eos=True), pooling_params=None,
                       block_hasher=hasher)  # fmt: skip

    class Sink:
        def publish(self, batch: Any) -> None:
            pass

        def shutdown(self) -> None:
            pass

    sched.kv_event_publisher = Sink()
    for _ in range(n):
        sched.add_request(new_request())
    spent = [0]
    timed_manager(sched.kv_cache_manager, spent)
    counter_gc = Gc()
    gc.callbacks.append(counter_gc)
    step_ns: list[int] = []
    mgr_ns: list[int] = []
    gcs = 0
    warm = 60  # prefills done, the batch decoding, the churn going
    try:
        for step in range(warm + steps):
            t0 = time.perf_counter_ns()
            spent[0] = 0
            before = counter_gc.count
            out = sched.schedule()
            ids = list(out.num_scheduled_tokens)
            tokens = []
            for rid in ids:
                req = sched.requests[rid]
                tokens.append([sampled(rid, step)] if req.num_computed_tokens >= req.num_tokens else [])
            sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                            sampled_token_ids=tokens))  # fmt: skip
            t1 = time.perf_counter_ns()
            if step >= warm:
                step_ns.append(t1 - t0)
                mgr_ns.append(spent[0])
                gcs += counter_gc.count - before
            for _ in range(n - len(sched.running) - len(sched.waiting)):  # replace the ones that ended
                sched.add_request(new_request())
    finally:
        gc.callbacks.remove(counter_gc)
    return {"step_us": statistics.median(step_ns) / 1e3, "mean_step_us": statistics.fmean(step_ns) / 1e3,
            "manager_us": statistics.median(mgr_ns) / 1e3, "gc_per_step": gcs / steps,
            "running": len(sched.running)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="64,256,1024", help="running requests, comma-separated")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per N (the median is shown)")
    args = parser.parse_args()
    from vllm.v1.core.sched.scheduler import Scheduler

    from pagedkv.integrations.vllm import PagedKVScheduler

    import vllm

    print(f"vLLM {vllm.__version__}, Python {sys.version.split()[0]}, GC on; median over {args.repeats} "
          f"alternating runs of {args.steps} steps\n")  # fmt: skip
    print("| running | vLLM step us | pagedkv step us | step ratio | vLLM manager us | pagedkv manager us |"
          " manager ratio | GC/step vLLM | GC/step pagedkv |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.n.split(",")):
        results: dict[str, list[dict[str, float]]] = {"vllm": [], "pagedkv": []}
        for r in range(args.repeats):
            for name, cls in (("vllm", Scheduler), ("pagedkv", PagedKVScheduler)):
                results[name].append(run(cls, n, args.steps, seed=r))
        med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in results.items()}
        a, b = med["vllm"], med["pagedkv"]
        print(f"| {n} | {a['step_us']:.0f} | {b['step_us']:.0f} | {b['step_us'] / a['step_us']:.2f} | "
              f"{a['manager_us']:.0f} | {b['manager_us']:.0f} | {b['manager_us'] / a['manager_us']:.2f} | "
              f"{a['gc_per_step']:.2f} | {b['gc_per_step']:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
