"""vLLM's block-pool policies as options of the core (CacheConfig.free_queue, reset_prefix_cache), off by
default: freed blocks without a hash go to the head of the free queue (reused first, vLLM's prepend_n),
and reset_prefix_cache is refused while any block is held. Pinned on examples, replayed from trace
headers; the model checker and the caching state machine explore both."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from pagedkv.app.cli import main
from pagedkv.core import (
    CacheConfig,
    RequestSpec,
    RowSpec,
    admit,
    commit,
    digest,
    free_queue,
    initial_state,
    release,
    reset_prefix_cache,
)
from pagedkv.core.config import InvalidConfig
from pagedkv.core.errors import ErrorCode
from pagedkv.core.verify.alphabet import CheckConfig
from pagedkv.core.verify.check import check
from pagedkv.core.verify.record import policy_keys
from pagedkv.core.verify.trace import replay


def run(policy: str) -> list[int]:
    """Admit 10 tokens (blocks 1, 2, 3), compute 8 (blocks 1 and 2 hashed), release: the free queue."""
    s = initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True, free_queue=policy))
    s = admit(s, RequestSpec("a", (RowSpec.of_tokens(list(range(10))),))).unwrap().state
    s = commit(s, "a", [8]).unwrap().state
    return free_queue(release(s, "a", "finished").unwrap().state)


def test_freed_blocks_without_a_hash_go_to_the_head_under_vllm() -> None:
    assert run("tail") == [4, 5, 6, 7, 8, 3, 2, 1]  # pagedkv's default: all to the tail, tail first
    assert run("vllm") == [3, 4, 5, 6, 7, 8, 2, 1]  # block 3 (no hash) first, the hashed ones last
    s = initial_state(CacheConfig(block_size=4, num_blocks=9, free_queue="vllm"))  # no caching: all to the head
    s = admit(s, RequestSpec("a", (RowSpec(10),))).unwrap().state
    assert free_queue(release(s, "a", "finished").unwrap().state) == [3, 2, 1, 4, 5, 6, 7, 8]


def test_reset_prefix_cache_when_idle_waits_for_the_blocks() -> None:
    cfg = CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True, reset_prefix_cache="when_idle")
    s = admit(initial_state(cfg), RequestSpec("a", (RowSpec.of_tokens(list(range(8))),))).unwrap().state
    s = commit(s, "a", [8]).unwrap().state
    before = digest(s)
    err = reset_prefix_cache(s).failure()
    assert err.code is ErrorCode.BLOCKS_IN_USE and not err.permanent and "2 are" in err.message
    assert digest(s) == before
    s = release(s, "a", "finished").unwrap().state
    assert reset_prefix_cache(s).unwrap().effect.dropped == 2
    always = (
        admit(
            initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True)),
            RequestSpec("a", (RowSpec.of_tokens(list(range(8))),)),
        )
        .unwrap()
        .state
    )
    assert reset_prefix_cache(always).unwrap().state.requests  # the default: works while requests run


def test_sha256_cbor_hashes_are_vllms() -> None:
    """vLLM's sha256_cbor block hashes (values computed with vLLM 0.33's ``sha256_cbor`` and
    ``hash_block_tokens``, NONE_HASH from the seed "vllm-none-hash"); 32 bytes a hash in the rows and the
    index, and the digest shows them; the trace header carries the key only when it is not the default."""
    cfg = CacheConfig(
        block_size=4,
        num_blocks=9,
        enable_prefix_caching=True,
        block_hash="sha256_cbor",
        hash_namespace="vllm-none-hash",
    )
    s = admit(initial_state(cfg), RequestSpec("a", (RowSpec.of_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9]),))).unwrap().state
    step = commit(s, "a", [9]).unwrap()
    hashes = [ev.block_hash.hex() for ev in step.effect.events]
    assert hashes == [
        "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
        "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1",
    ]
    assert step.effect.events[1].parent_hash == step.effect.events[0].block_hash
    assert [len(key[1]) for key, _ in step.state.cache.items()] == [32, 32]
    b = admit(step.state, RequestSpec("b", (RowSpec.of_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]),))).unwrap()
    assert b.effect.cached_tokens == (8,)  # the chain is found again
    assert policy_keys(cfg) == {"block_hash": "sha256_cbor"} and "block_hash" not in policy_keys(CacheConfig(4, 9))
    with pytest.raises(InvalidConfig, match="block_hash must be one of 'blake2b', 'sha256_cbor', 'sha256'"):
        CacheConfig(block_size=4, num_blocks=9, block_hash="md5")


def test_policies_are_checked_and_come_from_the_trace_header(tmp_path: object) -> None:
    with pytest.raises(InvalidConfig, match="free_queue must be one of 'tail', 'vllm'"):
        CacheConfig(block_size=4, num_blocks=9, free_queue="lifo")
    with pytest.raises(InvalidConfig, match="reset_prefix_cache"):
        CacheConfig(block_size=4, num_blocks=9, reset_prefix_cache=True)  # type: ignore[arg-type]
    header = {
        "pagedkv_trace": 1,
        "config": {
            "block_size": 4,
            "num_blocks": 9,
            "enable_prefix_caching": True,
            "free_queue": "vllm",
            "reset_prefix_cache": "when_idle",
        },
    }
    lines = [
        header,
        {"op": "admit", "request": "a", "rows": [{"tokens": list(range(10))}]},
        {"op": "commit", "request": "a", "computed": [8]},
        {"op": "reset_prefix_cache", "expect": {"ok": False, "error": {"code": "BLOCKS_IN_USE"}}},
        {"op": "release", "request": "a", "reason": "finished"},
        {"op": "admit", "request": "b", "rows": [{"num_tokens": 1}], "expect": {"blocks": [[[3]]]}},
    ]
    results = list(replay([json.dumps(x) for x in lines], check=True))
    assert all(r.divergence is None and not r.violations for r in results), [r.divergence for r in results]
    from pathlib import Path

    bad = Path(str(tmp_path)) / "bad.jsonl"
    bad.write_text(json.dumps({"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "free_queue": 1}}))
    assert main(["replay", str(bad)]) == 2


@pytest.mark.parametrize(
    "cfg",
    [
        CheckConfig(usable_blocks=5, requests=2, free_queue="vllm"),
        CheckConfig(usable_blocks=5, requests=2, reset_when_idle=True),
        CheckConfig(usable_blocks=5, requests=2, duplicates=True),
    ],
)
def test_the_checker_explores_each_policy(cfg: CheckConfig) -> None:
    result = check(cfg)
    assert result.exhaustive and not result.violation
    assert result.states != _default_states()  # another state space, not the default's again


@functools.cache
def _default_states() -> int:
    """The default policies' state count at the size above (explored once a run)."""
    return check(CheckConfig(usable_blocks=5, requests=2)).states


