"""Two GPUs with NCCL vs one: the tensor-parallel engine's tokens and decode-step time.

SmolLM2's shapes with seeded random weights (the 93 MB weights package cannot travel to the device
machine), fp32, greedy, 64-token prompts, 32 new tokens; batch 1, 8 and 64. Decode steps only
(steps with no prefill), median ms. Checks 2-GPU tokens == 1-GPU tokens.

    python bench/gpu_ranks.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics

import torch

from pagedkv.shell.sampling import SamplingParams
from pagedkv.app.ranks import run_ranks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    rng = random.Random(0)
    rows = []
    same = True
    for batch in (1, 8, 64):
        reqs = [
            (f"p{i}", [rng.randrange(49152) for _ in range(64)], SamplingParams(temperature=0.0, max_tokens=32))
            for i in range(batch)
        ]
        res = {}
        for world in (1, 2):
            r = run_ranks(
                world,
                reqs,
                backend="nccl",
                weights="random",
                timeout_s=300,
                kv_cache_memory_bytes=4 << 30,
                max_num_seqs=max(batch, 4),
                max_num_batched_tokens=8192,
            )[0]
            assert "error" not in r, r.get("error")
            decode = [sec for d, p, sec in r["step_seconds"] if d and not p]
            res[world] = (r["completions"], statistics.median(decode) * 1e3)
        equal = res[1][0] == res[2][0]
        same &= equal
        rows.append(
            {
                "batch": batch,
                "ms_1gpu": round(res[1][1], 2),
                "ms_2gpu": round(res[2][1], 2),
                "ratio": round(res[2][1] / res[1][1], 2),
                "tokens_equal": equal,
            }
        )
    lines = [
        f"device: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}, NCCL "
        f"{'.'.join(map(str, torch.cuda.nccl.version()))}; SmolLM2 shapes, random weights, fp32, torch backend",
        f"{'batch':>6} {'1 GPU ms/step':>14} {'2 GPUs ms/step':>15} {'2/1':>6}  tokens equal",
    ]
    lines += [
        f"{r['batch']:>6} {r['ms_1gpu']:>14.2f} {r['ms_2gpu']:>15.2f} {r['ratio']:>6.2f}  {r['tokens_equal']}"
        for r in rows
    ]
    print("\n".join(lines))
    with open(os.path.join(args.out, "gpu_ranks.txt"), "w") as f:
        f.write("\n".join(lines) + "\n" + "\n".join(json.dumps(r) for r in rows) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
