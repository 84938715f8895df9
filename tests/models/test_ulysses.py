"""Strict Ulysses sequence parallelism for the reference DiT on gloo: 2 and 4 CPU processes give one rank's
images at every denoising step (fp32), CFG rows with a reference image; the core runs once (rank 0) and its
metadata is broadcast; each rank's pages hold its heads only."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from pagedkv.core import CacheConfig, RequestSpec, admit, initial_state, publish
from pagedkv.app.diffusion import DiTRunner
from pagedkv.models.dit import DiT, DiTConfig, DiTRow
from pagedkv.shell.attention import get_backend
from pagedkv.shell.rank import build_rank, plan_rank

IMAGE, STEPS = 6, 3  # first steps of 29 tokens, later steps of 14: neither a multiple of 4, the first not of 2
CONFIG = DiTConfig(heads=4, kv_heads=2)


def _rows() -> tuple[list[DiTRow], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    ref = torch.randn(3, CONFIG.latent, generator=g)
    rows = [DiTRow((5, 6, 7, 8, 9, 10, 11), ref), DiTRow((5, 6), ref)]
    img = torch.randn(IMAGE, CONFIG.latent, generator=g)
    return rows, [img.clone(), img.clone()]


def _metadata() -> tuple[CacheConfig, object, object]:
    rows, _ = _rows()
    cfg = CacheConfig(block_size=4, num_blocks=41, enable_prefix_caching=True, max_model_len=64)
    s = admit(initial_state(cfg), RequestSpec("img", tuple(r.spec(IMAGE) for r in rows), rows[0].content_key()))
    s = s.unwrap().state
    return cfg, publish(s, ["img"], "prefill").unwrap().effect, publish(s, ["img"], "denoise").unwrap().effect


def one_rank() -> list[torch.Tensor]:
    model = DiT(CONFIG)
    cfg, first, later = _metadata()
    rank = build_rank(plan_rank(model.kv_layers(), block_size=4, dtype=torch.float32), cfg, max_rows=4, max_tokens=64)
    rows, images = _rows()
    return DiTRunner(model, rank, get_backend("torch")).run(rows, images, STEPS, first, later)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from pagedkv.models.dit import euler
    from pagedkv.models.ulysses import UlyssesDiT, broadcast
    from pagedkv.shell.distributed import init

    torch.set_num_threads(1)
    init(rank, world, init_file, timeout_s=60)
    try:
        model = DiT(CONFIG)
        sp = UlyssesDiT(model, rank, world)
        cfg, first, later = _metadata() if rank == 0 else (None, None, None)
        cfg, first, later = broadcast([cfg, first, later])  # the core ran once: rank 0's snapshot everywhere
        plan = plan_rank(sp.kv_layers(), block_size=cfg.block_size, dtype=torch.float32)
        r = build_rank(plan, cfg, max_rows=4, max_tokens=64)
        rows, images = _rows()
        history = []
        for s in range(STEPS):
            batch = r.worker.install(first if s == 0 else later)
            preds = sp.paged_step(rows, images, 1.0 - s / STEPS, batch, r.pool, get_backend("torch"), r.group)
            images = euler(images, preds, STEPS, 4.0)
            history.append(images[0])
        torch.save({"history": history, "kv_heads": r.pool.k[0].shape[2]}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_ranks_equal_one_rank_at_every_step(world: int) -> None:
    ref = one_rank()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), d), nprocs=world, join=True)
        results = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(world)]
    _, first, later = _metadata()
    assert first.num_query_tokens % 2 and later.num_query_tokens % 4  # padding runs, for 2 and 4 ranks
    for res in results:
        assert len(res["history"]) == STEPS
        assert res["kv_heads"] == max(1, CONFIG.kv_heads // world)  # each rank's pages: its heads only
        for got, want in zip(res["history"], ref):
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert not torch.allclose(ref[0], ref[-1])  # it does denoise


def test_a_head_split_that_cuts_kv_groups_is_refused() -> None:
    from pagedkv.models.ulysses import UlyssesDiT
    from pagedkv.shell.errors import ShellError

    with pytest.raises(ShellError, match="split evenly"):
        UlyssesDiT(DiT(CONFIG), 0, 3)
    with pytest.raises(ShellError, match="cut across"):
        UlyssesDiT(DiT(DiTConfig(heads=6, hidden=48, kv_heads=3)), 0, 2)  # shares of 3 heads, groups of 2


def _steps_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Step batching with Ulysses: rank 0 plans each tick (the core runs once) and broadcasts it; every rank runs
    its forwards through ``DiTStepRunner`` over its Ulysses shard, rows of requests at different steps together."""
    import torch.distributed as dist

    from pagedkv.app.diffusion import DiTStepRunner
    from pagedkv.core.scheduler.steps import Budget, DiTState, done, submit_job, tick
    from pagedkv.models.ulysses import UlyssesDiT, broadcast
    from pagedkv.shell.distributed import init
    from tests.core.test_dit_failures import job
    from tests.core.test_dit_steps import requests

    torch.set_num_threads(1)
    init(rank, world, init_file, timeout_s=60)
    try:
        sp = UlyssesDiT(DiT(), rank, world)
        cfg = CacheConfig(block_size=4, num_blocks=61, enable_prefix_caching=True, max_model_len=64)
        r = build_rank(plan_rank(sp.kv_layers(), block_size=4, dtype=torch.float32), cfg, max_rows=6, max_tokens=64)
        runner = DiTStepRunner(sp, r, get_backend("torch"))
        state = DiTState.empty(initial_state(cfg), Budget(rows=6, tokens=64)) if rank == 0 else None
        pending = requests()[:4]
        for rid, rows, imgs, steps, _ in pending:
            runner.add(rid, rows, [i.clone() for i in imgs], steps)
        tick_no = 0
        while True:
            plan = None
            if rank == 0:
                for item in [p for p in pending if p[4] <= tick_no]:
                    state = submit_job(state, job(item[0], item[1], item[3])).unwrap()
                    pending.remove(item)
                busy = bool(pending or state.active or state.waiting)
                if busy:
                    state, plan = tick(state).unwrap()
            else:
                busy = True
            busy, plan = broadcast([busy if rank == 0 else None, plan])
            if not busy:
                break
            runner.run(plan)
            finished = done(state).unwrap() if rank == 0 else None
            if rank == 0:
                state, finished = finished
            (finished,) = broadcast([finished])
            r.worker.remove(list(finished))
            tick_no += 1
        torch.save({rid: runner.take(rid) for rid, *_ in requests()[:4]}, os.path.join(out_dir, f"steps{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ulysses_with_step_batching_equals_one_rank_at_every_step() -> None:
    from pagedkv.app.diffusion import DiTStepRunner
    from pagedkv.core.scheduler.steps import Budget
    from tests.core.test_dit_failures import step_mode

    cfg = CacheConfig(block_size=4, num_blocks=61, enable_prefix_caching=True, max_model_len=64)
    runner = DiTStepRunner(
        DiT(),
        build_rank(plan_rank(DiT().kv_layers(), block_size=4, dtype=torch.float32), cfg, max_rows=6, max_tokens=64),
        get_backend("torch"),
    )
    want, mixed = step_mode(runner, Budget(rows=6, tokens=64))
    assert mixed
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_steps_worker, args=(2, os.path.join(d, "init"), d), nprocs=2, join=True)
        results = [torch.load(os.path.join(d, f"steps{r}.pt")) for r in range(2)]
    for res in results:
        for rid, images in want.items():
            assert len(res[rid]) == len(images) > 0
            for got, ref in zip(res[rid], images):
                assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5, rid