def test_the_schedule_caching_point_caches_planned_blocks_and_a_failed_step_takes_them_back() -> None:
    from pagedkv.core import cache_ahead
    from pagedkv.core.outputs.events import BlockRemoved

    cfg = CacheConfig(block_size=2, num_blocks=20, enable_prefix_caching=True, caching_point="schedule")
    toks = [0, 1, 0, 1, 1, 0, 1, 1]
    s = admit(initial_state(cfg), RequestSpec("A", (RowSpec.of_tokens(toks),))).unwrap().state
    ahead = cache_ahead(s, "A", [8]).unwrap()
    assert len(ahead.state.cache) == 4 and ahead.state.row_computed[0] == 0  # cached, not computed
    same_step = admit(ahead.state, RequestSpec("B", (RowSpec.of_tokens(toks),))).unwrap()
    assert same_step.effect.cached_tokens == (6,)  # a hit in the step that computes them (vLLM's behaviour)
    failed = release(ahead.state, "A", "error").unwrap()  # the step failed: its KV may never have been written
    assert len(failed.state.cache) == 0
    assert [type(e) for e in failed.effect.events] == [BlockRemoved] * 4  # and says so, for the event stream
    after = admit(failed.state, RequestSpec("C", (RowSpec.of_tokens(toks),))).unwrap()
    assert after.effect.cached_tokens == (0,)
    done = commit(ahead.state, "A", [8]).unwrap()  # the step ran: nothing hashed twice, nothing new stored
    assert done.effect.events == () and len(done.state.cache) == 4
    assert cache_ahead(s, "A", [9]).failure().code is ErrorCode.INVALID  # past the row
    plain = (
        admit(
            initial_state(CacheConfig(block_size=2, num_blocks=20, enable_prefix_caching=True)),
            RequestSpec("A", (RowSpec.of_tokens(toks),)),
        )
        .unwrap()
        .state
    )
    assert "caching_point" in cache_ahead(plain, "A", [8]).failure().message  # only under the policy


