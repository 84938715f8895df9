"""Admission with prefix caching: a shared 512-token system prompt among 30% of requests.

A stream of requests runs through the core with up to 64 running at once: each is
admitted (timed), fully computed (commit, which fills the cache), and released when
the 64 after it have arrived. Prompts: 30% are the shared 512-token system prompt
plus a 32-255-token user turn; the rest are unique 128-767-token prompts. The
baseline in the same run is the same stream with prefix caching off.

    python bench/prefix.py              # table for 1k and 10k requests
    python bench/prefix.py --json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import deque

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, commit, initial_state, release

BLOCK = 16
RUNNING = 64


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(49152) for _ in range(512)]
    out = []
    for _ in range(n):
        if rng.random() < 0.3:
            out.append(system + [rng.randrange(49152) for _ in range(rng.randrange(32, 256))])
        else:
            out.append([rng.randrange(49152) for _ in range(rng.randrange(128, 768))])
    return out


def run(stream: list[list[int]], caching: bool) -> dict[str, float]:
    num_blocks = RUNNING * (800 // BLOCK) * 2 + 1
    s = initial_state(CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=caching))
    running: deque[int] = deque()
    admit_s = 0.0
    for i, toks in enumerate(stream):
        spec = RequestSpec(i, (RowSpec.of_tokens(toks),))
        t0 = time.perf_counter()
        s = admit(s, spec).unwrap().state
        admit_s += time.perf_counter() - t0
        s = commit(s, i, [len(toks)]).unwrap().state
        running.append(i)
        if len(running) > RUNNING:
            s = release(s, running.popleft(), "finished").unwrap().state
    return {"us_per_admit": admit_s / len(stream) * 1e6, "hit_rate": s.prefix_hit_rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    args = ap.parse_args()
    rows = []
    for n in args.sizes:
        stream = prompts(n)
        on, off = run(stream, True), run(stream, False)
        rows.append(
            {
                "requests": n,
                "hit_rate": round(on["hit_rate"], 4),
                "us_per_admit": round(on["us_per_admit"], 2),
                "baseline_us_per_admit": round(off["us_per_admit"], 2),
            }
        )
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"prefix caching, block size {BLOCK}, {RUNNING} running; baseline = caching off, same stream, same run")
    print(f"{'requests':>9} {'hit rate':>9} {'us/admit':>9} {'caching off':>12} {'ratio':>6}")
    for r in rows:
        ratio = r["us_per_admit"] / r["baseline_us_per_admit"]
        print(
            f"{r['requests']:>9} {r['hit_rate']:>9.3f} {r['us_per_admit']:>9.1f} {r['baseline_us_per_admit']:>12.1f} "
            f"{ratio:>6.2f}"
        )


if __name__ == "__main__":
    main()
