"""Install rules of the worker; every refused install changes no buffer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedkv.core import (
    CacheConfig,
    GroupKind,
    GroupSpec,
    RequestSpec,
    RowSpec,
    admit,
    append,
    commit,
    initial_state,
    publish,
    reset,
)
from pagedkv.shell.errors import ShellError
from pagedkv.shell.pool import PagePool
from pagedkv.shell.rank import attention_layers, plan_rank, size_pool
from pagedkv.shell.worker import Worker

CFG = CacheConfig(
    block_size=4, num_blocks=33, groups=(GroupSpec("full"), GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=4))
)


def buffers(w: Worker) -> list[torch.Tensor]:
    return [
        t.clone()
        for t in (w.row_tables, w.block_tables, w.seq_lens, w.kv_start, w.query_start_loc, w.slot_mapping, w.positions)
    ]


def refused(w: Worker, meta: object, code: str) -> None:
    before, rows, gen = buffers(w), dict(w.rows), w.generation
    with pytest.raises(ShellError) as e:
        w.install(meta)  # type: ignore[arg-type]
    assert e.value.code.value == code, e.value
    assert all(torch.equal(a, b) for a, b in zip(before, buffers(w))), "a refused install wrote a buffer"
    assert w.rows == rows and w.generation == gen


def worker() -> Worker:
    return Worker(CFG, max_rows=4, max_blocks_per_row=8, max_tokens=64)


def state_with_a() -> object:
    s = initial_state(CFG)
    return admit(s, RequestSpec("a", (RowSpec(6),))).unwrap().state


def test_install_writes_tables_lengths_and_slots() -> None:
    s = state_with_a()
    meta = publish(s, ["a"], "prefill").unwrap().effect
    w = worker()
    b = w.install(meta)
    assert b.num_rows == 1 and b.num_tokens == 6
    assert b.block_tables[:, 0, :2].tolist() == [[1, 2], [3, 4]]
    assert b.seq_lens.tolist() == [6] and b.query_start_loc.tolist() == [0, 6]
    assert b.slot_mapping.tolist() == [4, 5, 6, 7, 8, 9] and b.positions.tolist() == list(range(6))
    assert w.install(meta) is b  # the same generation and snapshot: a no-op


def test_buffer_addresses_never_change() -> None:
    w = worker()
    ptrs = [t.data_ptr() for t in (w.block_tables, w.seq_lens, w.slot_mapping, w.query_start_loc)]
    s = state_with_a()
    w.install(publish(s, ["a"], "prefill").unwrap().effect)
    s = commit(s, "a", [6]).unwrap().state
    s = append(s, "a", [3]).unwrap().state
    w.install(publish(s, ["a"], "prefill").unwrap().effect)
    assert ptrs == [t.data_ptr() for t in (w.block_tables, w.seq_lens, w.slot_mapping, w.query_start_loc)]


def test_stale_and_conflicting_snapshots_are_refused_and_change_nothing() -> None:
    s1 = state_with_a()
    old = publish(s1, ["a"], "prefill").unwrap().effect
    s2 = commit(s1, "a", [6]).unwrap().state
    s2 = append(s2, "a", [3]).unwrap().state  # generation 2: a third block in each group
    w = worker()
    w.install(publish(s2, ["a"], "prefill").unwrap().effect)
    refused(w, old, "STALE_METADATA")
    row = publish(s2, ["a"], "prefill").unwrap().effect
    other = replace(row, rows=(replace(row.rows[0], block_ids=((1, 2, 9), (3, 4, 10))),))
    refused(w, other, "CONFLICTING_METADATA")  # same generation, other blocks
    newer = replace(other, generation=row.generation + 1)
    refused(w, newer, "CONFLICTING_METADATA")  # a newer one that does not extend
    with pytest.raises(ShellError):
        w.install(replace(row, epoch=-1))


def test_a_newer_extending_snapshot_writes_only_new_ids_and_windows_may_null() -> None:
    s = state_with_a()
    w = worker()
    w.install(publish(s, ["a"], "prefill").unwrap().effect)
    s = append(commit(s, "a", [6]).unwrap().state, "a", [3]).unwrap().state  # 9 tokens: blocks 5 and 6
    s = commit(s, "a", [9]).unwrap().state  # a query at 9 sees from 6: the window lets block 3 go
    s = append(s, "a", [1]).unwrap().state
    b = w.install(publish(s, ["a"], "decode").unwrap().effect)
    assert b.block_tables[:, 0, :3].tolist() == [[1, 2, 5], [0, 4, 6]]


def test_a_row_cut_back_installs_and_grows_again() -> None:
    """Issue 31: drafts rejected (``truncate``) leave shorter block lists under a newer generation; the worker
    takes them, and the row's next growth writes its new block where the cut one stood."""
    from pagedkv.core import truncate

    s = state_with_a()
    w = worker()
    s = append(commit(s, "a", [6]).unwrap().state, "a", [5]).unwrap().state  # 11 tokens: five drafts, block 5
    w.install(publish(s, ["a"], "prefill", query_limits={"a": 5}).unwrap().effect)
    s = truncate(s, "a", [8]).unwrap().state  # two accepted: block 5 goes back
    b = w.install(publish(s, ["a"], "prefill", query_limits={"a": 2}).unwrap().effect)
    assert b.seq_lens[:1].tolist() == [8] and b.block_tables[0, 0, :2].tolist() == [1, 2]
    s = append(commit(s, "a", [8]).unwrap().state, "a", [1]).unwrap().state  # position 8 opens a block again
    b = w.install(publish(s, ["a"], "decode").unwrap().effect)
    assert b.block_tables[0, 0, :3].tolist() == list(s.rows[0].blocks[0]) and b.seq_lens[:1].tolist() == [9]