def test_the_scheduler_under_the_schedule_caching_point_hits_in_the_same_step() -> None:
    from pagedkv.core.scheduler import SchedulerConfig, SeqRequest, new_scheduler, schedule, submit

    prompt = list(range(40))
    for point, hit in (("commit", 0), ("schedule", 32)):
        cfg = CacheConfig(block_size=8, num_blocks=40, enable_prefix_caching=True, caching_point=point)
        st = new_scheduler(cfg, SchedulerConfig(max_num_seqs=4))
        for rid in ("a", "b"):
            st = submit(st, SeqRequest(rid, tuple(prompt), max_tokens=4)).unwrap()
        st, plan = schedule(st).unwrap()
        assert dict(plan.prefill) == {"a": 40, "b": 40 - hit}  # b's prefix rides on a's, in a's own step


def test_cache_ahead_is_a_trace_op_under_its_policy() -> None:
    header = {
        "pagedkv_trace": 1,
        "config": {"block_size": 2, "num_blocks": 20, "enable_prefix_caching": True, "caching_point": "schedule"},
    }
    lines = [
        header,
        {"op": "admit", "request": "A", "rows": [{"tokens": [0, 1, 0, 1, 1]}]},
        {"op": "cache_ahead", "request": "A", "through": [4], "expect": {"ok": True, "blocks": [[[1, 2, 3]]]}},
        {"op": "admit", "request": "B", "rows": [{"tokens": [0, 1, 0, 1, 1]}], "expect": {"cached_tokens": [4]}},
        {"op": "cache_ahead", "request": "A", "through": [9], "expect": {"ok": False, "error": {"code": "INVALID"}}},
        {"op": "release", "request": "A", "reason": "error"},
        {"op": "admit", "request": "C", "rows": [{"tokens": [0, 1, 0, 1, 1]}], "expect": {"cached_tokens": [0]}},
    ]
    results = list(replay([json.dumps(x) for x in lines], check=True))
    assert all(r.divergence is None and not r.violations for r in results), [r.divergence for r in results]
    # (C misses though B still holds the blocks: A's failed step took their entries back; B shared that
    # step, and an engine cancels it too)
    plain = [{**header, "config": {**header["config"], "caching_point": "commit"}}, *lines[1:3]]
    (_, ahead) = list(replay([json.dumps(x) for x in plain]))
    assert ahead.result["error"]["code"] == "INVALID"


def test_max_hit_caps_the_prefix_hit_and_replays() -> None:
    """RequestSpec.max_hit: vLLM's max_cache_hit_length, and 0 for a request that must not read the cache
    (prompt logprobs); the trace's admit carries it."""
    cfg = CacheConfig(block_size=4, num_blocks=17, enable_prefix_caching=True)
    s = admit(initial_state(cfg), RequestSpec("a", (RowSpec.of_tokens(list(range(13))),))).unwrap().state
    s = commit(s, "a", [13]).unwrap().state  # blocks of tokens [0, 12) cached
    row = (RowSpec.of_tokens(list(range(13))),)
    assert admit(s, RequestSpec("b", row)).unwrap().effect.cached_tokens == (12,)
    assert admit(s, RequestSpec("b", row, max_hit=9)).unwrap().effect.cached_tokens == (8,)
    assert admit(s, RequestSpec("b", row, max_hit=0)).unwrap().effect.cached_tokens == (0,)
    assert admit(s, RequestSpec("b", row, max_hit=-1)).failure().field == "max_hit"
    lines = [
        {"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 17, "enable_prefix_caching": True}},
        {"op": "admit", "request": "a", "rows": [{"tokens": list(range(13))}]},
        {"op": "commit", "request": "a", "computed": [13]},
        {
            "op": "admit",
            "request": "b",
            "rows": [{"tokens": list(range(13))}],
            "max_hit": 5,
            "expect": {"cached_tokens": [4]},
        },
    ]
    results = list(replay([json.dumps(x) for x in lines], check=True))
    assert all(r.divergence is None and not r.violations for r in results), [r.divergence for r in results]


def test_cache_duplicates_keeps_every_block_of_a_content_as_vllm() -> None:
    """Two requests admitted before either computed its prompt fill blocks of the same content. One block
    per content (the default): the second's blocks stay uncached. ``cache_duplicates`` (vLLM's block pool):
    both are cached, lookups take the first cached, and once it is evicted the other answers."""
    from pagedkv.core.verify.invariants import check_invariants

    prompt = list(range(9))
    for duplicates in (False, True):
        cfg = CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True, cache_duplicates=duplicates)
        s = initial_state(cfg)
        for rid in ("a", "b"):
            s = admit(s, RequestSpec(rid, (RowSpec.of_tokens(prompt),))).unwrap().state  # a: 1-3, b: 4-6
        s = commit(s, "a", [9]).unwrap().state
        step = commit(s, "b", [9]).unwrap()
        assert len(step.effect.events) == (2 if duplicates else 0)  # b's two full blocks stored, or not
        s = step.state
        assert check_invariants(s) == []
        assert sorted(b for _, b in s.cache.items()) == ([1, 2, 4, 5] if duplicates else [1, 2])
        s = release(release(s, "a", "finished").unwrap().state, "b", "finished").unwrap().state
        hit = admit(s, RequestSpec("c", (RowSpec.of_tokens(prompt),))).unwrap()
        assert hit.effect.blocks[0][0][:2] == (1, 2)  # the first cached answers
        if duplicates:  # free queue 3 2 1 6 5 4: other tokens take 3, 2, 1 (1 and 2 evicted), then 4 and 5 answer
            x = admit(s, RequestSpec("x", (RowSpec.of_tokens(list(range(90, 99))),))).unwrap()
            assert x.effect.blocks == (((3, 2, 1),),) and len(x.effect.events) == 2  # two BlockRemoved
            assert check_invariants(x.state) == [] and sorted(b for _, b in x.state.cache.items()) == [4, 5]
            again = admit(x.state, RequestSpec("c", (RowSpec.of_tokens(prompt),))).unwrap()
            assert again.effect.cached_tokens == (8,) and again.effect.blocks[0][0][:2] == (4, 5)


