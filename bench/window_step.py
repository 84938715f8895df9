"""What a windowed group adds to the core's decode step: ``decode_step`` (each row's last token committed and
cached, the sampled id appended) over N one-row requests, GC on, for a pool of full attention alone and for
full attention beside a sliding window and beside a chunked-local group, in one run. The reference is the
full-attention pool's step in the same run: the ratio is what the window costs (the commit loop serves a
window's row itself unless the row's first visible block moves, which lets a block go: once a block per row).

    python bench/window_step.py                      # N = 64, 256, 1024
    python bench/window_step.py --sizes 256 --steps 128
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from pagedkv.core import CacheConfig, GroupKind, GroupSpec, RequestSpec, RowSpec, admit, decode_step, initial_state

BLOCK = 16
LAYOUTS: dict[str, tuple[GroupSpec, ...]] = {
    "full": (GroupSpec("full"),),
    "full + window 128": (GroupSpec("full"), GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=128)),
    "full + chunk 256": (GroupSpec("full"), GroupSpec("local", GroupKind.CHUNKED_LOCAL, chunk=256)),
}


class Collections:
    """CPython's collections while active (all generations)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        self.count += phase == "start"


def measure(groups: tuple[GroupSpec, ...], n: int, steps: int, trials: int) -> tuple[float, float]:
    """The median step in µs over ``trials`` rounds of ``steps`` decode steps, and collections a step."""
    prompt = [200 + (i * 37) % 300 for i in range(n)]
    blocks = sum(-(-(p + steps * trials + 2) // BLOCK) for p in prompt) * len(groups) + 1
    s = initial_state(CacheConfig(block_size=BLOCK, num_blocks=blocks, groups=groups, enable_prefix_caching=True))
    for i, p in enumerate(prompt):
        s = admit(s, RequestSpec(i, (RowSpec.of_tokens([i * 7919 + k for k in range(p)]),))).unwrap().state
        s = decode_step(s, [i], [1]).unwrap().state  # the prompt computed, its first token sampled
    ids, tokens = list(range(n)), [5] * n
    counter = Collections()
    gc.callbacks.append(counter)
    per_step = []
    try:
        for _ in range(trials):
            t0 = time.perf_counter()
            for _ in range(steps):
                s = decode_step(s, ids, tokens).unwrap().state
            per_step.append((time.perf_counter() - t0) / steps * 1e6)
    finally:
        gc.callbacks.remove(counter)
    return statistics.median(per_step), counter.count / (steps * trials)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=64, help="decode steps a round (4 of 64 cross a block per row)")
    ap.add_argument("--trials", type=int, default=5, help="rounds; the median is kept")
    args = ap.parse_args()
    print(f"decode_step (commit and append) per step, block size {BLOCK}, prefix caching on, GC on; median of rounds")
    print()
    print("| running | layout | step µs | ns a row | / full | GC a step |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in args.sizes:
        full = None
        for name, groups in LAYOUTS.items():
            us, collections = measure(groups, n, args.steps, args.trials)
            full = us if full is None else full
            print(f"| {n} | {name} | {us:.0f} | {us * 1e3 / n:.0f} | {us / full:.2f} | {collections:.2f} |")


if __name__ == "__main__":
    main()
