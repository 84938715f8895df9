"""Scheduler cost per step: schedule + on_output with every running request decoding, GC on.

For 64, 256 and 1024 running requests (16-token blocks, prefix caching on, prompts of
128-143 tokens so that a sixteenth of the rows cross a block boundary each step), the
requests are brought to steady decode, then steps are timed with CPython's GC on at its
default thresholds (after one ``gc.freeze()`` of the start-up state, as vLLM's engine does),
counting collections per step with ``gc.callbacks``. In the same run, the core's own step
for the same batch: one ``decode_step`` (commit every row through its length, append the
sampled ids), the bookkeeping an engine that drives the core directly pays. The ratio is
what the scheduler's policy, its plan and its metadata snapshot add on top.

    python bench/scheduler.py            # a table
    python bench/scheduler.py --json     # one JSON object per size
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from pagedkv.core import CacheConfig, decode_step
from pagedkv.core.scheduler import SchedulerConfig, SeqRequest, new_scheduler, on_output, schedule, submit

STEPS = 32


class Collections:
    """Counts the cyclic GC's collections (gc.callbacks) while it is entered."""

    def __init__(self) -> None:
        self.count = 0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        self.count += phase == "start"

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)


def measure(n: int, trials: int) -> dict[str, float]:
    r = random.Random(n)
    blocks = n * 64 + 1
    s = new_scheduler(
        CacheConfig(block_size=16, num_blocks=blocks, enable_prefix_caching=True),
        SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=n * 144),
    )
    for i in range(n):
        prompt = tuple(r.randrange(32_000) for _ in range(128 + i % 16))
        s = submit(s, SeqRequest(i, prompt, max_tokens=10**6)).unwrap()
    s, plan = schedule(s).unwrap()  # every prompt in one step
    s, _ = on_output(s, {i: 7 for i in range(n)}).unwrap()
    sampled = {i: r.randrange(32_000) for i in range(n)}
    gc.collect()
    gc.freeze()
    try:
        step_us, runs = [], 0
        for _ in range(trials):
            with Collections() as c:
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    s, plan = schedule(s).unwrap()
                    s, _ = on_output(s, sampled).unwrap()
                step_us.append((time.perf_counter() - t0) / STEPS * 1e6)
            runs += c.count
        assert len(plan.decode) == n
        kv = s.kv
        ids, toks = list(range(n)), [sampled[i] for i in range(n)]
        core_us, core_runs = [], 0
        for _ in range(trials):
            with Collections() as c:
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    kv = decode_step(kv, ids, toks).unwrap().state
                core_us.append((time.perf_counter() - t0) / STEPS * 1e6)
            core_runs += c.count
    finally:
        gc.unfreeze()
    sched, core = statistics.median(step_us), statistics.median(core_us)
    return {
        "running": n,
        "sched_us_per_step": sched,
        "core_us_per_step": core,
        "ratio": sched / core,
        "sched_us_per_request": sched / n,
        "gc_runs_per_step": runs / (trials * STEPS),
        "core_gc_runs_per_step": core_runs / (trials * STEPS),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    rows = [measure(n, args.trials) for n in args.sizes]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(
        f"{'running':>8} {'schedule+on_output us':>22} {'core decode_step us':>20} {'ratio':>6} "
        f"{'us/request':>10} {'GC runs/step':>12} {'core GC runs/step':>17}"
    )
    for row in rows:
        print(
            f"{row['running']:>8} {row['sched_us_per_step']:>22.0f} {row['core_us_per_step']:>20.0f} "
            f"{row['ratio']:>5.2f}x {row['sched_us_per_request']:>10.2f} {row['gc_runs_per_step']:>12.2f} "
            f"{row['core_gc_runs_per_step']:>17.2f}"
        )


if __name__ == "__main__":
    main()
