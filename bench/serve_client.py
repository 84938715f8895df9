"""One load client of bench/serve_load.py, a process of its own that imports nothing of the server: reads its job
(JSON: url, work, rate, seed, concurrency) from the first line of stdin, says ``ready``, starts at the line ``go``,
and writes its figures as JSON to stdout (each request's time to first token and inter-token gaps, tokens, requests
short of their tokens, the first request's start and the last one's end)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any

import httpx


async def client(
    url: str, work: list[tuple[str, int]], rate: float, seed: int, concurrency: int | None
) -> dict[str, Any]:
    """Every request of ``work`` streamed: Poisson arrivals at ``rate``, or (``concurrency``) that many in flight at
    all times, the next sent as one ends."""
    rng = random.Random(seed + 1)
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    lost = 0

    async def one(http: httpx.AsyncClient, prompt: str, out: int) -> None:
        nonlocal tokens, lost
        body = {"prompt": prompt, "max_tokens": out, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        t0 = time.perf_counter()
        last = None
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens += chunk["usage"]["completion_tokens"]
                    if chunk["usage"]["completion_tokens"] != out:
                        lost += 1
                    continue
                if not chunk["choices"] or not chunk["choices"][0]["text"]:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
        first = time.time()
        if concurrency is not None:
            gate = asyncio.Semaphore(concurrency)

            async def gated(prompt: str, out: int) -> None:
                async with gate:
                    await one(http, prompt, out)

            await asyncio.gather(*(gated(p, o) for p, o in work))
        else:
            tasks = []
            for prompt, out in work:
                tasks.append(asyncio.create_task(one(http, prompt, out)))
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
    return {"first": first, "end": time.time(), "ttft": ttft, "itl": itl, "tokens": tokens, "lost": lost}


def main() -> None:
    job = json.loads(sys.stdin.readline())
    print("ready", flush=True)
    sys.stdin.readline()  # (go)
    work = [tuple(w) for w in job["work"]]
    print(json.dumps(asyncio.run(client(job["url"], work, job["rate"], job["seed"], job["concurrency"]))))


if __name__ == "__main__":
    main()
