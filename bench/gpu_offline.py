"""Offline throughput of a large checkpoint against its compute floor: a Llama of the given shapes (random init,
built on the GPU with transformers in bf16; its config read by pagedkv's checkpoint reader, the weights handed
over in memory instead of a 16 GB write and read), ShareGPT-like prompts (lognormal lengths, median ~150
tokens) x ``--new`` tokens each, no early stop, served by one ``generate`` call, without and with overlapped
scheduling. The floor: the matrix products' FLOPs (every token through every layer, the LM head once a
sampled token) at ``--tflops`` (the H200's dense bf16, ~790). Then a breakdown of the same run with each
step timed (the device synchronised a step): decode-only and mixed steps, their count and time.

    python bench/gpu_offline.py --shape llama-8b
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root
from bench.gpu_serve import WORDS  # noqa: E402
from bench.llama_shapes import SHAPES, build  # noqa: E402
from pagedkv.models.gguf import load_tokenizer_meta  # noqa: E402
from pagedkv.models.llama import Llama  # noqa: E402
from pagedkv.models.tokenizer import Tokenizer  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.engine_args import freeze_startup  # noqa: E402
from pagedkv.shell.sampling import SamplingParams  # noqa: E402


def prompts(tok: Tokenizer, n: int, new: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        plen = min(max(int(rng.lognormvariate(5.0, 0.8)), 8), 1500)
        ids = tok.encode(" ".join(rng.choice(WORDS) for _ in range(plen)))[:plen]
        out.append(("", ids, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)))
    return out


def engine(model: Llama, tok: Tokenizer, args: argparse.Namespace, **kw: object) -> Engine:
    """The engine every run of this bench serves with: prefix caching off (every run computes every prompt token:
    the floor counts them all)."""
    return Engine(
        model,
        tok,
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.budget,
        enable_prefix_caching=False,
        **kw,
    )


def kind(name: str) -> str:
    """A device kernel's kind, from its name: where a run's device time goes."""
    n = name.lower()
    if any(k in n for k in ("_rms_kernel", "_rope_write_kernel", "_silu_mul_kernel")):
        return "fused elementwise (shell.fused)"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")):
        return "matrix products"
    if any(k in n for k in ("paged_decode", "_decode_", "split", "merge")):
        return "decode attention"
    if any(k in n for k in ("varlen", "flash", "prefill", "attn")):
        return "prefill attention"
    if "kv_write" in n or "index_copy" in n or "index_put" in n:
        return "KV write"
    if any(k in n for k in ("reduce", "mean", "norm")):
        return "norms (reductions)"
    if "cat" in n:
        return "concatenations"
    if any(k in n for k in ("elementwise", "vectorized", "unrolled", "copy")):
        return "elementwise"
    return "other"


def profile(model: Llama, tok: Tokenizer, reqs: list, args: argparse.Namespace) -> None:
    """Where one overlapped ``generate`` of every prompt spends the device's time: its kernels grouped by kind
    (device time each, its share of the run's wall time), and the device's idle time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    eng = engine(model, tok, args, async_scheduling=True)
    eng.generate(reqs[:8])
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        t = time.perf_counter()
        eng.generate(reqs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kinds: dict[str, list[float]] = {}
    top: dict[str, float] = {}
    for e in p.key_averages():
        us = e.device_time_total
        if us <= 0:
            continue
        kinds.setdefault(kind(e.key), [0.0, 0])
        kinds[kind(e.key)][0] += us / 1e6
        kinds[kind(e.key)][1] += e.count
        top[e.key] = top.get(e.key, 0.0) + us / 1e6
    busy = sum(v[0] for v in kinds.values())
    print(
        f"one overlapped generate: {wall:.2f} s wall (profiled), device busy {busy:.2f} s, idle {wall - busy:.2f} s\n"
    )
    print("| kernels | device s | of wall | launches |\n|---|---:|---:|---:|")
    for k, (s, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"| {k} | {s:.2f} | {s / wall:.1%} | {n:,} |")
    print("\n| kernel | device s |\n|---|---:|")
    for k, s in sorted(top.items(), key=lambda kv: -kv[1])[:25]:
        print(f"| {k[:90]} | {s:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--tflops", type=float, default=790.0)
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (--shape tiny)")
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument(
        "--profile", action="store_true", help="only: where one overlapped run's device time goes (its kernels by kind)"
    )
    args = ap.parse_args()
    tok = Tokenizer(load_tokenizer_meta())
    t0 = time.perf_counter()
    model, layer_params, head = build(args.shape, args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}, torch {torch.__version__}; {args.shape} shapes, random init, bf16 "
        f"({layer_params / 1e9:.2f} B matrix parameters a token + LM head {head / 1e6:.0f} M), built in "
        f"{time.perf_counter() - t0:.0f} s; max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.budget}\n"
    )
    reqs = prompts(tok, args.prompts, args.new)
    ptoks, new = sum(len(r[1]) for r in reqs), args.prompts * args.new
    flops = 2 * layer_params * (ptoks + new) + 2 * head * new
    floor = flops / (args.tflops * 1e12)
    freeze_startup()
    if args.profile:
        profile(model, tok, reqs, args)
        return
    print(
        f"{args.prompts} prompts ({ptoks} tokens) x {args.new} new tokens; matrix products' floor {floor:.2f} s\n\n"
        "| scheduling | seconds | tokens/s (new) | / floor | steps |\n|---|---:|---:|---:|---:|"
    )
    timed = None
    for overlap in (False, True):
        eng = engine(model, tok, args, async_scheduling=overlap)
        eng.generate(reqs[:4])  # warm (first calls' set-up)
        steps0 = eng.stats.steps
        sync()
        t = time.perf_counter()
        out = eng.generate(reqs)
        sync()
        dt = time.perf_counter() - t
        assert all(len(c.token_ids) == args.new for c in out)
        print(
            f"| {'overlapped' if overlap else 'plain'} | {dt:.2f} | {new / dt:,.0f} | {dt / floor:.2f}x | "
            f"{eng.stats.steps - steps0} |",
            flush=True,
        )
        if not overlap:
            timed = eng
        del eng
    if args.no_breakdown or timed is None:
        return
    timed.step_times = []
    timed.generate(reqs)
    decode = [s for r, p, s in timed.step_times if p == 0]
    mixed = [(r, p, s) for r, p, s in timed.step_times if p > 0]
    print(
        "\nthe plain run again, each step timed (synchronised):\n\n| steps | count | seconds | ms a step (median) | "
        "tokens |\n|---|---:|---:|---:|---:|"
    )
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3 if xs else 0.0  # noqa: E731
    rows = sum(r for r, p, _ in timed.step_times if p == 0)
    print(f"| decode only | {len(decode)} | {sum(decode):.2f} | {med(decode):.2f} | {rows} decode |")
    print(
        f"| with prefill | {len(mixed)} | {sum(s for *_, s in mixed):.2f} | {med([s for *_, s in mixed]):.2f} | "
        f"{sum(p for _, p, _ in mixed)} prompt + {sum(r for r, _, _ in mixed)} decode |"
    )


if __name__ == "__main__":
    main()
