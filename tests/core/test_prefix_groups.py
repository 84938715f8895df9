"""Prefix caching and hybrid groups: the rules of issue 3 pinned with exact numbers."""

from dataclasses import replace
from pathlib import Path

import pytest

from pagedkv.app.cli import main
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.core import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheConfig,
    ErrorCode,
    GroupKind,
    GroupSpec,
    RequestSpec,
    RowSpec,
    admit,
    append,
    commit,
    digest,
    free_queue,
    hash_block,
    initial_state,
    release,
    request_blocks,
    reset,
    reset_prefix_cache,
    root_hash,
    turn_away,
)

TRACES = sorted((Path(__file__).parent / "traces").glob("*.jsonl"))


@pytest.mark.parametrize("trace", TRACES, ids=[t.stem for t in TRACES])
def test_pinned_traces_replay_without_divergence(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(trace), "--json"]) == 0, capsys.readouterr().err


def caching(usable: int = 8, block_size: int = 4, **kw: object) -> object:
    return initial_state(CacheConfig(block_size=block_size, num_blocks=usable + 1, enable_prefix_caching=True, **kw))  # type: ignore[arg-type]


def tokens_row(*ids: int) -> RowSpec:
    return RowSpec.of_tokens(list(ids))


def test_commit_stores_each_full_block_once_with_its_chain() -> None:
    s = admit(caching(), RequestSpec("a", (tokens_row(*range(1, 11)),))).unwrap().state
    step = commit(s, "a", [10]).unwrap()
    root = root_hash("pagedkv")
    h0 = hash_block(root, [1, 2, 3, 4], ())
    h1 = hash_block(h0, [5, 6, 7, 8], ())
    assert step.effect.events == (BlockStored(h0, None, (1, 2, 3, 4), 0, 1), BlockStored(h1, h0, (5, 6, 7, 8), 0, 2))
    assert dict(step.state.cache) == {(0, h0): 1, (0, h1): 2}
    # an identical block committed by another request is not stored twice
    s = admit(step.state, RequestSpec("b", (tokens_row(1, 2, 3, 4),))).unwrap().state  # full hit stops short
    assert request_blocks(s, "b") == (((4,),),)  # 4 tokens: a hit may take at most (4 - 1) // 4 = 0 blocks
    assert commit(s, "b", [4]).unwrap().effect.events == ()
    assert len(commit(s, "b", [4]).unwrap().state.cache) == 2


def test_eviction_is_reported_and_the_hash_is_gone() -> None:
    s = admit(caching(usable=2), RequestSpec("a", (tokens_row(1, 2, 3, 4, 5),))).unwrap().state
    s = commit(s, "a", [5]).unwrap().state
    s = release(s, "a", "finished").unwrap().state
    assert free_queue(s) == [2, 1]  # tail first: the prefix block 1 outlives the suffix
    step = admit(s, RequestSpec("b", (RowSpec(4),))).unwrap()
    assert step.effect.blocks == (((2,),),) and step.effect.events == ()
    step = admit(step.state, RequestSpec("c", (RowSpec(4),))).unwrap()
    (ev,) = step.effect.events
    assert isinstance(ev, BlockRemoved) and ev.block_id == 1 and len(step.state.cache) == 0


def test_metrics() -> None:
    s = admit(caching(), RequestSpec("a", (tokens_row(*range(1, 10)),))).unwrap().state
    s = commit(s, "a", [9]).unwrap().state
    s = admit(s, RequestSpec("b", (tokens_row(*range(1, 10)),))).unwrap().state
    assert (s.prefix_queries, s.prefix_hits) == (18, 8)
    assert s.prefix_hit_rate == pytest.approx(8 / 18)
    assert s.usage == pytest.approx(4 / 8)  # blocks 1, 2 shared; 3 and one new block for b


