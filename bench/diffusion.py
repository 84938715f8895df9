"""Paged KV vs dense full-length reservation for diffusion requests at the same pool budget; and request
mode vs step continuous batching on one arrival stream and pool.

Each request has two CFG rows (a conditional prompt of 8-200 tokens, an unconditional one of
2-16, a reference image of 0 or 64 tokens, a 257-token target: timestep + 256 image tokens).
Dense reservation keeps every row at the longest possible length (200 + 64 + 257 tokens); the
paged path takes ceil(row / block_size) blocks per row through the core's admission. Both fill
the same budget with requests from the same stream, in order, until the next one does not fit.

Step batching (second table): the reference DiT (CPU, fp32, torch backend) denoising requests that arrive at
``--rate`` per second (CFG and single-row mixed, some with a reference image), in request mode (one request
at a time, all its steps: ``DiTRunner``), in step mode (each tick one step of every active request, rows of
requests at different steps in one forward: ``core.scheduler.steps`` + ``DiTStepRunner``), and in step mode
sequence-parallel (Ulysses on ``--sp`` gloo ranks, rank 0 planning and broadcasting each tick), the same pool;
after a warm-up, modes alternating over ``--repeats``; requests per second and latency from arrival to the last
step, p50 / p95.

    python bench/diffusion.py [--requests 24] [--steps 8] [--rate 50] [--repeats 2] [--sp 2 4]
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
        out.append(
            (
                RowSpec(cond + 257, prefix_len=cond, target_len=257),
                RowSpec(uncond + 257, prefix_len=uncond, target_len=257),
            )
        )
    return out


def main() -> None:
    reqs = stream(10_000)
    print(
        f"two CFG rows per request; {TOKEN_BYTES} bytes of KV per token; block size {BLOCK}; "
        "baseline: dense full-length reservation, same budget, same stream"
    )
    print(
        f"{'budget GiB':>10} {'paged reqs':>11} {'paged KV GiB':>13} {'dense reqs':>11} {'dense KV GiB':>13} "
        f"{'ratio':>6}"
    )
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
        print(
            f"{gib:>10} {paged:>11} {peak / 2**30:>13.2f} {dense:>11} {dense * 2 * MAX_ROW * TOKEN_BYTES / 2**30:>13.2f} "
            f"{paged / max(dense, 1):>6.2f}"
        )


def _work(n: int, gap: float, image: int) -> list[tuple[str, list, list, float]]:
    """``n`` requests (CFG and single-row mixed, some with a reference image), one every ``gap`` seconds."""
    import torch

    from pagedkv.models.dit import DiTRow

    g = torch.Generator().manual_seed(0)
    work = []
    for i in range(n):
        ref = torch.randn(8, 8, generator=g) if i % 3 == 1 else None
        text = tuple(int(x) for x in torch.randint(0, 128, (12 + i % 9,), generator=g))
        rows = [DiTRow(text, ref), DiTRow(text[:3], ref)] if i % 2 == 0 else [DiTRow(text, ref)]
        img = torch.randn(image, 8, generator=g)
        work.append((f"r{i}", rows, [img.clone() for _ in rows], i * gap))
    return work


MODEL = dict(hidden=128, heads=8, kv_heads=4, layers=4, latent=8)
IMAGE, BLOCKS = 32, 160


def _setup(sp: object = None) -> tuple:
    """The model (or its Ulysses shard), the geometry, a rank builder and the spec of a request's rows."""
    import torch

    from pagedkv.models.dit import DiT, DiTConfig
    from pagedkv.shell.rank import build_rank, plan_rank

    model = DiT(DiTConfig(**MODEL))  # type: ignore[arg-type]
    cfg = CacheConfig(block_size=BLOCK // 4, num_blocks=BLOCKS + 1, enable_prefix_caching=True, max_model_len=256)
    shard = model if sp is None else sp(model)  # type: ignore[operator]

    def rank():  # type: ignore[no-untyped-def]
        plan = plan_rank(shard.kv_layers(), block_size=cfg.block_size, dtype=torch.float32)
        return build_rank(plan, cfg, max_rows=64, max_tokens=4096)

    def spec(rid: str, rows: list) -> RequestSpec:
        return RequestSpec(rid, tuple(r.spec(IMAGE) for r in rows), rows[0].content_key())

    return shard, cfg, rank, spec


def request_mode(work: list, steps: int) -> tuple[float, list[float], int]:
    """One request at a time in arrival order, all its steps (``DiTRunner``): (wall s, latencies, forwards)."""
    import time

    from pagedkv.app.diffusion import DiTRunner
    from pagedkv.core import publish, release
    from pagedkv.shell.attention import get_backend

    model, cfg, rank, spec = _setup()
    r, s = rank(), initial_state(cfg)
    runner = DiTRunner(model, r, get_backend("torch"))
    t0, lat = time.perf_counter(), []
    for rid, rows, imgs, at in work:
        while time.perf_counter() - t0 < at:
            time.sleep(0.0005)
        s = admit(s, spec(rid, rows)).unwrap().state
        first, later = publish(s, [rid], "prefill").unwrap().effect, publish(s, [rid], "denoise").unwrap().effect
        runner.run(rows, [i.clone() for i in imgs], steps, first, later)
        r.worker.remove([rid])
        s = release(s, rid, "finished").unwrap().state
        lat.append(time.perf_counter() - t0 - at)
    return time.perf_counter() - t0, lat, len(work) * steps


def step_mode(work: list, steps: int, rank_index: int = 0, world: int = 1) -> tuple[float, list[float], int]:
    """Step batching (``core.scheduler.steps`` + ``DiTStepRunner``); with ``world`` > 1 on a Ulysses shard, rank 0
    planning each tick and broadcasting it (the core runs once)."""
    import time

    from pagedkv.app.diffusion import DiTStepRunner
    from pagedkv.core.scheduler.steps import Budget, DiTJob, DiTState, done, submit_job, tick
    from pagedkv.models.ulysses import UlyssesDiT, broadcast
    from pagedkv.shell.attention import get_backend

    shard, cfg, rank, spec = _setup(None if world == 1 else lambda m: UlyssesDiT(m, rank_index, world))
    r = rank()
    runner = DiTStepRunner(shard, r, get_backend("torch"))
    state = DiTState.empty(initial_state(cfg), Budget(rows=64, tokens=4096))
    pending, arrived, lat = list(work), {}, []
    for rid, rows, imgs, _ in work:
        runner.add(rid, rows, [i.clone() for i in imgs], steps)
    t0 = time.perf_counter()
    while True:
        plan = None
        if rank_index == 0:
            now = time.perf_counter() - t0
            for item in [p for p in pending if p[3] <= now]:
                state = submit_job(state, DiTJob(item[0], spec(item[0], item[1]), steps)).unwrap()
                arrived[item[0]] = item[3]
                pending.remove(item)
            if state.active or state.waiting:
                state, plan = tick(state).unwrap()
            busy = bool(pending or state.active or state.waiting)
        if world > 1:
            busy, plan = broadcast([busy if rank_index == 0 else None, plan])
        if not busy:
            break
        if plan is None:
            time.sleep(0.0005)
            continue
        runner.run(plan)
        finished = ()
        if rank_index == 0:
            state, finished = done(state).unwrap()
            lat += [time.perf_counter() - t0 - arrived[f] for f in finished]
        if world > 1:
            (finished,) = broadcast([finished])
        r.worker.remove(list(finished))
    return time.perf_counter() - t0, lat, runner.forwards


def _sp_worker(rank: int, world: int, init_file: str, out: str, work: list, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from pagedkv.shell.distributed import init

    torch.set_num_threads(1)
    init(rank, world, init_file, timeout_s=300)
    try:
        got = step_mode(work, steps, rank, world)
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


def sp_mode(work: list, steps: int, world: int) -> tuple[float, list[float], int]:
    import os
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.pt")
        mp.spawn(_sp_worker, args=(world, os.path.join(d, "init"), out, work, steps), nprocs=world, join=True)
        return torch.load(out)  # type: ignore[no-any-return]


def step_batching(n: int, steps: int, rate: float, repeats: int, sp: list[int]) -> None:
    import torch

    torch.set_num_threads(1)
    work = _work(n, 1.0 / rate, IMAGE)
    modes = {"request mode": lambda: request_mode(work, steps), "step batching": lambda: step_mode(work, steps)}
    modes.update({f"step batching, Ulysses x{w}": (lambda w=w: sp_mode(work, steps, w)) for w in sp})
    warm = _work(2, 0.0, IMAGE)
    request_mode(warm, 2), step_mode(warm, 2)  # warm-up: first calls, allocator, kernels
    runs: dict[str, list[tuple[float, list[float], int]]] = {m: [] for m in modes}
    for _ in range(repeats):  # alternating modes, so the machine's drift spreads over all of them
        for mode, run in modes.items():
            runs[mode].append(run())
    print(
        f"\nstep batching: {n} requests (CFG and single-row mixed), {steps} steps each, {rate:.0f} arrivals/s; "
        f"reference DiT (hidden 128, 8 heads, 4 layers, {IMAGE} image tokens), CPU fp32 "
        f"({os_cpus()} cores), pool of {BLOCKS} blocks; best of {repeats} alternating runs by req/s"
    )
    print("| mode | req/s | p50 s | p95 s | forwards |\n|---|---:|---:|---:|---:|")
    for mode, results in runs.items():
        wall, lats, forwards = min(results, key=lambda x: x[0])
        lats = sorted(lats)
        p50, p95 = lats[len(lats) // 2], lats[min(len(lats) - 1, int(0.95 * len(lats)))]
        print(f"| {mode} | {n / wall:.1f} | {p50:.3f} | {p95:.3f} | {forwards} |")


def os_cpus() -> int:
    import os

    return os.cpu_count() or 1


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rate", type=float, default=50.0, help="arrivals per second")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sp", type=int, nargs="*", default=[2, 4], help="Ulysses ranks (gloo) for step batching")
    a = ap.parse_args()
    main()
    step_batching(a.requests, a.steps, a.rate, a.repeats, a.sp)
