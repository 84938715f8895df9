"""``pagedkv serve`` under load (issue 52): a server on loopback over SmolLM2, Poisson arrivals of a ShareGPT-like
mix (lognormal prompt and output lengths, a share under shared system prompts) from an asynchronous client
streaming every request (in a process of its own, as vLLM's ``bench serve`` runs); what vLLM's ``bench serve``
reports (request throughput, output tokens/s, time to first token and inter-token latency percentiles), beside the
offline engine on the same prompts and outputs (one ``Engine.generate`` of them all, the same ``max_num_seqs``).
The server is ``pagedkv serve``'s: the API in this process, the engine in one of its own. GC on, as servers run.

    python bench/serve_load.py                                   # CPU, fp32: 48 requests at 2/s
    python bench/serve_load.py --device cuda --dtype bfloat16 --requests 400 --rate 40
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import uvicorn

from pagedkv.app.connections import http_config
from pagedkv.app.engine_loop import EngineLoop
from pagedkv.app.openai_api import OpenAIServer
from pagedkv.models.llama import Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_client.py")
SYSTEMS = ["You are a helpful assistant who answers briefly.", "You are a careful tutor. Explain step by step."]
WORDS = [
    "the",
    "river",
    "city",
    "light",
    "music",
    "window",
    "garden",
    "story",
    "paper",
    "winter",
    "market",
    "bridge",
    "answer",
    "morning",
    "table",
]


def mix(n: int, seed: int, longest: int) -> list[tuple[str, int]]:
    """``n`` (prompt text, output tokens): lognormal lengths (medians ~120 prompt words, ~80 output tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = min(int(rng.lognormvariate(4.8, 0.6)), longest)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        if rng.random() < 0.3:
            text = f"{rng.choice(SYSTEMS)} {text}"
        out.append((text, max(4, min(int(rng.lognormvariate(4.4, 0.5)), 256))))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def measured(
    url: str, work: list[tuple[str, int]], rate: float, seed: int, concurrency: int | None = None, procs: int = 1
) -> dict[str, Any]:
    """``work`` sent by ``procs`` clients (bench/serve_client.py), each a process of its own that imports nothing of
    the server's (their parsing never takes the server's interpreter, nor each other's), each a share of the
    requests, the rate and the concurrency; started together once all are up; their figures together, the wall
    from the first request sent to the last one ended."""
    procs = max(1, min(procs, len(work), concurrency or procs))
    ps = []
    for k in range(procs):
        share = concurrency // procs + (k < concurrency % procs) if concurrency is not None else None
        job = {"url": url, "work": work[k::procs], "rate": rate / procs, "seed": seed + 7919 * k, "concurrency": share}
        p = subprocess.Popen([sys.executable, CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(json.dumps(job) + "\n")
        p.stdin.flush()
        ps.append(p)
    for p in ps:  # (every client up: its imports done)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in ps:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.close()
    parts = []
    for p in ps:
        assert p.stdout is not None
        parts.append(json.loads(p.stdout.read()))
        p.wait()
    return {
        "wall": max(r["end"] for r in parts) - min(r["first"] for r in parts),
        **{k: [x for r in parts for x in r[k]] for k in ("ttft", "itl")},
        **{k: sum(r[k] for r in parts) for k in ("tokens", "lost")},
    }


def rss_mib(pid: int | str = "self") -> float:
    """A process's resident memory now (Linux)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def build(device: str, dtype: str, threads: int, kw: dict[str, Any]) -> Engine:
    """The server's engine, in the engine's process: the same model and settings as the offline engine's."""
    torch.set_num_threads(threads)
    model, meta = Llama.smollm2(device=device, dtype=getattr(torch, dtype))
    return Engine(model, Tokenizer(meta), **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals a second (Poisson)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="a closed loop of this many requests in flight (the offline engine's max_num_seqs the same) instead of "
        "Poisson arrivals",
    )
    ap.add_argument("--longest", type=int, default=400, help="the most prompt words")
    ap.add_argument("--kv-cache-memory", type=int, default=512, help="MiB of KV pages")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engines' token budget a step")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=None, help="the most of one prompt a step")
    ap.add_argument("--async-scheduling", action="store_true", help="the engines plan a step while the last runs")
    ap.add_argument(
        "--client-processes", type=int, default=1, help="clients sending the load, each in a process of its own"
    )
    ap.add_argument("--skip-offline", action="store_true", help="the server alone")
    ap.add_argument("--soak", type=int, default=0, help="N tiny requests: the server's memory after ten and after N")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, meta = Llama.smollm2(device=args.device, dtype=getattr(torch, args.dtype))
    tok = Tokenizer(meta)
    work = mix(args.requests, 0, args.longest)
    seqs = args.concurrency or args.max_num_seqs
    kw: dict[str, Any] = {"max_num_seqs": seqs, "kv_cache_memory_bytes": args.kv_cache_memory << 20}
    for name in ("max_num_batched_tokens", "long_prefill_token_threshold", "async_scheduling"):
        if getattr(args, name) not in (None, False):
            kw[name] = getattr(args, name)

    off_s, off_tokens = float("nan"), 0
    if not args.skip_offline and not args.soak:
        offline = Engine(model, tok, **kw)  # (warm: kernels, graphs; then the timed run)
        offline.generate([("", tok.encode(p), SamplingParams(temperature=0.0, max_tokens=4)) for p, _ in work[:4]])
        t0 = time.perf_counter()
        done = offline.generate(
            [("", tok.encode(p), SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)) for p, o in work]
        )
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        off_s = time.perf_counter() - t0
        off_tokens = sum(len(c.token_ids) for c in done)
        del offline, done  # (its objects would make every collection of the server's run longer)
        gc.collect()
        if model.device.type == "cuda":
            torch.cuda.empty_cache()  # (its pages back for the server's engine, in its own process)

    del model
    loop = EngineLoop(build, args.device, args.dtype, args.threads, kw, max_waiting=1 << 16).start()
    engine_pid = loop.pid
    app = OpenAIServer(loop, "SmolLM2-135M-Instruct", defaults=SamplingParams(temperature=0.0, max_tokens=64)).app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    server = uvicorn.Server(http_config(app))  # (pagedkv serve's: its read timeout and connection cap)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    measured(url, work[:4], 100.0, 1)  # (warm)
    if args.soak:  # (tiny requests, many: what the server holds after ten, and after each fifth of them)
        tiny = [(" ".join(WORDS[i % len(WORDS)] for i in range(k % 7, k % 7 + 8)), 2) for k in range(args.soak)]
        measured(url, tiny[:10], 100.0, 2, 8)
        gc.collect()
        print(
            f"soak: after 10 requests the server holds {rss_mib():.0f} MiB, its engine {rss_mib(engine_pid):.0f} MiB",
            flush=True,
        )
        t0, done, lost = time.perf_counter(), 10, 0
        for part in range(5):
            chunk = tiny[part * len(tiny) // 5 : (part + 1) * len(tiny) // 5]
            lost += measured(url, chunk, 100.0, 3 + part, args.concurrency or 32, args.client_processes)["lost"]
            done += len(chunk)
            gc.collect()
            print(
                f"soak: after {done} requests ({time.perf_counter() - t0:.0f} s) the server holds {rss_mib():.0f} MiB, "
                f"its engine {rss_mib(engine_pid):.0f} MiB; live: engine {loop.metrics.requests}, loop "
                f"{len(loop.live)}; short of their tokens {lost}",
                flush=True,
            )
        print(f"soak: finished {dict(loop.metrics.finished)}")
        server.should_exit = True
        thread.join(timeout=10)
        loop.close()
        return
    rss0 = rss_mib(), rss_mib(engine_pid)
    r = measured(url, work, args.rate, 0, args.concurrency, args.client_processes)
    rss1 = rss_mib(), rss_mib(engine_pid)
    server.should_exit = True
    thread.join(timeout=10)
    loop.close()
    print(
        f"SmolLM2-135M-Instruct, {args.device} {args.dtype}, {args.threads} thread(s); {args.requests} requests, "
        f"{f'{args.concurrency} in flight' if args.concurrency else f'Poisson at {args.rate}/s'}, max_num_seqs {seqs}"
        f"{''.join(f', {k} {v}' for k, v in kw.items() if k not in ('max_num_seqs', 'kv_cache_memory_bytes'))}; "
        f"prompts median "
        f"{statistics.median(len(tok.encode(p)) for p, _ in work):.0f} tokens, outputs median "
        f"{statistics.median(o for _, o in work):.0f}"
    )
    print("\n| run | wall (s) | requests/s | output tok/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) |")
    print("|---|---:|---:|---:|---|---|")
    ms = [1e3 * pct(r["ttft"], q) for q in (0.5, 0.9, 0.99)]
    it = [1e3 * pct(r["itl"], q) for q in (0.5, 0.9, 0.99)]
    print(
        f"| offline engine (all at once) | {off_s:.1f} | {len(work) / off_s:.2f} | {off_tokens / off_s:.1f} | - | - |"
    )
    print(
        f"| server, arrivals | {r['wall']:.1f} | {len(work) / r['wall']:.2f} | {r['tokens'] / r['wall']:.1f} | "
        f"{ms[0]:.0f} / {ms[1]:.0f} / {ms[2]:.0f} | {it[0]:.1f} / {it[1]:.1f} / {it[2]:.1f} |"
    )
    print(f"\nclients: {args.client_processes} process(es)")
    print(f"server / offline output tok/s: {r['tokens'] / r['wall'] / (off_tokens / off_s):.2f}")
    print(
        f"requests that did not get every token: {r['lost']}; engine requests live after: {loop.metrics.requests}; "
        f"RSS server {rss0[0]:.0f} -> {rss1[0]:.0f} MiB, engine {rss0[1]:.0f} -> {rss1[1]:.0f} MiB over the run; "
        f"engine faults {loop.faults}"
    )


if __name__ == "__main__":
    main()
