"""State (Mamba) groups in the core: one state block a row whatever its length, moved (never allocated)
as the row grows, saved in the prefix cache when its row ends on a block boundary, and taken over by a
later request whose hit ends there. The figures here are the ones docs/prefix-and-groups.md gives."""

from __future__ import annotations

import json

import pytest

from pagedkv.core import CacheConfig, GroupKind, GroupSpec, RequestSpec, RowSpec, admit, append, commit, initial_state
from pagedkv.core import release, request_blocks
from pagedkv.core.config import InvalidConfig
from pagedkv.core.errors import ErrorCode
from pagedkv.core.outputs.events import BlockRemoved, BlockStored
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.core.verify.trace import replay

GROUPS = (GroupSpec("full"), GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=4), GroupSpec("mamba", GroupKind.MAMBA))


def cfg(caching: bool = True, blocks: int = 30) -> CacheConfig:
    return CacheConfig(block_size=4, num_blocks=blocks, groups=GROUPS, enable_prefix_caching=caching)


def test_one_state_block_a_row_moved_as_it_grows() -> None:
    s = initial_state(cfg())
    step = admit(s, RequestSpec("a", (RowSpec.of_tokens(list(range(10))),))).unwrap()
    s = step.state
    assert request_blocks(s, "a") == (((1, 2, 3), (4, 5, 6), (0, 0, 7)),)  # 3 + 3 + 1 of 29
    assert s.free_blocks == 22 and check_invariants(s) == []
    s = commit(s, "a", [10]).unwrap().state  # the window lets block 4 go; the state stays where it is
    assert request_blocks(s, "a") == (((1, 2, 3), (0, 5, 6), (0, 0, 7)),) and s.free_blocks == 23
    grown = append(s, "a", [[10, 11, 12]]).unwrap()  # position 12 opens a block: two paged blocks, no state
    s = grown.state
    assert request_blocks(s, "a") == (((1, 2, 3, 8), (0, 5, 6, 9), (0, 0, 0, 7)),) and s.free_blocks == 21
    assert check_invariants(s) == []


def test_a_state_is_saved_on_a_block_boundary_and_taken_over_by_a_hit() -> None:
    s = initial_state(cfg())
    s = admit(s, RequestSpec("a", (RowSpec.of_tokens(list(range(10))),))).unwrap().state
    s = commit(s, "a", [10]).unwrap().state
    s = append(s, "a", [[10, 11, 12]]).unwrap().state
    s = commit(s, "a", [12]).unwrap().state  # 12 tokens computed: the state is the one after block 2
    done = release(s, "a", "finished").unwrap()
    s = done.state
    assert s.cache.key_of(7) is not None and s.free_blocks == 29 and check_invariants(s) == []
    (stored,) = done.effect.events  # the saved state, on the event stream
    assert isinstance(stored, BlockStored) and (stored.group, stored.block_id, stored.token_ids) == (
        2,
        7,
        (8, 9, 10, 11),
    )
    step = admit(s, RequestSpec("b", (RowSpec.of_tokens(list(range(14))),))).unwrap()
    assert step.effect.cached_tokens == (12,)  # full and window blocks hit, and the state saved after block 2
    assert request_blocks(step.state, "b") == (((1, 2, 3, 10), (0, 0, 6, 11), (0, 0, 0, 7)),)
    assert step.state.cache.key_of(7) is None  # out of the cache: it will be rewritten
    assert BlockRemoved(step.effect.events[0].block_hash, 2, 7) in step.effect.events
    assert check_invariants(step.state) == []
    other = admit(step.state, RequestSpec("c", (RowSpec.of_tokens(list(range(14))),))).unwrap()
    assert other.effect.cached_tokens == (0,)  # the state is b's now: c finds none saved, so no hit


def test_a_state_is_not_saved_off_a_boundary_nor_after_an_error() -> None:
    s = initial_state(cfg())
    s = admit(s, RequestSpec("a", (RowSpec.of_tokens(list(range(10))),))).unwrap().state
    s = commit(s, "a", [10]).unwrap().state  # 10 tokens: mid-block
    out = release(s, "a", "finished").unwrap()
    assert out.state.cache.key_of(7) is None
    assert not any(isinstance(e, BlockStored) and e.group == 2 for e in getattr(out.effect, "events", ()))
    s = admit(initial_state(cfg()), RequestSpec("a", (RowSpec.of_tokens(list(range(8))),))).unwrap().state
    s = commit(s, "a", [8]).unwrap().state
    (state_block,) = request_blocks(s, "a")[0][2][-1:]
    assert state_block == 5
    assert release(s, "a", "error").unwrap().state.cache.key_of(5) is None  # a failed step's state: not kept
    assert release(s, "a", "preempted").unwrap().state.cache.key_of(5) is not None  # a preempted one: kept


def test_what_state_groups_refuse() -> None:
    with pytest.raises(InvalidConfig, match="first group must be an attention group"):
        CacheConfig(block_size=4, num_blocks=9, groups=(GroupSpec("mamba", GroupKind.MAMBA),))
    with pytest.raises(InvalidConfig, match="takes no window"):
        GroupSpec("m", GroupKind.MAMBA, window=4)
    s = initial_state(cfg())
    for row in (RowSpec.of_tokens([1, 2, 3, 4], prefix_len=2, target_len=2), RowSpec(4, pending_tokens=2)):
        err = admit(s, RequestSpec("d", (row,))).failure()
        assert err.code is ErrorCode.INVALID and "state (Mamba) groups" in err.message
    fits = admit(initial_state(cfg(blocks=8)), RequestSpec("e", (RowSpec(12),)))  # 3 + 3 + 1 = the 7 usable
    assert fits.unwrap().state.free_blocks == 0
    big = admit(initial_state(cfg(blocks=8)), RequestSpec("e", (RowSpec(13),))).failure()  # 4 + 4 + 1 > 7
    assert big.code is ErrorCode.UNSCHEDULABLE and "needs 9 blocks; the pool has 7 usable" in big.message


def test_a_trace_with_a_state_group_replays() -> None:
    header = {
        "pagedkv_trace": 1,
        "config": {
            "block_size": 4,
            "num_blocks": 30,
            "enable_prefix_caching": True,
            "groups": [
                {"name": "full", "kind": "full"},
                {"name": "swa", "kind": "sliding_window", "window": 4},
                {"name": "mamba", "kind": "mamba"},
            ],
        },
    }
    lines = [
        header,
        {"op": "admit", "request": "a", "rows": [{"tokens": list(range(8))}]},
        {"op": "commit", "request": "a", "computed": [8]},
        {"op": "release", "request": "a", "reason": "finished"},
        {
            "op": "admit",
            "request": "b",
            "rows": [{"tokens": list(range(9))}],
            "expect": {"cached_tokens": [8], "blocks": [[[1, 2, 6], [0, 4, 7], [0, 0, 5]]]},
        },
    ]
    results = list(replay([json.dumps(x) for x in lines], check=True))
    assert [r.result["ok"] for r in results] == [True] * 4
    assert all(r.divergence is None and not r.violations for r in results), [r.divergence for r in results]