def test_reset_prefix_cache_while_requests_run() -> None:
    s = admit(caching(), RequestSpec("a", (tokens_row(*range(1, 10)),))).unwrap().state
    s = commit(s, "a", [4]).unwrap().state
    s = admit(s, RequestSpec("x", (tokens_row(*range(50, 55)),))).unwrap().state
    s = commit(s, "x", [5]).unwrap().state
    s = release(s, "x", "finished").unwrap().state  # its cached block 3 is unreferenced, in the free queue
    before = free_queue(s)
    step = reset_prefix_cache(s).unwrap()
    assert step.effect.dropped == 2 and step.effect.events == (AllBlocksCleared(),)
    s = step.state
    assert len(s.cache) == 0 and free_queue(s) == before  # unreferenced cached blocks are plain free blocks now
    assert request_blocks(s, "a") == (((1, 2, 3),),)
    # the running request keeps its blocks but no longer inserts: its KV predates the reset
    s2 = commit(s, "a", [9]).unwrap()
    assert s2.effect.events == () and len(s2.state.cache) == 0
    # a new request caches again
    s = admit(s2.state, RequestSpec("b", (tokens_row(*range(1, 10)),))).unwrap().state
    assert admit(s, RequestSpec("q", (tokens_row(1),))).unwrap().effect.cached_tokens == (0,)
    assert commit(s, "b", [9]).unwrap().effect.events != ()


def test_rows_without_token_ids_never_hit() -> None:
    s = admit(caching(usable=16), RequestSpec("a", (tokens_row(*range(1, 10)),))).unwrap().state
    s = commit(s, "a", [9]).unwrap().state
    mixed = RequestSpec("m", (tokens_row(*range(1, 10)), RowSpec(9)))
    assert admit(s, mixed).unwrap().effect.cached_tokens == (0, 0)


def test_appended_token_ids_are_cached_after_commit_but_counts_stop_tracking() -> None:
    s = admit(caching(), RequestSpec("a", (tokens_row(1, 2, 3),))).unwrap().state
    s = append(s, "a", [[4, 5]]).unwrap().state
    step = commit(s, "a", [5]).unwrap()
    assert [e.token_ids for e in step.effect.events if isinstance(e, BlockStored)] == [(1, 2, 3, 4)]
    s = append(step.state, "a", [3]).unwrap().state  # ids unknown from position 5 on
    s = append(s, "a", [[9]]).unwrap().state
    assert commit(s, "a", [9]).unwrap().effect.events == ()


def test_window_of_112_tokens_keeps_7_full_and_2_window_blocks() -> None:
    cfg = CacheConfig(
        block_size=16, num_blocks=40, groups=(GroupSpec("full"), GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=32))
    )
    s = admit(initial_state(cfg), RequestSpec("a", (RowSpec(112),))).unwrap().state
    step = commit(s, "a", [112]).unwrap()
    full, swa = request_blocks(step.state, "a")[0]
    assert sum(b != 0 for b in full) == 7 and sum(b != 0 for b in swa) == 2
    assert step.effect.freed_blocks == 5 and step.effect.generation == 2


def test_a_diffusion_row_keeps_the_window_its_target_needs() -> None:
    cfg = CacheConfig(
        block_size=4, num_blocks=30, groups=(GroupSpec("full"), GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=4))
    )
    s = admit(initial_state(cfg), RequestSpec("d", (RowSpec(24, prefix_len=16, target_len=8),))).unwrap().state
    s = commit(s, "d", [24]).unwrap().state
    # every later denoising step queries from position 16: blocks from (16 - 4 + 1) // 4 = 3 stay
    assert request_blocks(s, "d")[0][1] == (0, 0, 0, 10, 11, 12)


def test_reset_clears_the_cache_and_keeps_generations() -> None:
    s = admit(caching(), RequestSpec("a", (tokens_row(*range(1, 10)),))).unwrap().state
    s = commit(s, "a", [9]).unwrap().state
    step = reset(s).unwrap()
    assert step.effect.events == (AllBlocksCleared(),) and len(step.state.cache) == 0
    assert step.state.generation == s.generation and digest(step.state) != digest(s)


def test_every_successful_prefix_cache_reset_says_so_as_vllm_does() -> None:
    """vLLM's block pool sends AllBlocksCleared on every successful reset, an empty cache's too; a router
    counting batches over ZMQ sees the same stream from pagedkv (issue 28: 818 batches against 525)."""
    step = reset_prefix_cache(caching()).unwrap()
    assert step.effect.dropped == 0 and step.effect.events == (AllBlocksCleared(),)


