"""``pagedkv denoise``: the DiT reference model over a few CFG requests, through the scheduler and
the paged KV cache; per-step timing and pool usage (the loop itself: ``app.diffusion.DiTRunner``)."""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace
from typing import Any

from returns.result import Failure

from pagedkv.app.args import USAGE_EXIT, bounded_int, seed


def add_parser(sub: Any) -> None:
    d = sub.add_parser(
        "denoise",
        help="run the DiT reference model over CFG requests through the paged KV cache",
        description="Denoise CFG requests (a conditional and an unconditional row each) with the "
        "DiT reference model, through the scheduler and the paged KV cache; per-step "
        "timing and pool usage.",
    )
    d.add_argument("--requests", type=bounded_int(1, 4096), default=4, help="CFG requests (two rows each)")
    d.add_argument("--steps", type=bounded_int(1, 10_000), default=6, help="denoising steps per request")
    d.add_argument(
        "--image-tokens", type=bounded_int(1, 1 << 16), default=16, help="latent tokens each row rewrites per step"
    )
    d.add_argument("--blocks", type=bounded_int(1, 1 << 20), default=48, help="usable blocks in the pool")
    d.add_argument("--block-size", type=bounded_int(1, 4096), default=8, help="tokens per block")
    d.add_argument("--seed", type=seed, default=0, help="prompts, references and latents (below 2**63)")
    d.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        help="the pages' dtype: auto (fp32), or fp8 with each layer's K and V scales calibrated on the first "
        "request's first step",
    )


def _submit_all(args: argparse.Namespace, model: Any, s: Any) -> tuple[Any, dict[Any, Any]]:
    import torch

    from pagedkv.core.scheduler import SeqRequest, submit
    from pagedkv.models.dit import DiTRow

    rng = random.Random(args.seed)
    c = model.config
    g = torch.Generator().manual_seed(args.seed)
    work: dict[Any, tuple[list[Any], list[Any]]] = {}
    for i in range(args.requests):
        ref = torch.randn(rng.randrange(2, 9), c.latent, generator=g) if rng.random() < 0.5 else None
        cond = DiTRow(tuple(rng.randrange(c.vocab) for _ in range(rng.randrange(6, 40))), ref)
        uncond = DiTRow(tuple(rng.randrange(c.vocab) for _ in range(rng.randrange(2, 6))), ref)
        img = torch.randn(args.image_tokens, c.latent, generator=g)
        rows = [cond, uncond]
        work[f"img-{i}"] = (rows, [img.clone(), img.clone()])
        req = SeqRequest(
            f"img-{i}",
            rows=tuple(r.spec(args.image_tokens) for r in rows),
            steps=args.steps,
            extra_keys=cond.content_key(),
        )
        s = submit(s, req).unwrap()
    return s, work


def _calibrated(model: Any, cfg: Any, s: Any, work: dict[Any, Any], need: int) -> dict[str, tuple[float, float]]:
    """fp8 pages' scales: one first step of the first request that fits, on fp32 pages of the same geometry."""
    import torch

    from pagedkv.app.diffusion import dit_kv_scales
    from pagedkv.core import RequestSpec, admit, initial_state, publish
    from pagedkv.shell.attention import get_backend
    from pagedkv.shell.rank import build_rank, plan_rank

    fp32 = build_rank(
        plan_rank(model.kv_layers(), block_size=cfg.block_size, dtype=torch.float32), cfg, max_rows=4, max_tokens=need
    )
    for rid, req in s.seqs.items():
        got = admit(initial_state(cfg), RequestSpec("calibration", req.rows, req.extra_keys))
        if not isinstance(got, Failure):
            rows, images = work[rid]
            first = publish(got.unwrap().state, ["calibration"], "prefill").unwrap().effect
            return dit_kv_scales(model, fp32, get_backend("torch"), rows, [i.clone() for i in images], first)
    return {}


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedkv.app.diffusion import DiTRunner
    from pagedkv.core.config import InvalidConfig
    from pagedkv.core.scheduler import new_scheduler, on_output, schedule
    from pagedkv.models.dit import DiT
    from pagedkv.shell.attention import get_backend
    from pagedkv.shell.kv_scales import kv_dtype_of
    from pagedkv.shell.rank import build_rank, plan_rank

    model = DiT()
    kv_dtype = kv_dtype_of(args.kv_cache_dtype) or torch.float32
    try:
        layers = tuple(replace(x, dtype_bytes=kv_dtype.itemsize) for x in model.kv_layers())
        plan = plan_rank(layers, block_size=args.block_size, dtype=kv_dtype)
        cfg = plan.cache_config(args.blocks + 1, enable_prefix_caching=True, max_model_len=64 * args.block_size)
    except InvalidConfig as e:
        print(f"pagedkv denoise: {e}", file=sys.stderr)
        return USAGE_EXIT
    s, work = _submit_all(args, model, new_scheduler(cfg))
    # the buffers hold the largest request that fits a row's length (a longer one is refused for good)
    firsts = [sum(r.num_tokens for r in req.rows or ()) for req in s.seqs.values()]
    need = max([512] + [n for n in firsts if n <= 4 * 64 * args.block_size])  # (rows of at most max_model_len)
    try:
        scales = _calibrated(model, cfg, s, work, need) if kv_dtype != torch.float32 else None
        rank = build_rank(plan, cfg, max_rows=4, max_tokens=need, kv_scales=scales)
    except (MemoryError, RuntimeError) as e:  # a pool this machine cannot allocate
        print(
            f"pagedkv denoise: cannot allocate a pool of {args.blocks} blocks of {args.block_size} tokens: "
            f"{' '.join(str(e).split())[:160]}",
            file=sys.stderr,
        )
        return USAGE_EXIT
    runner = DiTRunner(model, rank, get_backend("torch"))
    usable = cfg.usable_blocks
    refused: list[Any] = []
    print(f"{'request':<8} {'rows':>4} {'tokens':>7} {'cached':>7} {'blocks':>7} {'pool':>6}  per-step ms")
    while s.live:
        s, plan_ = schedule(s).unwrap()
        why = {err.request: err.message for err in plan_.refusals}
        for rid, how in plan_.finished:  # refused for good at admission (too long for the pool, say)
            print(f"{rid:<8} refused: {how}: {why.get(rid, '?')}")
            refused.append(rid)
        for run_ in plan_.diffusion:
            rows, images = work[run_.request_id]
            runner.run(rows, images, run_.steps, run_.first, run_.later)
            rank.worker.remove([run_.request_id])  # a request-level run is done: its buffer rows go back
            used = usable - s.kv.free_blocks
            tokens = sum(r.seq_len for r in run_.first.rows)
            cached = sum(r.kv_start_pos for r in run_.first.rows)
            per_step = " ".join(f"{x * 1e3:.1f}" for x in runner.step_seconds)
            print(
                f"{run_.request_id:<8} {len(rows):>4} {tokens:>7} {cached:>7} {used:>7} {used / usable:>6.0%}  {per_step}"
            )
        s, _ = on_output(s, {}).unwrap()
    ran = args.requests - len(refused)
    print(
        f"{ran} of {args.requests} requests denoised, {args.steps} steps each; later steps write only the target "
        f"span ({args.image_tokens + 1} tokens per row) and read the prefix from the pages"
    )
    if not ran:
        print(
            f"pagedkv denoise: no request could run ({len(refused)} refused; a pool of {usable} blocks of "
            f"{args.block_size} tokens, max_model_len {cfg.max_model_len})",
            file=sys.stderr,
        )
        return USAGE_EXIT
    return 0
