"""The AR-to-DiT destination contract and the block connector."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkv.core import (
    CacheConfig,
    ErrorCode,
    RequestSpec,
    RowSpec,
    admit,
    commit,
    digest,
    initial_state,
    mark_ready,
    publish,
    release,
    request_blocks,
)
from pagedkv.shell.connector import copy_missing, recv_missing, serve_missing
from pagedkv.shell.pool import PagePool

CFG = CacheConfig(block_size=4, num_blocks=33, enable_prefix_caching=True)
PROMPT = list(range(100, 120))  # 20 tokens: 5 blocks


def source() -> tuple[object, PagePool]:
    """The AR stage: computed the prompt's KV in its own pool."""
    s = admit(initial_state(CFG), RequestSpec("ar", (RowSpec.of_tokens(PROMPT),))).unwrap().state
    pool = PagePool(CFG, num_layers=2, kv_heads=2, head_dim=4)
    for layer in range(2):
        pool.k[layer].normal_()
        pool.v[layer].normal_()
    return s, pool


def destination(cached_prefix: bool) -> object:
    s = initial_state(CFG)
    if cached_prefix:  # the DiT side already holds the first 8 tokens' blocks in its prefix cache
        s = admit(s, RequestSpec("old", (RowSpec.of_tokens(PROMPT[:9]),))).unwrap().state
        s = commit(s, "old", [9]).unwrap().state
        s = release(s, "old", "finished").unwrap().state
    spec = RowSpec.of_tokens(PROMPT + [7] * 6, prefix_len=20, target_len=6, pending_tokens=20)
    return admit(s, RequestSpec("dit", (spec,))).unwrap().state


@pytest.mark.parametrize("cached_prefix, expected", [(False, 5), (True, 3)])
def test_connector_moves_only_the_missing_blocks(cached_prefix: bool, expected: int) -> None:
    ar_state, ar_pool = source()
    s = destination(cached_prefix)
    assert publish(s, ["dit"], "prefill").failure().field == "pending"  # attention never reads a pending block
    before = digest(s)
    assert mark_ready(s, "dit", 0, 0, 99).failure().code is ErrorCode.INVALID and digest(s) == before
    pool = PagePool(CFG, num_layers=2, kv_heads=2, head_dim=4)
    s, moved = copy_missing(ar_pool, pool, s, "dit", request_blocks(ar_state, "ar"))
    assert moved == expected
    src_ids, dst_ids = request_blocks(ar_state, "ar")[0][0], request_blocks(s, "dit")[0][0]
    first = 5 - expected
    for layer in range(2):
        for j in range(first, 5):
            assert torch.equal(pool.k[layer][dst_ids[j]], ar_pool.k[layer][src_ids[j]])
    meta = publish(s, ["dit"], "prefill").unwrap().effect  # ready: the first step computes only the target
    assert (meta.rows[0].kv_start_pos, meta.rows[0].query_len) == (20, 6)
    assert release(s, "dit", "cancelled").unwrap().state.free_blocks == 32  # pending or not, all go back


def test_mark_ready_by_ranges() -> None:
    s = destination(False)
    step = mark_ready(s, "dit", 0, 0, 8).unwrap()
    assert step.effect.ready == (0, 1) and step.effect.pending == (2, 3, 4)
    assert mark_ready(step.state, "dit", 0, 0, 8).unwrap().effect.ready == ()  # again: nothing new


def _serve(rank: int, path: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        if rank == 0:
            ar_state, ar_pool = source()
            torch.save(serve_missing(ar_pool, 1), result + ".sent")
        else:
            ar_state, ar_pool = source()  # the same seedless pages are not shared: compare via what was sent
            s = destination(True)
            pool = PagePool(CFG, num_layers=2, kv_heads=2, head_dim=4)
            s, moved = recv_missing(pool, s, "dit", request_blocks(ar_state, "ar"), 0)
            ok = publish(s, ["dit"], "prefill").unwrap().effect.rows[0].kv_start_pos == 20
            torch.save((moved, ok, pool.k[0][request_blocks(s, "dit")[0][0][4]]), result + ".recv")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_connector_between_ranks_over_gloo() -> None:
    with tempfile.TemporaryDirectory() as d:
        path, result = os.path.join(d, "store"), os.path.join(d, "out")
        torch.manual_seed(0)
        mp.spawn(_serve, args=(path, result), nprocs=2, join=True)
        sent = torch.load(result + ".sent")
        moved, ok, page = torch.load(result + ".recv")
    assert sent == moved == 3 and ok
    assert page.abs().sum() > 0  # the received block holds the sender's (non-zero) pages