def test_the_checker_catches_an_eviction_that_leaves_a_duplicate_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug: evicting one block of a content with duplicates leaves it listed under the content
    (lookups could then hand out a block whose KV is being overwritten): the model checker finds it."""
    from pagedkv.core.store.index import PrefixIndexEdit

    real, real_many = PrefixIndexEdit.evict, PrefixIndexEdit.evict_many

    def evict(self: PrefixIndexEdit, block: int) -> object:
        key = self.key_of(block)
        listed = self.blocks_of(key) if key is not None else ()
        gone = real(self, block)
        if gone is not None and len(listed) > 1:  # the bug: a block with duplicates stays among its key's blocks
            assert self.node is not None  # (the edit's key was logged by the eviction: a version stays exact)
            self.node._here().maps[gone[0]][gone[1]] = listed
        return gone

    def evict_many(self: PrefixIndexEdit, blocks: Any, report: bool = True) -> Any:
        listed = {b: self.blocks_of(k) for b in blocks if (k := self.key_of(b)) is not None}
        gone = real_many(self, blocks)  # (listed: the plant reads what went)
        for b, g, h in gone:  # (the same bug in the batch)
            if len(listed[b]) > 1:
                assert self.node is not None
                self.node._here().maps[g][h] = listed[b]
        return gone if report else []

    cfg = CheckConfig(usable_blocks=4, requests=2, window=None, max_model_len=4, duplicates=True)
    monkeypatch.setattr(PrefixIndexEdit, "evict", evict)
    monkeypatch.setattr(PrefixIndexEdit, "evict_many", evict_many)
    result = check(cfg)
    assert result.violation and "does not carry it" in result.violation[0]
    monkeypatch.undo()
    from dataclasses import replace

    assert not check(replace(cfg, max_states=5_000)).violation


def test_cache_ahead_many_is_each_cache_ahead_in_order() -> None:
    from pagedkv.core import cache_ahead, cache_ahead_many

    cfg = CacheConfig(block_size=4, num_blocks=17, enable_prefix_caching=True, caching_point="schedule")
    s = initial_state(cfg)
    for rid, base in (("a", 0), ("b", 100)):
        s = admit(s, RequestSpec(rid, (RowSpec.of_tokens(list(range(base, base + 9))),))).unwrap().state
    one = cache_ahead(cache_ahead(s, "a", [8]).unwrap().state, "b", [4]).unwrap().state
    many = cache_ahead_many(s, [("a", [8]), ("b", [4])]).unwrap()
    assert digest(many.state) == digest(one) and [len(e.events) for e in many.effect] == [2, 1]
    bad = cache_ahead_many(s, [("a", [8]), ("b", [10])])  # past b's row: nothing of it happens
    assert bad.failure().field == "through"
