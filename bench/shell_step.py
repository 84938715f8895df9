"""Shell cost per step on the CPU: installing a decode step's metadata, and one layer's KV write.

256 running rows decode; each step every row grows by one token, so a new block
appears on 1/16 of them (block size 16). `install` validates the snapshot and
writes only what changed (new block ids, lengths, slots). The baseline in the
same run installs the same snapshot into a fresh worker (every block id written).
The KV write is one layer's K and V for the step's 256 tokens through the slot
mapping (SmolLM2's 3 KV heads of 64, fp32).

    python bench/shell_step.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, append_decode, commit_many, initial_state, publish
from pagedkv.shell.pool import PagePool
from pagedkv.shell.worker import Worker

ROWS, STEPS, BLOCK = 256, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = CacheConfig(block_size=BLOCK, num_blocks=ROWS * 16 + 1)
    s = initial_state(cfg)
    ids = list(range(ROWS))
    for i in ids:
        s = admit(s, RequestSpec(i, (RowSpec(100 + (i * 7) % 60),))).unwrap().state
    s = commit_many(s, [(i, [s.row_len[s.requests[i].slots[0]]]) for i in ids]).unwrap().state
    metas = []
    for _ in range(STEPS):  # the snapshots of STEPS decode steps, built by the core beforehand
        s = append_decode(s, ids).unwrap().state
        metas.append(publish(s, ids, "decode").unwrap().effect)
        s = commit_many(s, [(i, [s.row_len[s.requests[i].slots[0]]]) for i in ids]).unwrap().state
    w = Worker(cfg, max_rows=ROWS, max_blocks_per_row=32, max_tokens=ROWS)
    w.install(metas[0])
    t0 = time.perf_counter()
    for m in metas[1:]:
        w.install(m)
    install_us = (time.perf_counter() - t0) / (STEPS - 1) * 1e6
    full = []
    for m in metas[1:9]:
        fresh = Worker(cfg, max_rows=ROWS, max_blocks_per_row=32, max_tokens=ROWS)
        t0 = time.perf_counter()
        fresh.install(m)
        full.append((time.perf_counter() - t0) * 1e6)
    pool = PagePool(cfg, num_layers=1, kv_heads=3, head_dim=64)
    k, v = torch.randn(ROWS, 3, 64), torch.randn(ROWS, 3, 64)
    slots = w.slot_mapping[:ROWS].clone()
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        pool.write(0, k, v, slots)
        times.append((time.perf_counter() - t0) * 1e6)
    write_us = statistics.median(times)
    base_write = []
    flat_k = pool.k[0].view(-1, 3, 64)
    for _ in range(200):  # baseline: a Python loop of per-token row writes
        t0 = time.perf_counter()
        for t in range(0, ROWS, 16):
            flat_k[slots[t : t + 16]] = k[t : t + 16]
        base_write.append((time.perf_counter() - t0) * 1e6)
    row = {
        "rows": ROWS,
        "us_per_install": round(install_us, 1),
        "us_full_install": round(statistics.median(full), 1),
        "us_per_kv_write": round(write_us, 1),
    }
    if args.json:
        print(json.dumps(row))
        return
    print(f"shell step on the CPU, {ROWS} decode rows, block size {BLOCK}, 1 torch thread")
    print(f"{'what':<34} {'us':>9} {'baseline us':>12} {'ratio':>6}")
    print(
        f"{'install (incremental)':<34} {install_us:>9.1f} {statistics.median(full):>12.1f} "
        f"{install_us / statistics.median(full):>6.2f}   baseline: full install into a fresh worker"
    )
    print(
        f"{'KV write, one layer (index_copy_)':<34} {write_us:>9.1f} {statistics.median(base_write):>12.1f} "
        f"{write_us / statistics.median(base_write):>6.2f}   baseline: 16-token chunks by indexing"
    )


if __name__ == "__main__":
    main()