@pytest.mark.parametrize("caching", [True, False])
def test_the_vllm_omni_policy_lets_a_cfg_requests_rows_go_as_vllm_omnis_manager(caching: bool) -> None:
    """Two CFG rows (prefixes of 40 and 20 tokens, targets of 20; blocks of 16) admitted, computed, released under
    ``free_queue="vllm-omni"``: the free queue as vLLM-Omni 0.30's DiffusionKVCacheManager leaves it (its rows freed
    the last first; with caching each as vLLM frees a request, hashless blocks to the head and the prefix's cached
    blocks to the tail; without, each row's blocks in ascending ids to the head). The differential against the
    manager itself is tests/integrations_omni."""
    s = initial_state(CacheConfig(block_size=16, num_blocks=20, enable_prefix_caching=caching, free_queue="vllm-omni"))
    rows = (
        RowSpec.of_tokens(list(range(40)) + [0] * 20, prefix_len=40, target_len=20),
        RowSpec.of_tokens(list(range(100, 120)) + [0] * 20, prefix_len=20, target_len=20),
    )
    step = admit(s, RequestSpec("a", rows)).unwrap()
    assert step.effect.blocks == (((1, 2, 3, 4),), ((5, 6, 7),))
    s = commit(step.state, "a", [60, 40]).unwrap().state
    s = release(s, "a", "finished").unwrap().state
    rest = list(range(8, 20))
    assert free_queue(s) == ([4, 3, 7, 6, *rest, 5, 2, 1] if caching else [1, 2, 3, 4, 5, 6, 7, *rest])


def test_turn_away_leaves_the_pool_as_a_refused_vllm_omni_reservation() -> None:
    """``turn_away``: a CFG request that does not fit now, under ``free_queue="vllm-omni"``: the leading rows that fit
    took fresh blocks (evicting a cached one) and gave them back, the hits went to the tail the last first; the same
    blocks free, every invariant kept. Refused, the state unchanged, under another policy or for a request that
    fits. (tests/integrations_omni compares it, queue for queue, with vLLM-Omni's own manager.)"""
    cfg = CacheConfig(block_size=4, num_blocks=13, enable_prefix_caching=True, free_queue="vllm-omni")
    s = initial_state(cfg)
    a = RowSpec.of_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0], prefix_len=8, target_len=1)
    s = admit(s, RequestSpec("a", (a,))).unwrap().state
    s = release(commit(s, "a", [9]).unwrap().state, "a", "finished").unwrap().state
    assert free_queue(s) == [3, *range(4, 13), 2, 1]  # a's prefix cached at the tail
    s = admit(s, RequestSpec("x", (RowSpec(8),))).unwrap().state  # holds 3 and 4: 10 free
    row = RowSpec.of_tokens([1, 2, 3, 4, 5, 6, 7, 8] + [0] * 12, prefix_len=8, target_len=12)  # 5 blocks, 2 hit
    spec = RequestSpec("b", (row, row, row))  # 2 + 3 x 3 = 11 blocks: 10 free
    assert admit(s, spec).failure().code is ErrorCode.NO_CAPACITY
    step = turn_away(s, spec).unwrap()
    assert step.effect.rows_tried == 2  # 3 + 3 fresh blocks of the 8 others; the third row's 3 did not fit
    # the second row's blocks back at the head, then the first's (each reversed), the hits last first at the tail
    assert free_queue(step.state) == [7, 6, 5, 10, 9, 8, 11, 12, 2, 1]
    assert step.state.free_blocks == s.free_blocks and check_invariants(step.state) == []
    for bad, other in ((spec, replace(cfg, free_queue="vllm")), (RequestSpec("c", (row,)), cfg)):
        t = initial_state(other)
        t = admit(t, RequestSpec("a", (a,))).unwrap().state
        t = release(commit(t, "a", [9]).unwrap().state, "a", "finished").unwrap().state
        t = admit(t, RequestSpec("x", (RowSpec(8),))).unwrap().state
        assert turn_away(t, bad).failure().code is ErrorCode.INVALID  # (another policy; a request that fits)
    windowed = replace(cfg, groups=(GroupSpec("full"), GroupSpec("w", GroupKind.SLIDING_WINDOW, window=8)))
    err = turn_away(initial_state(windowed), RequestSpec("w", (RowSpec(80),))).failure()
    assert err.code is ErrorCode.INVALID and "every position" in err.message  # (a window nulls positions)


