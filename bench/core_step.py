"""Bookkeeping cost of the pure core: one decode step, one admit, one release.

For 64, 256 and 1024 running requests with 16-token blocks, every running
request appends one token per decode step (``append_decode``: one transition,
one new snapshot per step). The baseline in the same run is a mutable block
manager in the style of nano-vllm's (a deque of free ids, a list block table per
sequence, mutated in place), doing the same bookkeeping; the ratio is ours over it.

    python bench/core_step.py            # a table
    python bench/core_step.py --json     # one JSON object per size
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, append_decode, initial_state, release

BLOCK = 16
STEPS = 64  # decode steps timed per trial; 4 of 64 cross a block boundary per request


def prompt_len(i: int) -> int:
    return 100 + (i * 37) % 400  # deterministic spread of prompt lengths


class MutableBlockManager:
    """The baseline: what a mutable manager does for the same events."""

    def __init__(self, num_blocks: int) -> None:
        self.free = deque(range(1, num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def admit(self, rid: int, n: int) -> None:
        need = -(-n // BLOCK)
        if need > len(self.free):
            raise RuntimeError("no capacity")
        self.tables[rid] = [self.free.popleft() for _ in range(need)]
        self.lens[rid] = n

    def decode(self, rids: list[int]) -> None:
        for rid in rids:
            n = self.lens[rid] + 1
            self.lens[rid] = n
            table = self.tables[rid]
            if n > len(table) * BLOCK:
                if not self.free:
                    raise RuntimeError("no capacity")
                table.append(self.free.popleft())

    def release(self, rid: int) -> None:
        self.free.extend(reversed(self.tables.pop(rid)))
        del self.lens[rid]


def measure(n: int, trials: int) -> dict[str, float]:
    num_blocks = sum(-(-(prompt_len(i) + STEPS * trials + 1) // BLOCK) for i in range(n)) + 1
    cfg = CacheConfig(block_size=BLOCK, num_blocks=num_blocks)
    ids = list(range(n))
    specs = [RequestSpec(i, (RowSpec(prompt_len(i)),)) for i in ids]

    s = initial_state(cfg)
    t0 = time.perf_counter()
    for spec in specs:
        s = admit(s, spec).unwrap().state
    admit_us = (time.perf_counter() - t0) / n * 1e6
    step_us = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            s = append_decode(s, ids).unwrap().state
        step_us.append((time.perf_counter() - t0) / STEPS * 1e6)
    t0 = time.perf_counter()
    for i in ids:
        s = release(s, i, "finished").unwrap().state
    release_us = (time.perf_counter() - t0) / n * 1e6
    assert s.free_blocks == cfg.usable_blocks

    m = MutableBlockManager(num_blocks)
    t0 = time.perf_counter()
    for i in ids:
        m.admit(i, prompt_len(i))
    base_admit = (time.perf_counter() - t0) / n * 1e6
    base_step = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            m.decode(ids)
        base_step.append((time.perf_counter() - t0) / STEPS * 1e6)
    t0 = time.perf_counter()
    for i in ids:
        m.release(i)
    base_release = (time.perf_counter() - t0) / n * 1e6
    return {
        "running": n,
        "us_per_step": statistics.median(step_us),
        "us_per_admit": admit_us,
        "us_per_release": release_us,
        "base_us_per_step": statistics.median(base_step),
        "base_us_per_admit": base_admit,
        "base_us_per_release": base_release,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per size")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--trials", type=int, default=5, help="timed rounds of 64 decode steps; the median is kept")
    args = ap.parse_args()
    rows = [measure(n, args.trials) for n in args.sizes]
    if args.json:
        for r in rows:
            print(
                json.dumps(
                    {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if not k.startswith("base_")}
                )
            )
        return
    print(f"decode-step bookkeeping, block size {BLOCK}; baseline: a mutable nano-vllm-style manager, same run")
    print(
        f"{'running':>8} {'us/step':>10} {'base':>10} {'ratio':>6} {'us/admit':>9} {'base':>7} {'ratio':>6} "
        f"{'us/release':>10} {'base':>7} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['running']:>8} {r['us_per_step']:>10.1f} {r['base_us_per_step']:>10.1f} "
            f"{r['us_per_step'] / r['base_us_per_step']:>6.2f} {r['us_per_admit']:>9.2f} "
            f"{r['base_us_per_admit']:>7.2f} {r['us_per_admit'] / r['base_us_per_admit']:>6.2f} "
            f"{r['us_per_release']:>10.2f} {r['base_us_per_release']:>7.2f} "
            f"{r['us_per_release'] / r['base_us_per_release']:>6.2f}"
        )


if __name__ == "__main__":
    main()
