"""One hostile (or watching) client of bench/serve_hostile.py, a process of its own that imports nothing of the
server: reads its job (JSON: url, mode, and the mode's settings) from the first line of stdin, says ``ready``,
starts at the line ``go``, runs until the line ``stop``, and writes what it saw as JSON to stdout.

- ``health``: ``GET /health`` every ``every`` seconds on a fresh connection; each answer's latency and status.
- ``body``: a request whose body is ``mb`` MB, sent with its Content-Length and then again in chunks (no length),
  over and over; each answer's status and seconds.
- ``slow``: ``connections`` connections that send a request head a byte at a time, one every ``every`` seconds,
  never finishing it (a slow-headers attack); one the server closes is opened again. How many were closed."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from typing import Any
from urllib.parse import urlparse

import httpx

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 4096


async def health(url: str, every: float, stop: asyncio.Event) -> dict[str, Any]:
    seen: list[tuple[float, int]] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            async with httpx.AsyncClient(timeout=30) as http:  # (a fresh connection: a new client's experience)
                status = (await http.get(f"{url}/health")).status_code
        except httpx.HTTPError:
            status = 0
        seen.append((time.perf_counter() - t0, status))
        await asyncio.sleep(every)
    return {"latency": [s for s, _ in seen], "status": [c for _, c in seen]}


async def body(url: str, mb: int, stop: asyncio.Event) -> dict[str, Any]:
    seen: list[tuple[str, int, float]] = []
    blob = b'{"prompt": "' + b"a" * (mb << 20) + b'"}'

    async def chunks() -> Any:
        for at in range(0, len(blob), 1 << 20):
            yield blob[at : at + (1 << 20)]

    async with httpx.AsyncClient(timeout=120) as http:
        while not stop.is_set():
            for how, content in (("length", blob), ("chunked", chunks())):
                t0 = time.perf_counter()
                try:
                    r = await http.post(f"{url}/v1/completions", content=content)
                    status = r.status_code
                except httpx.HTTPError:  # (the server closed it before the whole body was sent: an answer too)
                    status = 0
                seen.append((how, status, time.perf_counter() - t0))
            await asyncio.sleep(0.5)
    return {"answers": seen}


async def slow(url: str, connections: int, every: float, stop: asyncio.Event) -> dict[str, Any]:
    host, port = urlparse(url).hostname or "127.0.0.1", urlparse(url).port or 80
    closed = 0
    opened = 0

    async def one() -> None:
        nonlocal closed, opened
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                await asyncio.sleep(every)
                continue
            opened += 1
            at = 0
            try:
                while not stop.is_set() and at < len(HEAD):
                    writer.write(HEAD[at : at + 1])
                    await writer.drain()
                    at += 1
                    try:  # (the server's close reads as the end of the stream)
                        if await asyncio.wait_for(reader.read(1), timeout=every) == b"":
                            closed += 1
                            break
                    except asyncio.TimeoutError:
                        pass
            except OSError:
                closed += 1
            writer.close()

    tasks = [asyncio.create_task(one()) for _ in range(connections)]
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"opened": opened, "closed_by_server": closed}


def main() -> None:
    job = json.loads(sys.stdin.readline())
    print("ready", flush=True)
    sys.stdin.readline()  # (go)

    async def run() -> dict[str, Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(
            target=lambda: (sys.stdin.readline(), loop.call_soon_threadsafe(stop.set)), daemon=True
        ).start()
        mode, url = job["mode"], job["url"]
        if mode == "health":
            return await health(url, job.get("every", 0.1), stop)
        if mode == "body":
            return await body(url, job.get("mb", 50), stop)
        return await slow(url, job.get("connections", 200), job.get("every", 1.0), stop)

    print(json.dumps(asyncio.run(run())), flush=True)


if __name__ == "__main__":
    main()
