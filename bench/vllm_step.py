"""vLLM's real v1 scheduler step with its own KV cache manager vs pagedkv's, same run, GC on.

Continuous batching at N running requests: every request has a prompt of about 250 tokens (a quarter
share one of 8 system prompts, so admissions hit the prefix cache), decodes a geometric number of tokens
(mean 128) and ends; each step a new request replaces each one that ended, so the step carries
admissions, prefix hits, block growth at block boundaries and frees, as a serving engine's does. The pool
holds every running request's whole sequence (no preemption). Timed: one step of vLLM's engine core
(``schedule()`` plus ``update_from_output()``, and under speculation the drafter's proposals handed over;
the scheduler's own work is the same code in both columns), and within it the manager's calls
(``allocate_slots``, ``get_computed_blocks``, ``free``, ``get_blocks``, ``take_events``, ``cache_blocks``),
all through the same timing wrapper. KV events on (as a router-fed deployment runs), or off (``--events off``,
vLLM's default). Collections of CPython's GC per step, all generations, from ``gc.callbacks``.

Modes (``--modes``): ``sync`` (no async scheduling, no speculation); ``async`` (vLLM's AsyncScheduler, two
batches in flight); ``ngram2``, ``ngram4``, ``eagle2``, ``eagle4`` (speculative decoding with k drafts a step,
EAGLE with vLLM's lookahead hashes and k lookahead slots; the fake target accepts a deterministic
share); ``async-eagle4``, ``async-ngram4`` (both; n-gram under async needs vLLM's V2 model runner).

Needs vLLM 0.33 or 0.34 (.ci/vllm_env.sh VENV 0.34.0 builds an environment with pagedkv installed there):

    VENV/bin/python bench/vllm_step.py --n 64,256,1024 --steps 300
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

from tests.integrations.vllm_harness import (  # noqa: E402
    BLOCK_SIZE,
    EngineLoop,
    Layout,
    Speculation,
    make_scheduler,
    scheduler_classes,
)

TIMED = ("allocate_slots", "get_computed_blocks", "free", "get_blocks", "take_events", "cache_blocks")
MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "async": {"async_scheduling": True},
    "ngram2": {"speculation": Speculation("ngram", 2)},
    "ngram4": {"speculation": Speculation("ngram", 4)},
    "eagle2": {"speculation": Speculation("eagle", 2)},
    "eagle4": {"speculation": Speculation("eagle", 4)},
    "async-eagle4": {"async_scheduling": True, "speculation": Speculation("eagle", 4)},
    "async-ngram4": {"async_scheduling": True, "v2_runner": True, "speculation": Speculation("ngram", 4)},
}


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


def run(ours: bool, mode: str, n: int, steps: int, seed: int, events: bool = True) -> dict[str, float]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    options = MODES[mode]
    scheduler_cls = scheduler_classes(options.get("async_scheduling", False))[ours]
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 1000) for _ in range(128)] for _ in range(8)]
    max_len = 1024
    blocks = n * (max_len // BLOCK_SIZE + 2) + 64
    sched = make_scheduler(
        scheduler_cls,
        blocks,
        Layout(),
        max_num_seqs=n,
        max_num_batched_tokens=n * 9 + 4096,
        max_model_len=max_len + 64,
        events=events,
        **options,
    )
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256_cbor, sched.vllm_config.num_hash_lookahead_tokens)
    counter = [0]

    def new_request() -> Any:
        i = counter[0]
        counter[0] += 1
        head = systems[rng.randrange(8)] if rng.random() < 0.25 else []
        prompt = head + [rng.randrange(1, 1000) for _ in range(250 - len(head) + rng.randrange(-40, 40))]
        out = min(1 + int(rng.expovariate(1 / 128)), max_len - len(prompt))
        return Request(
            f"q{i}",
            prompt,
            SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True),
            pooling_params=None,
            block_hasher=hasher,
        )

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
    engine = EngineLoop(sched)
    counter_gc = Gc()
    gc.callbacks.append(counter_gc)
    step_ns: list[int] = []
    mgr_ns: list[int] = []
    gcs = tokens = 0
    warm = 60  # prefills done, the batch decoding, the churn going
    try:
        for step in range(warm + steps):
            t0 = time.perf_counter_ns()
            spent[0] = 0
            before = counter_gc.count
            out, _ = engine.step(step)
            t1 = time.perf_counter_ns()
            if step >= warm:
                step_ns.append(t1 - t0)
                mgr_ns.append(spent[0])
                gcs += counter_gc.count - before
                tokens += out.total_num_scheduled_tokens if out is not None else 0
            for _ in range(n - len(sched.running) - len(sched.waiting)):  # replace the ones that ended
                sched.add_request(new_request())
    finally:
        gc.callbacks.remove(counter_gc)
    return {
        "step_us": statistics.median(step_ns) / 1e3,
        "mean_step_us": statistics.fmean(step_ns) / 1e3,
        "manager_us": statistics.median(mgr_ns) / 1e3,
        "gc_per_step": gcs / steps,
        "tokens_per_step": tokens / steps,
        "running": len(sched.running),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="64,256,1024", help="running requests, comma-separated")
    parser.add_argument(
        "--modes",
        default="sync,async,ngram2,ngram4,eagle2,eagle4,async-eagle4",
        help=f"comma-separated, of {', '.join(MODES)}",
    )
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per N (the median is shown)")
    parser.add_argument(
        "--events",
        choices=("on", "off"),
        default="on",
        help="KV cache events (vLLM's enable_kv_cache_events; off is vLLM's default)",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    import vllm

    print(
        f"vLLM {vllm.__version__}, Python {sys.version.split()[0]}, GC on, KV events {args.events}; median over "
        f"{args.repeats} alternating runs of {args.steps} steps\n"
    )
    print(
        "| mode | running | tokens/step | vLLM step us | pagedkv step us | step ratio | vLLM manager us |"
        " pagedkv manager us | manager ratio | GC/step vLLM | GC/step pagedkv |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in modes:
        for n in (int(x) for x in args.n.split(",")):
            results: dict[str, list[dict[str, float]]] = {"vllm": [], "pagedkv": []}
            for r in range(args.repeats):
                for name in ("vllm", "pagedkv"):
                    results[name].append(
                        run(name == "pagedkv", mode, n, args.steps, seed=r, events=args.events == "on")
                    )
            med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in results.items()}
            a, b = med["vllm"], med["pagedkv"]
            print(
                f"| {mode} | {n} | {a['tokens_per_step']:.0f} | {a['step_us']:.0f} | {b['step_us']:.0f} | "
                f"{b['step_us'] / a['step_us']:.2f} | {a['manager_us']:.0f} | {b['manager_us']:.0f} | "
                f"{b['manager_us'] / a['manager_us']:.2f} | {a['gc_per_step']:.2f} | {b['gc_per_step']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
