"""Paged KV vs dense full-length reservation for diffusion requests at the same pool budget; and request
mode vs step continuous batching on one arrival stream and pool.

Each request has two CFG rows (a conditional prompt of 8-200 tokens, an unconditional one of
2-16, a reference image of 0 or 64 tokens, a 257-token target: timestep + 256 image tokens).
Dense reservation keeps every row at the longest possible length (200 + 64 + 257 tokens); the
paged path takes ceil(row / block_size) blocks per row through the core's admission. Both fill
the same budget with requests from the same stream, in order, until the next one does not fit.

Step batching (second table): the reference DiT (CPU, fp32, torch backend) denoising requests that arrive
every ``--gap`` seconds (CFG and single-row mixed, some with a reference image), in request mode (one request
at a time, all its steps: ``DiTRunner``) and in step mode (each tick one step of every active request,
rows of requests at different steps in one forward: ``core.scheduler.steps`` + ``DiTStepRunner``), the same
pool; requests per second and latency from arrival to the last step, p50 / p95.

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


def step_batching(n: int = 24, steps: int = 8, gap: float = 0.01, blocks: int = 160) -> None:
    import time

    import torch

    from pagedkv.app.diffusion import DiTRunner, DiTStepRunner
    from pagedkv.core import publish, release
    from pagedkv.core.scheduler.steps import DiTJob, StepState, done, submit_job, tick
    from pagedkv.models.dit import DiT, DiTConfig, DiTRow
    from pagedkv.shell.attention import get_backend
    from pagedkv.shell.rank import build_rank, plan_rank

    torch.set_num_threads(1)
    image = 32
    model = DiT(DiTConfig(hidden=128, heads=8, kv_heads=4, layers=4, latent=8))
    g = torch.Generator().manual_seed(0)
    work = []
    for i in range(n):
        ref = torch.randn(8, 8, generator=g) if i % 3 == 1 else None
        text = tuple(int(x) for x in torch.randint(0, 128, (12 + i % 9,), generator=g))
        rows = [DiTRow(text, ref), DiTRow(text[:3], ref)] if i % 2 == 0 else [DiTRow(text, ref)]
        img = torch.randn(image, 8, generator=g)
        work.append((f"r{i}", rows, [img.clone() for _ in rows], i * gap))
    cfg = CacheConfig(block_size=BLOCK // 4, num_blocks=blocks + 1, enable_prefix_caching=True, max_model_len=256)

    def rank():  # type: ignore[no-untyped-def]
        plan = plan_rank(model.kv_layers(), block_size=cfg.block_size, dtype=torch.float32)
        return build_rank(plan, cfg, max_rows=64, max_tokens=4096)

    def spec(rid: str, rows: list[DiTRow]) -> RequestSpec:
        return RequestSpec(rid, tuple(r.spec(image) for r in rows), rows[0].content_key())

    results = {}
    # request mode: in arrival order, one request at a time, all its steps
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
    results["request mode"] = (time.perf_counter() - t0, lat, n * steps)
    # step mode: a tick advances every active request one step; admission between ticks
    r = rank()
    step_runner = DiTStepRunner(model, r, get_backend("torch"))
    state, pending, arrived, lat = StepState.empty(initial_state(cfg)), list(work), {}, []
    t0 = time.perf_counter()
    while pending or state.active or state.waiting:
        now = time.perf_counter() - t0
        for item in [p for p in pending if p[3] <= now]:
            rid, rows, imgs, at = item
            step_runner.add(rid, rows, [i.clone() for i in imgs], steps)
            state = submit_job(state, DiTJob(rid, spec(rid, rows), steps)).unwrap()
            arrived[rid] = at
            pending.remove(item)
        if not (state.active or state.waiting):
            time.sleep(0.0005)
            continue
        state, plan = tick(state).unwrap()
        step_runner.run(plan)
        state, finished = done(state).unwrap()
        r.worker.remove(list(finished))
        lat += [time.perf_counter() - t0 - arrived[f] for f in finished]
    results["step batching"] = (time.perf_counter() - t0, lat, step_runner.forwards)
    print(f"\nstep batching: {n} requests (CFG and single-row mixed), {steps} steps each, one every {gap * 1e3:.0f} ms; "
          f"reference DiT (hidden 128, 4 layers, {image} image tokens), CPU fp32, pool of {blocks} blocks")
    print(f"{'mode':<14} {'req/s':>7} {'p50 s':>7} {'p95 s':>7} {'forwards':>9}")
    for mode, (wall, lats, forwards) in results.items():
        lats = sorted(lats)
        p50, p95 = lats[len(lats) // 2], lats[min(len(lats) - 1, int(0.95 * len(lats)))]
        print(f"{mode:<14} {n / wall:>7.1f} {p50:>7.3f} {p95:>7.3f} {forwards:>9}")


if __name__ == "__main__":
    main()
    step_batching()
