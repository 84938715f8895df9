"""Launching several ranks (torch.multiprocessing) for SmolLM2 through pagedkv."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkv.core.errors import InvariantError
from pagedkv.core.config import InvalidConfig
from pagedkv.core.scheduler import cancel
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, Llama, random_llama
from pagedkv.models.parallel import shard
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.attention import get_backend
from pagedkv.shell.distributed import Leader, describe, follow, init
from pagedkv.shell.engine import Engine
from pagedkv.shell.engine_args import EngineArgs
from pagedkv.shell.kv_scales import calibration_ids, kv_dtype_of, scales_for
from pagedkv.shell.sampling import SamplingParams
from pagedkv.shell.rank import build_rank, plan_for

Request = tuple[str, list[int], SamplingParams]


def _load(weights: str, device: str) -> tuple[Llama, Any]:
    if weights == "random":  # SmolLM2's shapes, seeded random weights
        return random_llama(SMOLLM2_SHAPES, device=device), IdTokenizer()
    full, meta = Llama.smollm2(device=device)
    return full, Tokenizer(meta)


def _scales(model: Llama, tok: Any, args: EngineArgs) -> dict[str, tuple[float, float]] | None:
    """fp8 pages' scales, on every rank at once: each calibrates its shard (one forward, its all-reduces in step
    with the others'), then every layer takes the largest of the ranks' scales, the one a single rank would find
    over all the KV heads; None for pages of the model's dtype."""
    kv_dtype = kv_dtype_of(args.kv_cache_dtype)
    if kv_dtype is None:
        return None
    local = scales_for(model, kv_dtype, calibration_ids(tok), get_backend("torch"))
    if local is None:
        raise InvariantError("fp8 pages calibrate a scale on every rank")
    names = list(model.layer_names)
    both = torch.tensor([local[n] for n in names], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return {n: (k, v) for n, (k, v) in zip(names, both.tolist())}


def _leader(model: Llama, tok: Any, requests: list[Request], args: EngineArgs, result: dict[str, Any]) -> None:
    """Rank 0: the engine over a broadcasting model; tells the followers its geometry and buffer sizes."""
    try:
        result["kv_scales"] = scales = _scales(model, tok, args)
        rank = args.rank_for(model, kv_scales=scales)
        leader = Leader(model, rank.worker)
        eng = Engine(leader, tok, args, rank=rank, time_steps=True)
    except InvalidConfig as e:  # the user's sizes: the followers stop at once (no wait for a timeout)
        dist.broadcast_object_list([None], src=0)
        result["usage_error"] = str(e)
        raise
    w = rank.worker
    dist.broadcast_object_list([(rank.cache, w.max_rows, w.max_tokens, w.token_rows)], src=0)  # every rank's geometry
    t0 = time.perf_counter()
    ended: dict[Any, str] = {}  # how each request ended (plain strings pickle anywhere)
    try:
        done = eng.generate(requests, on_finish=lambda c: ended.__setitem__(c.request_id, str(c.finish_reason)))
        result["completions"] = [(c.token_ids, c.finish_reason, c.error) for c in done]
        # each token's logprobs, where the requests asked them (plain floats: the result is read weights_only)
        result["logprobs"] = [[{t: x.logprob for t, x in d.items()} for d in c.logprobs or ()] for c in done]
        Leader.stop()
    except Exception as e:  # noqa: BLE001 - any failure on any rank ends the step everywhere
        result["error"] = describe(e)
        st = eng.state
        step_ids = {*st.sched_decode, *(p.request_id for p in st.sched_prefill), *st.sched_diffusion}
        for rid in sorted(eng.state.live.keys(), key=str):
            ended[rid] = "error" if rid in step_ids else "cancelled"
            eng.state = cancel(eng.state, rid, ended[rid]).unwrap()
            eng.worker.remove([rid])
    kv = eng.state.kv
    result.update(
        seconds=time.perf_counter() - t0,
        broadcast_seconds=leader.broadcast_seconds,
        steps=eng.stats.steps,
        step_seconds=eng.step_times,
        pool_whole=kv.free_blocks == kv.config.usable_blocks and check_invariants(kv) == [],
        finished=ended,
    )


def _follower(model: Llama, tok: Any, args: EngineArgs, fail_at: int | None, result: dict[str, Any]) -> None:
    """Another rank: its own plan for its shard (fp8 pages: with the scales every rank agreed), rank 0's geometry and
    buffer sizes, then follow."""
    result["kv_scales"] = scales = _scales(model, tok, args)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:  # rank 0 could not start (its sizes are wrong): nothing to follow
        result["steps"] = 0
        return
    cache, rows, tokens, token_rows = box[0]
    plan = plan_for(model, block_size=cache.block_size, kv_dtype=kv_dtype_of(args.kv_cache_dtype))
    rank = build_rank(
        plan, cache, max_rows=rows, max_tokens=tokens, token_rows=token_rows, device=model.device, kv_scales=scales
    )
    result["steps"] = follow(model, rank, get_backend("torch"), fail_at)


def _rank_main(
    rank: int,
    world: int,
    init_file: str,
    out_dir: str,
    requests: list[Request],
    engine_kw: dict[str, Any],
    fail_rank: int | None,
    fail_at: int | None,
    timeout_s: float,
    backend: str,
    weights: str,
) -> None:
    torch.set_num_threads(1)
    init(rank, world, init_file, timeout_s, backend)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    result: dict[str, Any] = {"rank": rank}
    try:
        full, tok = _load(weights, device)
        model = shard(full, rank, world) if world > 1 else full
        if rank == 0:
            _leader(model, tok, requests, EngineArgs(**engine_kw), result)
        else:
            _follower(model, tok, EngineArgs(**engine_kw), fail_at if rank == fail_rank else None, result)
    except Exception as e:  # noqa: BLE001
        result["error"] = describe(e)
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - a broken group may not tear down cleanly
            pass


def run_ranks(
    world: int,
    requests: list[Request],
    *,
    fail_rank: int | None = None,
    fail_at: int | None = None,
    timeout_s: float = 60.0,
    backend: str = "gloo",
    weights: str = "smollm2",
    **engine_kw: Any,
) -> list[dict[str, Any]]:
    """Run ``requests`` on ``world`` ranks (gloo on the CPU, or nccl with one GPU a rank); every rank's
    result dict, rank 0 first. ``weights``: "smollm2" (the GGUF) or "random" (its shapes, seeded)."""
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "store")
        args = (world, init_file, d, requests, engine_kw, fail_rank, fail_at, timeout_s, backend, weights)
        mp.spawn(_rank_main, args=args, nprocs=world, join=True)  # type: ignore[attr-defined, no-untyped-call]
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]
