"""Paged KV vs dense full-length reservation for diffusion requests at the same pool budget.

Each request has two CFG rows (a conditional prompt of 8-200 tokens, an unconditional one of
2-16, a reference image of 0 or 64 tokens, a 257-token target: timestep + 256 image tokens).
Dense reservation keeps every row at the longest possible length (200 + 64 + 257 tokens); the
paged path takes ceil(row / block_size) blocks per row through the core's admission. Both fill
the same budget with requests from the same stream, in order, until the next one does not fit.

    python bench/diffusion.py
"""

from __future__ import annotations

import random

from returns.result import Success

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state

BLOCK = 16
TOKEN_BYTES = 2 * 24 * 8 * 128 * 2  # K and V, 24 layers, 8 KV heads of 128, bf16
MAX_ROW = 200 + 64 + 257


def stream(n: int, seed: int = 0) -> list[tuple[RowSpec, RowSpec]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ref = rng.choice([0, 64])
        cond, uncond = rng.randrange(8, 201) + ref, rng.randrange(2, 17) + ref
        out.append((RowSpec(cond + 257, prefix_len=cond, target_len=257),
                    RowSpec(uncond + 257, prefix_len=uncond, target_len=257)))  # fmt: skip
    return out


def main() -> None:
    reqs = stream(10_000)
    print(f"two CFG rows per request; {TOKEN_BYTES} bytes of KV per token; block size {BLOCK}; "
          "baseline: dense full-length reservation, same budget, same stream")  # fmt: skip
    print(f"{'budget GiB':>10} {'paged reqs':>11} {'paged KV GiB':>13} {'dense reqs':>11} {'dense KV GiB':>13} "
          f"{'ratio':>6}")  # fmt: skip
    for gib in (1, 4, 16):
        budget = gib << 30
        blocks = budget // (TOKEN_BYTES * BLOCK)
        s = initial_state(CacheConfig(block_size=BLOCK, num_blocks=blocks + 1))
        paged = 0
        for i, rows in enumerate(reqs):
            r = admit(s, RequestSpec(i, rows))
            if not isinstance(r, Success):
                break
            s = r.unwrap().state
            paged += 1
        peak = (blocks - s.free_blocks) * BLOCK * TOKEN_BYTES
        dense = budget // (2 * MAX_ROW * TOKEN_BYTES)
        print(f"{gib:>10} {paged:>11} {peak / 2**30:>13.2f} {dense:>11} {dense * 2 * MAX_ROW * TOKEN_BYTES / 2**30:>13.2f} "
              f"{paged / max(dense, 1):>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
