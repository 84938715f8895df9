"""Scheduler cost per step: schedule + on_output with every running request decoding.

For 64, 256 and 1024 running requests (16-token blocks, 128-token prompts, prefix
caching off), the requests are first brought to steady decode, then steps are
timed. The baseline in the same run is the core's own decode bookkeeping for the
same batch (append_decode), so the ratio is what the scheduler's policy adds.

    python bench/scheduler.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedkv.core import CacheConfig, append_decode
from pagedkv.core.scheduler import SchedulerConfig, SeqRequest, new_scheduler, on_output, schedule, submit

PROMPT = 128
STEPS = 32


def measure(n: int, trials: int) -> dict[str, float]:
    blocks = n * ((PROMPT + STEPS * (2 * trials + 2) + 15) // 16 + 1) + 1  # scheduler steps, then baseline steps
    s = new_scheduler(CacheConfig(block_size=16, num_blocks=blocks),
                      SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=n * PROMPT))  # fmt: skip
    for i in range(n):
        s = submit(s, SeqRequest(i, tuple(range(i, i + PROMPT)), max_tokens=10**6)).unwrap()
    s, plan = schedule(s).unwrap()  # every prompt in one step
    s, _ = on_output(s, {i: 7 for i in range(n)}).unwrap()
    sampled = {i: 7 for i in range(n)}
    step_us = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            s, plan = schedule(s).unwrap()
            s, _ = on_output(s, sampled).unwrap()
        step_us.append((time.perf_counter() - t0) / STEPS * 1e6)
    assert len(plan.decode) == n
    kv = s.kv
    base = []
    ids = list(range(n))
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            kv = append_decode(kv, ids).unwrap().state
        base.append((time.perf_counter() - t0) / STEPS * 1e6)
    return {"running": n, "us_per_step": statistics.median(step_us), "base_us_per_step": statistics.median(base)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    rows = [measure(n, args.trials) for n in args.sizes]
    if args.json:
        for r in rows:
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))
        return
    print("schedule + on_output per decode step; baseline: append_decode alone (the core's bookkeeping), same run")
    print(f"{'running':>8} {'us/step':>10} {'us/request':>11} {'baseline':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['running']:>8} {r['us_per_step']:>10.0f} {r['us_per_step'] / r['running']:>11.2f} "
              f"{r['base_us_per_step']:>10.0f} {r['us_per_step'] / r['base_us_per_step']:>6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
