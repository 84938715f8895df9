"""Ring and USP (Ulysses x Ring) sequence parallelism for the reference DiT on gloo (models.usp): Ring on 2 ranks,
USP on a 2 x 2 grid of 4, Ring on 4 and Ulysses alone (2 x 1) give one rank's images at every denoising step (fp32), for CFG rows with a
reference image, a second request that hits the first's cached prefix (its K/V on the ranks that own those
positions), and step batching (a timestep a row, rows of requests at different steps in one forward); each rank's
pages hold its heads of the positions its ring group owns. A planted bug in each path fails."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from pagedkv.app.diffusion import DiTStepRunner
from pagedkv.core import CacheConfig, RequestSpec, admit, commit, initial_state, publish, release
from pagedkv.core.scheduler.steps import Budget
from pagedkv.models.dit import DiT, euler
from pagedkv.shell.attention import get_backend
from pagedkv.shell.rank import build_rank, plan_rank
from tests.core.test_dit_failures import step_mode as steps_of
from tests.models.test_ulysses import CONFIG, IMAGE, STEPS, _rows

CFG = CacheConfig(block_size=4, num_blocks=61, enable_prefix_caching=True, max_model_len=64)


def request_mode(model: object, rank_of: object, plant: str = "") -> list[list[torch.Tensor]]:
    """Two requests of one prompt, one after the other (the second hits the first's prefix), every step of each:
    the core on this process; ``model`` (a DiT or a grid shard) runs each forward."""
    cfg_rows, cfg_images = _rows()
    s, out = initial_state(CFG), []
    r = rank_of()  # type: ignore[operator]
    for rid in ("img", "img2"):  # CFG rows, then the conditional row alone (its prefix cached by the first)
        rows, images = (cfg_rows, cfg_images) if rid == "img" else (cfg_rows[:1], cfg_images[:1])
        s = admit(s, RequestSpec(rid, tuple(x.spec(IMAGE) for x in rows), rows[0].content_key())).unwrap().state
        first, later = publish(s, [rid], "prefill").unwrap().effect, publish(s, [rid], "denoise").unwrap().effect
        if rid == "img2":
            assert first.rows[0].kv_start_pos == 8  # the hit: 2 blocks of the first's prefix
        history, imgs = [], [i.clone() for i in images]
        for step in range(STEPS):
            batch = r.worker.install(first if step == 0 else later)
            preds = model.paged_step(rows, imgs, 1.0 - step / STEPS, batch, r.pool, get_backend("torch"), r.group)  # type: ignore[attr-defined]
            imgs = euler(imgs, preds, STEPS, 4.0)
            history.append(imgs[0])
            if step == 0:  # the first step computed the rows: their prefix blocks enter the cache
                s = commit(s, rid, [m.seq_len for m in first.rows]).unwrap().state
        out.append(history)
        r.worker.remove([rid])
        s = release(s, rid, "finished").unwrap().state
    return out


def step_mode(model: object, rank_of: object) -> dict[object, list[torch.Tensor]]:
    return steps_of(DiTStepRunner(model, rank_of(), get_backend("torch")), Budget(rows=6, tokens=64))[0]  # type: ignore[arg-type, operator]


def _worker(rank: int, ulysses: int, ring: int, init_file: str, out_dir: str, plant: str) -> None:
    import torch.distributed as dist

    from pagedkv.models import usp
    from pagedkv.shell.distributed import init

    torch.set_num_threads(1)
    init(rank, ulysses * ring, init_file, timeout_s=90)
    try:
        if plant == "kv":  # K/V heads kept where they were computed, not exchanged in the Ulysses group
            from pagedkv.models.ulysses import HeadExchange

            HeadExchange.kv = lambda self, x: torch.cat([x] * self.size)[:, : self.kv_heads]  # type: ignore[method-assign]
        sp = usp.UspDiT(DiT(CONFIG), rank, ulysses, ring)
        sp_steps = usp.UspDiT(DiT(), rank, ulysses, ring)

        def rank_of(m: object = sp) -> object:
            return build_rank(
                plan_rank(m.kv_layers(), block_size=4, dtype=torch.float32), CFG, max_rows=6, max_tokens=64
            )  # type: ignore[attr-defined]

        if plant == "pass":  # a chunk corrupted on its way round the ring
            orig = usp.UspDiT._pass
            usp.UspDiT._pass = lambda self, chunk, incoming: orig(self, chunk, incoming) * 1.5  # type: ignore[method-assign]
        out = {
            "request": request_mode(sp, rank_of),
            "steps": step_mode(sp_steps, lambda: rank_of(sp_steps)),
            "kv_heads": rank_of().pool.k[0].shape[2],
        }  # type: ignore[attr-defined]
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def one_rank() -> dict[str, object]:
    def rank_of(m: DiT) -> object:
        return lambda: build_rank(
            plan_rank(m.kv_layers(), block_size=4, dtype=torch.float32), CFG, max_rows=6, max_tokens=64
        )

    a, b = DiT(CONFIG), DiT()
    return {"request": request_mode(a, rank_of(a)), "steps": step_mode(b, rank_of(b))}


def run_grid(ulysses: int, ring: int, plant: str = "") -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(ulysses, ring, os.path.join(d, "init"), d, plant), nprocs=ulysses * ring, join=True)
        return [torch.load(os.path.join(d, f"{r}.pt")) for r in range(ulysses * ring)]


def close(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) > 0 and all(
        ((a - b).abs().max() / b.abs().max()).item() < 1e-5 for a, b in zip(got, want)
    )


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    return one_rank()


@pytest.mark.slow
@pytest.mark.parametrize("ulysses, ring", [(1, 2), (2, 2), (1, 4), (2, 1)])
def test_ring_and_usp_equal_one_rank_at_every_step(reference: dict[str, object], ulysses: int, ring: int) -> None:
    for res in run_grid(ulysses, ring):
        assert all(close(g, w) for g, w in zip(res["request"], reference["request"]))  # type: ignore[arg-type, call-overload]
        assert all(close(res["steps"][rid], w) for rid, w in reference["steps"].items())  # type: ignore[index, union-attr]
        assert res["kv_heads"] == max(1, CONFIG.kv_heads // ulysses)


@pytest.mark.slow
@pytest.mark.parametrize("ulysses, ring, plant", [(1, 2, "pass"), (2, 2, "kv"), (2, 2, "pass")])
def test_a_planted_bug_in_each_path_fails(reference: dict[str, object], ulysses: int, ring: int, plant: str) -> None:
    res = run_grid(ulysses, ring, plant=plant)[0]
    assert not all(close(g, w) for g, w in zip(res["request"], reference["request"]))  # type: ignore[arg-type, call-overload]