def test_rows_keyed_by_their_callers_hashes() -> None:
    """``RowSpec.block_hashes``: a row's leading full blocks keyed by hashes its caller computed (an identity that is
    more than the ids: vLLM-Omni's multimodal rows). Two CFG rows of the same ids under other hashes miss; under the
    same hashes they hit, and their blocks were cached under them at commit; the trace carries them and replays; a
    row of a count (no ids: an embedding's prefix) is keyed by them as far as they reach; a malformed one is
    INVALID."""
    from pagedkv.core.verify.record import row_json
    from pagedkv.core.verify.trace_ops import admit_spec

    cfg = CacheConfig(block_size=4, num_blocks=20, enable_prefix_caching=True, block_hash="sha256")
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    cat, dog = (bytes([1]) * 32, bytes([2]) * 32), (bytes([3]) * 32, bytes([4]) * 32)

    def rows(given: tuple[bytes, ...]) -> tuple[RowSpec, ...]:
        return (
            RowSpec.of_tokens(ids + [0, 0], prefix_len=8, target_len=2, block_hashes=given),
            RowSpec.of_tokens(ids + [0, 0, 0], prefix_len=8, target_len=3, block_hashes=given),
        )

    s = initial_state(cfg)
    s = admit(s, RequestSpec("a", rows(cat))).unwrap().state
    s = release(commit(s, "a", [10, 11]).unwrap().state, "a", "finished").unwrap().state
    assert sorted(h for (_, h) in s.cache.keys()) == sorted(cat)  # cached under the caller's hashes
    assert admit(s, RequestSpec("b", rows(dog))).unwrap().effect.cached_tokens == (0, 0)
    hit = admit(s, RequestSpec("c", rows(cat))).unwrap()
    assert hit.effect.cached_tokens == (8, 8) and digest(hit.state) != digest(
        admit(s, RequestSpec("c", rows(()))).unwrap().state
    )
    line = {"op": "admit", "request": "c", "rows": [row_json(r) for r in rows(cat)]}
    assert admit_spec(line) == RequestSpec("c", rows(cat))  # (the trace's row carries them, hex)
    count = RowSpec(9, prefix_len=8, target_len=1, block_hashes=cat[:1])  # no ids: one block keyed
    assert admit(s, RequestSpec("e", (count,))).unwrap().effect.cached_tokens == (4,)
    line = {"op": "admit", "request": "e", "rows": [row_json(count)]}
    assert admit_spec(line) == RequestSpec("e", (count,))
    t = admit(initial_state(cfg), RequestSpec("e", (replace(count, block_hashes=dog),))).unwrap().state
    t = release(commit(t, "e", [9]).unwrap().state, "e", "finished").unwrap().state
    assert sorted(h for (_, h) in t.cache.keys()) == sorted(dog) and check_invariants(t) == []  # (its two blocks)
    for bad in (
        (RowSpec.of_tokens(ids + [0], prefix_len=8, target_len=1, block_hashes=("x",)),),  # type: ignore[arg-type]
        (RowSpec.of_tokens(ids + [0], prefix_len=8, target_len=1, block_hashes=(b"short",)),),  # not sha256's width
    ):
        assert admit(s, RequestSpec("d", bad)).failure().code is ErrorCode.INVALID


def test_the_trace_contract_carries_turn_away(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``turn_away`` is a trace op (an admit line's fields; result ``rows_tried``): it replays, checked, and leaves
    the queue as the core's call does; refused (``INVALID``, nothing changed) for a request that fits."""
    import json

    config = {"block_size": 4, "num_blocks": 9, "enable_prefix_caching": True, "free_queue": "vllm-omni"}
    header = {"pagedkv_trace": 1, "config": config}
    rows = [{"tokens": [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], "prefix_len": 8, "target_len": 4}] * 3
    events = [
        {"op": "admit", "request": "x", "rows": [{"num_tokens": 12}]},
        {"op": "turn_away", "request": "b", "rows": rows, "expect": {"ok": True, "rows_tried": 1}},
        {"op": "turn_away", "request": "c", "rows": rows[:1]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in [header, *events]) + "\n")
    assert main(["replay", "--check", "--json", str(path)]) == 0
    rs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["ok"] for r in rs] == [True, True, False] and rs[2]["error"]["code"] == "INVALID"
    assert rs[1]["generation"] == rs[0]["generation"] and rs[1]["free_blocks"] == rs[0]["free_blocks"] == 5