@pytest.mark.parametrize("mutate", ["block_size", "groups", "block_range", "lengths", "slots", "capacity", "rows"])
def test_malformed_snapshots_are_invalid_and_change_nothing(mutate: str) -> None:
    s = state_with_a()
    meta = publish(s, ["a"], "prefill").unwrap().effect
    r = meta.rows[0]
    bad = {
        "block_size": replace(meta, block_size=8),
        "groups": replace(meta, rows=(replace(r, block_ids=r.block_ids[:1]),)),
        "block_range": replace(meta, rows=(replace(r, block_ids=((1, 99), (3, 4))),)),
        "lengths": replace(meta, rows=(replace(r, query_len=2),)),
        "slots": replace(meta, rows=(replace(r, slots=r.slots[:2]),)),
        "capacity": replace(meta, rows=(replace(r, block_ids=((1,) * 9, (3,) * 9)),)),
        "rows": replace(meta, rows=(r, r)),
    }[mutate]
    w = worker()
    refused(w, bad, "INVALID")


def test_remove_is_idempotent_and_a_reset_epoch_clears_everything() -> None:
    s = state_with_a()
    s = admit(s, RequestSpec("b", (RowSpec(3),))).unwrap().state
    w = worker()
    w.install(publish(s, ["a", "b"], "prefill").unwrap().effect)
    assert w.remove(["a", "zz"]) == 1 and w.remove(["a"]) == 0
    assert len(w.free_rows) == 3
    s = reset(s).unwrap().state
    s = admit(s, RequestSpec("c", (RowSpec(2),))).unwrap().state
    b = w.install(publish(s, ["c"], "prefill").unwrap().effect)
    assert set(w.rows) == {("c", 0)} and b.block_tables[:, 0, :1].tolist() == [[1], [2]]


def test_missing_metadata_is_an_error_never_a_dense_run() -> None:
    with pytest.raises(ShellError):
        worker().require(None)


def test_pool_sizing_and_write() -> None:
    plan = plan_rank(
        attention_layers(2, kv_heads=2, head_dim=8, dtype=torch.float32), block_size=4, dtype=torch.float32
    )
    sizing = size_pool(plan, kv_cache_memory_bytes=10_000)
    assert sizing.page_bytes == 2 * 2 * 4 * 2 * 8 * 4 and sizing.num_blocks == 10_000 // 1024
    assert sizing.tokens == (sizing.num_blocks - 1) * 4
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        size_pool(plan)
    pool = PagePool(CFG, num_layers=1, kv_heads=2, head_dim=8)
    k = torch.randn(3, 2, 8)
    pool.write(0, k, -k, torch.tensor([5, 6, 40]))
    assert torch.equal(pool.k[0][1, 1], k[0]) and torch.equal(pool.v[0][10, 0], -k[2])


def test_token_rows_lay_a_causal_snapshot_out_one_query_token_a_row() -> None:
    """``install(meta, token_rows=True)``: each query token a decode row over its request's table (length its
    position + 1, its own slot), the core's snapshot kept as ``source``; over the buffers' token rows, or a row
    that is not one causal segment, is refused with nothing written."""
    from pagedkv.core.outputs.metadata import Phase, Segment

    s = admit(state_with_a(), RequestSpec("b", (RowSpec(3),))).unwrap().state
    meta = publish(s, ["a", "b"], "prefill").unwrap().effect
    w = Worker(CFG, max_rows=4, max_blocks_per_row=8, max_tokens=64, token_rows=9)
    assert w.forward_rows == 9 and w.block_tables.shape[1] == 9
    b = w.install(meta, token_rows=True)
    assert b.source is meta and b.metadata.phase is Phase.DECODE and b.num_rows == b.num_tokens == 9
    assert b.seq_lens.tolist() == [1, 2, 3, 4, 5, 6, 1, 2, 3] and b.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert b.query_start_loc.tolist() == list(range(10))
    assert b.slot_mapping.tolist() == [s for r in meta.rows for s in r.slots]
    assert all(b.block_tables[0, i, :2].tolist() == [1, 2] for i in range(6))  # a's table, six times
    assert [r.request_id for r in b.metadata.rows] == ["a"] * 6 + ["b"] * 3
    assert w.install(meta, token_rows=True) is b  # the same snapshot, the same layout: a no-op
    flat = w.install(meta)  # the same snapshot laid out by rows again
    assert flat.source is None and flat.num_rows == 2 and flat.seq_lens.tolist() == [6, 3]
    for small, bad in (
        (Worker(CFG, max_rows=4, max_blocks_per_row=8, max_tokens=64, token_rows=8), meta),
        (w, replace(meta, rows=(replace(meta.rows[0], segments=(Segment(False, 0, 6, 6),)),))),
    ):
        before, rows = buffers(small), dict(small.rows)
        with pytest.raises(ShellError, match="8 such rows|one causal segment"):
            small.install(bad, token_rows=True)
        assert all(torch.equal(x, y) for x, y in zip(before, buffers(small))) and small.rows == rows
