"""``pagedkv serve`` under hostile use (issue 60): ``--clients`` clients streaming a ShareGPT-like mix (a closed
loop, bench/serve_client.py), first alone, then while one client sends 50 MB bodies over and over (with a length,
then in chunks) and ``--slow`` clients hold connections sending a request head a byte a second (bench/serve_attack.py);
``/health`` asked on a fresh connection every 0.1 s throughout. Each client is a process of its own that imports
nothing of the server. The server is ``pagedkv serve``'s, with its defaults (the API in this process over
``app.connections``, the engine in one of its own). Reported: the normal clients' inter-token latency and time to
first token with and without the attackers, ``/health``'s slowest answer, the attackers' answers, and whether every
normal request got all its tokens. GC on.

    python bench/serve_hostile.py                          # CPU, SmolLM2 fp32: 50 clients, 200 slow, 50 MB bodies
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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
from pagedkv.shell.sampling import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import build, measured, mix, pct, rss_mib  # noqa: E402

ATTACK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_attack.py")


class Helper:
    """A bench/serve_attack.py process: started, told to go, told to stop, its JSON read."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.p = subprocess.Popen([sys.executable, ATTACK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps(job) + "\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "ready"

    def go(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write("go\n")
        self.p.stdin.flush()

    def stop(self) -> dict[str, Any]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write("stop\n")
        self.p.stdin.close()
        out = json.loads(self.p.stdout.read())
        self.p.wait()
        return out  # type: ignore[no-any-return]


def phase(url: str, work: list[tuple[str, int]], clients: int, attack: dict[str, Any] | None) -> dict[str, Any]:
    """The normal load (``clients`` in flight) with ``/health`` watched and, where ``attack`` says, the attackers."""
    helpers = {"health": Helper({"url": url, "mode": "health", "every": 0.1})}
    if attack is not None:
        helpers["slow"] = Helper({"url": url, "mode": "slow", "connections": attack["slow"], "every": 1.0})
        helpers["body"] = Helper({"url": url, "mode": "body", "mb": attack["mb"]})
    for h in helpers.values():
        h.go()
    time.sleep(1.0 if attack is not None else 0.2)  # (the attack under way before the load starts)
    r = measured(url, work, 0.0, 0, clients)
    seen = {name: h.stop() for name, h in helpers.items()}
    return {**r, **seen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=1, help="the engine's (the clients and attackers need the rest)")
    ap.add_argument("--clients", type=int, default=50, help="normal clients streaming at once")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--slow", type=int, default=200, help="slow-headers connections")
    ap.add_argument("--mb", type=int, default=50, help="the big body's size")
    ap.add_argument("--longest", type=int, default=120, help="the most prompt words")
    ap.add_argument("--kv-cache-memory", type=int, default=512, help="MiB of KV pages")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="the engine's token budget a step (a CPU step of 50 prompts at once takes seconds: every client's ITL)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = [(p, min(o, 48)) for p, o in mix(args.requests, 0, args.longest)]
    kw: dict[str, Any] = {
        "max_num_seqs": args.clients,
        "kv_cache_memory_bytes": args.kv_cache_memory << 20,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    loop = EngineLoop(build, args.device, args.dtype, args.threads, kw, max_waiting=1024).start()
    api = OpenAIServer(loop, "SmolLM2-135M-Instruct", defaults=SamplingParams(temperature=0.0, max_tokens=64))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    server = uvicorn.Server(http_config(api.app()))  # (pagedkv serve's defaults: read timeout, connection cap)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    measured(url, work[:8], 100.0, 1)  # (warm)
    alone = phase(url, work, args.clients, None)
    print(f"alone: {alone['wall']:.1f} s, ITL p99 {1e3 * pct(alone['itl'], 0.99):.1f} ms", file=sys.stderr, flush=True)
    rss = rss_mib()
    attacked = phase(url, work, args.clients, {"slow": args.slow, "mb": args.mb})
    rss_after = rss_mib()
    server.should_exit = True
    thread.join(timeout=10)
    live = loop.metrics.requests
    loop.close()

    print(
        f"SmolLM2-135M-Instruct, {args.device} {args.dtype}, engine {args.threads} thread(s), "
        f"max_num_batched_tokens {args.max_num_batched_tokens}; {args.requests} requests "
        f"from {args.clients} streaming clients (outputs median {sorted(o for _, o in work)[len(work) // 2]} tokens); "
        f"attack: {args.slow} slow-headers connections and {args.mb} MB bodies"
    )
    print("\n| run | wall (s) | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | /health slowest (ms) |")
    print("|---|---:|---:|---|---|---:|")
    for name, r in (("alone", alone), ("under attack", attacked)):
        t = [1e3 * pct(r["ttft"], q) for q in (0.5, 0.99)]
        i = [1e3 * pct(r["itl"], q) for q in (0.5, 0.99)]
        health = r["health"]
        print(
            f"| {name} | {r['wall']:.1f} | {r['tokens'] / r['wall']:.1f} | {t[0]:.0f} / {t[1]:.0f} | "
            f"{i[0]:.1f} / {i[1]:.1f} | {1e3 * max(health['latency']):.0f} |"
        )
    ratio = pct(attacked["itl"], 0.99) / pct(alone["itl"], 0.99)
    answers: dict[str, int] = {}
    for how, status, _ in attacked["body"]["answers"]:
        answers[f"{how} {status}"] = answers.get(f"{how} {status}", 0) + 1
    bad_health = sum(s != 200 for r in (alone, attacked) for s in r["health"]["status"])
    print(f"\nITL p99 under attack / alone: {ratio:.2f} (goal: at most 2)")
    print(
        f"/health: {sum(len(r['health']['status']) for r in (alone, attacked))} asked, {bad_health} not 200, slowest "
        f"{1e3 * max(attacked['health']['latency']):.0f} ms under attack (goal: under 1,000)"
    )
    took = [s for _, _, s in attacked["body"]["answers"]]
    print(f"big bodies: {answers} (status 0: the server closed the connection as the body came), slowest "
          f"{max(took):.2f} s")  # fmt: skip
    print(f"slow connections: {attacked['slow']['opened']} opened, {attacked['slow']['closed_by_server']} closed by it")
    print(
        f"normal requests short of their tokens: {alone['lost']} alone, {attacked['lost']} under attack; engine "
        f"requests live after: {live}; server RSS {rss:.0f} -> {rss_after:.0f} MiB over the attack"
    )


if __name__ == "__main__":
    main()
