"""Align-mode state groups (vLLM's ``mamba_cache_mode="align"``): the documented worked example
(docs/prefix-and-groups.md), what is refused, and the model checker over them with a planted bug caught.
The step-for-step agreement with vLLM's own MambaManager is tests/integrations/test_vllm_manager.py's."""

from __future__ import annotations

import pytest

from pagedkv.core import (
    CacheConfig,
    ErrorCode,
    GroupKind,
    GroupSpec,
    RequestSpec,
    RowSpec,
    admit,
    append,
    commit,
    initial_state,
    release,
)
from pagedkv.core.config import InvalidConfig
from pagedkv.core.rules.kinds import MambaAlign, SlidingWindow
from pagedkv.core.rules.placeholders import truncate
from pagedkv.core.verify.alphabet import CheckConfig
from pagedkv.core.verify.check import check
from pagedkv.core.verify.invariants import check_invariants

ALIGN = (GroupSpec("full"), GroupSpec("mamba", GroupKind.MAMBA_ALIGN))
TOKENS = list(range(1, 40))


def _lists(state, rid):  # type: ignore[no-untyped-def]
    blocks = state.rows[state.requests[rid].slots[0]].blocks
    return tuple(tuple(g) for g in blocks)


def test_the_documented_example() -> None:
    s = initial_state(CacheConfig(block_size=4, num_blocks=30, groups=ALIGN, enable_prefix_caching=True))
    seen = []
    for op in (
        lambda s: admit(s, RequestSpec("a", (RowSpec.of_tokens(TOKENS[:8]),))),  # a first chunk of 8
        lambda s: commit(s, "a", [8]),
        lambda s: append(s, "a", [TOKENS[8:10]]),  # the rest of a 10-token prompt
        lambda s: commit(s, "a", [10]),
        lambda s: append(s, "a", [TOKENS[10:12]]),  # decode in place up to the block's end
        lambda s: commit(s, "a", [12]),
        lambda s: append(s, "a", [TOKENS[12:13]]),
        lambda s: commit(s, "a", [13]),
    ):
        s = op(s).unwrap().state
        assert check_invariants(s) == []
        seen.append((_lists(s, "a"), s.free_blocks))
    assert seen == [
        (((1, 2), (0, 3)), 26),  # the state after 8 tokens goes to position 1; position 0 is null
        (((1, 2), (0, 3)), 26),
        (((1, 2, 4), (0, 3, 5)), 24),  # one block at the new last position; the forward reads block 3
        (((1, 2, 4), (0, 0, 5)), 25),  # block 3 (the state at 8) let go: cached, free
        (((1, 2, 4), (0, 0, 5)), 25),
        (((1, 2, 4), (0, 0, 5)), 25),  # block 5 now holds the state at 12: cached
        (((1, 2, 4, 6), (0, 0, 5, 7)), 23),
        (((1, 2, 4, 6), (0, 0, 0, 7)), 24),
    ]
    assert {(g, b) for (g, _), b in s.cache.items() if g == 1} == {(1, 3), (1, 5)}  # the states at 8 and 12
    s = release(s, "a", "finished").unwrap().state
    step = admit(s, RequestSpec("b", (RowSpec.of_tokens(TOKENS[:12] + [99, 98]),))).unwrap()
    s = step.state
    assert step.effect.cached_tokens == (12,)
    assert _lists(s, "b") == ((1, 2, 4, 8), (0, 0, 5, 9)) and s.refcount[5] == 1  # the state at 12: shared, not moved
    assert (1, 5) in {(g, b) for (g, _), b in s.cache.items()}  # (it stays cached: a hit reads it)
    s = commit(s, "b", [14]).unwrap().state
    assert _lists(s, "b") == ((1, 2, 4, 8), (0, 0, 0, 9)) and s.free_blocks == 24
    assert check_invariants(s) == []


def test_a_hit_needs_the_state_where_it_ends() -> None:
    """The full group holds 12 tokens; the state group only the state at 8 (the row stopped there and moved
    on): the hit is 8 tokens."""
    s = initial_state(CacheConfig(block_size=4, num_blocks=30, groups=ALIGN, enable_prefix_caching=True))
    s = admit(s, RequestSpec("a", (RowSpec.of_tokens(TOKENS[:8]),))).unwrap().state
    s = commit(s, "a", [8]).unwrap().state
    s = append(s, "a", [TOKENS[8:14]]).unwrap().state  # 6 tokens at once: the state at 12 is never written
    s = commit(s, "a", [14]).unwrap().state
    s = release(s, "a", "finished").unwrap().state
    step = admit(s, RequestSpec("b", (RowSpec.of_tokens(TOKENS[:13]),))).unwrap()
    assert step.effect.cached_tokens == (8,)


def test_what_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="state group"):
        CacheConfig(block_size=4, num_blocks=9, groups=(GroupSpec("mamba", GroupKind.MAMBA_ALIGN), GroupSpec("full")))
    with pytest.raises(InvalidConfig, match="hash_lookahead"):
        CacheConfig(block_size=4, num_blocks=9, groups=ALIGN, enable_prefix_caching=True, hash_lookahead=1)
    s = initial_state(CacheConfig(block_size=4, num_blocks=30, groups=ALIGN, enable_prefix_caching=True))
    diffusion = RequestSpec("d", (RowSpec.of_tokens(TOKENS[:8], prefix_len=4, target_len=4),))
    assert admit(s, diffusion).failure().code is ErrorCode.INVALID
    s = admit(s, RequestSpec("a", (RowSpec.of_tokens(TOKENS[:6]),))).unwrap().state
    assert truncate(s, "a", [5]).failure().code is ErrorCode.INVALID  # (its state is past the cut)


def test_the_checker_explores_align_groups_and_catches_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every interleaving of admissions (with hits on states), growth, commits and releases of two requests:
    the invariants hold. Planted: commit lets go only the blocks just before the new first visible one (the
    windows' scan, which stops at the null block between a hit's state and the row's own)."""
    cfg = CheckConfig(usable_blocks=7, requests=2, window=None, mamba_align=True, long_prompts=True, max_states=6000)
    fixed = check(cfg)
    assert fixed.violation == [] and fixed.states >= 6000
    monkeypatch.setattr(MambaAlign, "let_go", SlidingWindow.let_go)  # (back from the boundary to a null block)
    planted = check(cfg)
    assert planted.violation and "a state no forward reads again" in "\n".join(planted.violation)


def test_a_forward_from_inside_a_block_stops_at_its_end() -> None:
    """The state a block caches is the one at its end, so a growth from inside a block may reach that end but not
    pass it (vLLM's scheduler splits prefill there); refused with the reason, the state unchanged."""
    s = initial_state(CacheConfig(block_size=4, num_blocks=30, groups=ALIGN, enable_prefix_caching=True))
    s = admit(s, RequestSpec("a", (RowSpec.of_tokens(TOKENS[:6]),))).unwrap().state
    refused = append(s, "a", [TOKENS[6:9]])
    assert refused.failure().code is ErrorCode.INVALID and "stops at 8" in refused.failure().message
    s = append(s, "a", [TOKENS[6:8]]).unwrap().state  # to the block's end
    s = append(s, "a", [TOKENS[8:17]]).unwrap().state  # from a boundary: any length
    assert s.row_len[s.requests["a"].slots[0]] == 17
