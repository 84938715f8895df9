"""Launching several ranks (torch.multiprocessing) for SmolLM2 through pagedkv."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkv.core.verify.invariants import check_invariants
from pagedkv.core.scheduler import cancel
from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, Llama, random_llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.attention import get_backend
from pagedkv.shell.distributed import Leader, TPLlama, describe, follow, init
from pagedkv.shell.engine import Engine, SamplingParams
from pagedkv.shell.pool import PagePool
from pagedkv.shell.worker import Worker

Request = tuple[str, list[int], SamplingParams]


def _load(weights: str, device: str) -> tuple[Llama, Any]:
    if weights == "random":  # SmolLM2's shapes, seeded random weights
        return random_llama(SMOLLM2_SHAPES, device=device), IdTokenizer()
    full, meta = Llama.smollm2(device=device)
    return full, Tokenizer(meta)  # type: ignore[arg-type]


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, requests: list[Request], engine_kw: dict[str, Any],
               fail_rank: int | None, fail_at: int | None, timeout_s: float, backend: str, weights: str) -> None:  # fmt: skip
    torch.set_num_threads(1)
    init(rank, world, init_file, timeout_s, backend)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    result: dict[str, Any] = {"rank": rank}
    try:
        full, tok = _load(weights, device)
        model = TPLlama(full, rank, world) if world > 1 else full
        if rank == 0:
            leader = Leader(model)
            eng = Engine(leader, tok, **engine_kw)  # type: ignore[arg-type]
            leader.worker = eng.worker
            dist.broadcast_object_list([eng.cache], src=0)  # the geometry every rank allocates
            t0 = time.perf_counter()
            step_times: list[float] = []
            eng.step_hook = step_times  # type: ignore[attr-defined]
            try:
                done = eng.generate(requests)
                result["completions"] = [(c.token_ids, c.finish_reason) for c in done]
                Leader.stop()
            except Exception as e:  # noqa: BLE001 - any failure on any rank ends the step everywhere
                result["error"] = describe(e)
                step_ids = {rid for _, rid, *_ in eng.state.scheduled}
                for rid in sorted(eng.state.requests.keys(), key=str):
                    eng.state = cancel(eng.state, rid, "error" if rid in step_ids else "cancelled").unwrap()
                    eng.worker.remove([rid])
            result["seconds"] = time.perf_counter() - t0
            result["broadcast_seconds"] = leader.broadcast_seconds
            result["steps"] = eng.stats.steps
            result["step_seconds"] = step_times
            kv = eng.state.kv
            result["pool_whole"] = kv.free_blocks == kv.config.usable_blocks and check_invariants(kv) == []
            result["finished"] = {rid: str(how) for rid, how in eng.state.finished.items()}  # (plain strings pickle anywhere)
        else:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            cache = box[0]
            c = model.config
            pool = PagePool(cache, num_layers=c.num_layers, kv_heads=c.num_kv_heads, head_dim=c.head_dim, device=device)
            worker = Worker(cache, max_rows=engine_kw.get("max_num_seqs", 16),
                            max_blocks_per_row=-(-c.max_position // cache.block_size),
                            max_tokens=engine_kw.get("max_num_batched_tokens", 2048), device=device)  # fmt: skip
            result["steps"] = follow(model, pool, worker, get_backend("torch"), cache.groups[0],  # type: ignore[arg-type]
                                     fail_at if rank == fail_rank else None)  # fmt: skip
    except Exception as e:  # noqa: BLE001
        result["error"] = describe(e)
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - a broken group may not tear down cleanly
            pass


def run_ranks(world: int, requests: list[Request], *, fail_rank: int | None = None, fail_at: int | None = None,
              timeout_s: float = 60.0, backend: str = "gloo", weights: str = "smollm2",
              **engine_kw: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Run ``requests`` on ``world`` ranks (gloo on the CPU, or nccl with one GPU a rank); every rank's
    result dict, rank 0 first. ``weights``: "smollm2" (the GGUF) or "random" (its shapes, seeded)."""
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "store")
        mp.spawn(_rank_main, args=(world, init_file, d, requests, engine_kw, fail_rank, fail_at, timeout_s, backend,
                                   weights), nprocs=world, join=True)  # fmt: skip
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]
