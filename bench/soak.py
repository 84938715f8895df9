"""An engine serving many small requests: does what it holds, and what a step costs, stay flat?

A small random Llama (its weights are not the point: the engine's records are) serves --requests requests of a
few tokens each, --batch at a time, through the step-level API, with and without a trace recorded to a file
(the digest of every event), the GC on as engines run it. Every --window requests it prints the process's
RSS, the engine's live records, the mean step time over the window and the GC's collections a step; then
the last window over the first (the goal: within 10%).

    python bench/soak.py                   # 20,000 requests, both modes
    python bench/soak.py --requests 4000 --modes trace
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from dataclasses import replace

import torch

from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams

CFG = replace(
    SMOLLM2_SHAPES,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position=256,
)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(model: object, requests: int, batch: int, window: int, trace_path: str | None) -> list[tuple[int, ...]]:
    collections = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections[0] += 1

    trace = open(trace_path, "w", encoding="utf-8") if trace_path else None  # noqa: SIM115 - closed below
    eng = Engine(model, IdTokenizer(), block_size=16, kv_cache_memory_bytes=4 << 20, max_num_seqs=batch, trace=trace)
    gc.callbacks.append(count)
    rows, served, sent, steps, step_s, gcs = [], 0, 0, 0, 0.0, 0
    try:
        while served < requests:
            while sent < requests and len(eng.state.live) < batch:
                prompt = [(sent * 7 + j) % 250 + 1 for j in range(6 + sent % 7)]
                eng.add_request(f"r{sent}", "", prompt, SamplingParams(temperature=0.0, max_tokens=2 + sent % 3))
                sent += 1
            before, t0 = collections[0], time.perf_counter()
            served += len(eng.step())
            step_s += time.perf_counter() - t0
            gcs += collections[0] - before
            steps += 1
            if served >= (len(rows) + 1) * window:
                live = len(eng.requests) + len(eng.state.seqs)  # (the engine's and the scheduler's records)
                rows.append((served, rss_mib(), live, step_s / steps * 1e3, gcs / steps))
                steps, step_s, gcs = 0, 0.0, 0
        if trace is not None:
            eng.finish_trace()
    finally:
        gc.callbacks.remove(count)
        if trace is not None:
            trace.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--window", type=int, default=2_000)
    ap.add_argument("--modes", nargs="+", default=["plain", "trace"], choices=["plain", "trace"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = random_llama(CFG, seed=1)
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as d:
            rows = soak(
                model, args.requests, args.batch, args.window, os.path.join(d, "t.jsonl") if mode == "trace" else None
            )
        print(f"\n{mode}: {args.requests} requests, {args.batch} at a time, GC on (CPython {gc.get_threshold()})")
        print(f"{'served':>8} {'RSS MiB':>9} {'live recs':>9} {'step ms':>8} {'GC/step':>8}")
        for served, rss, live, ms, g in rows:
            print(f"{served:>8} {rss:>9.1f} {live:>9} {ms:>8.3f} {g:>8.3f}")
        (_, rss0, _, ms0, _), (_, rss1, _, ms1, _) = rows[0], rows[-1]
        print(f"last window / first: RSS {rss1 / rss0:.3f}, step time {ms1 / ms0:.3f}")


if __name__ == "__main__":
    main()
