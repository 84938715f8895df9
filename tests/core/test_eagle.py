"""Issue 31, the core's side of speculative decoding: rows admitted with slots whose ids come later
(``RowSpec.placeholders``: draft padding, lookahead slots), block hashes that cover the ids after their block
(``CacheConfig.hash_lookahead``: vLLM 0.33's EAGLE lookahead hashes) and the lookup that gives back a hit's last
block (``find_hit(drop_last_block=True)``: vLLM's EAGLE block drop)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.app.cli import main
from pagedkv.core import (
    CacheConfig,
    GroupKind,
    GroupSpec,
    InvalidConfig,
    RequestSpec,
    RowSpec,
    admit,
    append,
    commit,
    decode_step,
    fill,
    initial_state,
    row_token_ids,
    truncate,
)
from pagedkv.core.rules.hashing import hash_block
from pagedkv.core.rules.prefix import find_hit
from pagedkv.core.store.state import row_known
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.core.verify.record import row_json
from pagedkv.core.verify.trace_ops import admit_spec


def cfg(**kw: object) -> CacheConfig:
    return CacheConfig(block_size=4, num_blocks=33, enable_prefix_caching=True, **kw)  # type: ignore[arg-type]


def served(config: CacheConfig, tokens: list[int], rid: str = "a") -> object:
    s = admit(initial_state(config), RequestSpec(rid, (RowSpec.of_tokens(tokens),))).unwrap().state
    return commit(s, rid, [len(tokens)]).unwrap().state


# -- a row admitted with placeholders ------------------------------------------------------------------------------


def test_a_row_admitted_with_placeholders_holds_their_slots_and_their_ids_fill_in() -> None:
    spec = RequestSpec("a", (RowSpec.of_tokens([1, 2, 3, 4, 5], placeholders=4),))  # 5 known, 4 drafts to come
    s = admit(initial_state(cfg()), spec).unwrap().state
    assert s.row_len[0] == 9 and row_known(s, 0) == 5 and len(s.rows[0].blocks[0]) == 3
    assert check_invariants(s) == []
    s = commit(s, "a", [9]).unwrap().state
    assert len(s.cache) == 1  # only the block of known ids
    s = fill(s, "a", [[6, 7, 8]]).unwrap().state
    assert len(s.cache) == 2 and row_known(s, 0) == 8 and check_invariants(s) == []


def test_a_hit_covers_only_known_ids_and_placeholders_travel_in_a_trace() -> None:
    s = served(cfg(), list(range(1, 13)))  # three cached blocks
    spec = RequestSpec("b", (RowSpec.of_tokens(list(range(1, 7)), placeholders=6),))
    assert find_hit(s, spec).num_blocks == 1  # (6 known ids: one whole block below the last known one)
    row = spec.rows[0]
    assert row_json(row) == {"tokens": [1, 2, 3, 4, 5, 6], "placeholders": 6}
    assert admit_spec({"request": "b", "rows": [row_json(row)]}) == spec


@pytest.mark.parametrize(
    "row",
    [
        RowSpec(3, placeholders=1),  # a row of a count has no ids to wait for
        RowSpec(3, (1, 2, 3), placeholders=1),  # tokens must be the ones before the placeholders
        RowSpec(3, (1, 2), placeholders=-1),
        RowSpec(4, (1, 2, 3), prefix_len=1, target_len=2, placeholders=1),  # a diffusion row's ids are known
    ],
)
def test_bad_placeholders_are_refused_and_change_nothing(row: RowSpec) -> None:
    s = initial_state(cfg())
    got = admit(s, RequestSpec("a", (row,)))
    assert got.failure().code.value == "INVALID" and got.failure().field in ("placeholders", "tokens")


# -- hashes over the ids after each block (EAGLE lookahead) --------------------------------------------------------


def test_a_block_is_hashed_with_the_id_after_it_once_that_id_is_known() -> None:
    ahead = cfg(block_hash="sha256", hash_namespace="ns", hash_lookahead=1)
    s = admit(initial_state(ahead), RequestSpec("a", (RowSpec.of_tokens([1, 2, 3, 4]),))).unwrap().state
    s = commit(s, "a", [4]).unwrap().state
    assert len(s.cache) == 0  # block 0 is computed, but the id after it is not known yet
    step = decode_step(s, ["a"], [5]).unwrap()
    assert len(step.state.cache) == 0  # (committed through 4, the 5 appended: known now, hashed at the next commit)
    step = decode_step(step.state, ["a"], [6]).unwrap()
    (stored,) = step.effect.events
    root = initial_state(ahead).cache.root
    assert stored.block_hash == hash_block(root, [1, 2, 3, 4], (None, 5), "sha256")  # vLLM's keys: (E, next id)
    assert stored.lookahead == (5,) and stored.token_ids == (1, 2, 3, 4)
    assert check_invariants(step.state) == []
    # a request that shares the block but not the id after it does not hit it
    s = step.state
    assert find_hit(s, RequestSpec("b", (RowSpec.of_tokens([1, 2, 3, 4, 9, 9]),))).num_blocks == 0
    assert find_hit(s, RequestSpec("c", (RowSpec.of_tokens([1, 2, 3, 4, 5, 9]),))).num_blocks == 1
    assert find_hit(s, RequestSpec("d", (RowSpec.of_tokens([1, 2, 3, 4, 5]),))).num_blocks == 1
    assert find_hit(s, RequestSpec("e", (RowSpec.of_tokens([1, 2, 3, 4]),))).num_blocks == 0  # (a last token kept)


def test_lookahead_hashing_is_the_same_on_every_path() -> None:
    ahead = cfg(hash_lookahead=2)
    by_commit = served(ahead, list(range(1, 15)))
    s = admit(initial_state(ahead), RequestSpec("a", (RowSpec.of_tokens([1]),))).unwrap().state
    for t in range(2, 15):
        s = decode_step(s, ["a"], [t]).unwrap().state
    s = commit(s, "a", [14]).unwrap().state
    assert sorted(k for k, _ in s.cache.items()) == sorted(k for k, _ in by_commit.cache.items())
    assert len(s.cache) == 3  # 14 ids: blocks 0-2 have the two ids after them


def test_a_cut_keeps_the_ids_a_cached_hash_covers() -> None:
    s = served(cfg(hash_lookahead=1, caching_point="schedule"), [1, 2, 3, 4, 5])
    s = append(s, "a", [[6, 7]]).unwrap().state
    assert len(s.cache) == 1
    assert truncate(s, "a", [4]).failure().code.value == "INVALID"  # position 4's id is in block 0's hash
    assert truncate(s, "a", [5]).unwrap().state.row_len[0] == 5


def test_hash_lookahead_is_validated() -> None:
    with pytest.raises(InvalidConfig, match="hash_lookahead"):
        cfg(hash_lookahead=5)
    with pytest.raises(InvalidConfig, match="Mamba"):
        cfg(hash_lookahead=1, groups=(GroupSpec("full"), GroupSpec("m", GroupKind.MAMBA)))


def test_a_trace_header_carries_hash_lookahead(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        {
            "pagedkv_trace": 1,
            "config": {"block_size": 2, "num_blocks": 9, "enable_prefix_caching": True, "hash_lookahead": 1},
        },
        {"op": "admit", "request": "a", "rows": [{"tokens": [1, 2, 3], "placeholders": 1}]},
        {"op": "commit", "request": "a", "computed": [4]},
        {"op": "fill", "request": "a", "tokens": [[4]]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["replay", "--check", str(path)]) == 0


def test_the_model_checker_explores_lookahead_hashes_exhaustively() -> None:
    from dataclasses import replace

    from pagedkv.core.verify.alphabet import CheckConfig
    from pagedkv.core.verify.check import check

    base = CheckConfig(usable_blocks=4, requests=1, max_model_len=6, ahead=True, hash_lookahead=1)
    for c in (base, replace(base, cache_at_schedule=True), replace(base, window=None, max_model_len=5)):
        result = check(c)
        assert result.violation == [] and result.exhaustive and result.states > 500, c


# -- the lookup that gives back a hit's last block (EAGLE block drop) -----------------------------------------------


def test_the_drop_matches_one_block_past_the_limit_and_gives_the_last_back() -> None:
    s = served(cfg(), list(range(1, 17)))  # four cached blocks
    full = RequestSpec("b", (RowSpec.of_tokens(list(range(1, 17)) + [99]),))  # 17 ids: 4 whole blocks
    assert find_hit(s, full).num_blocks == 4
    assert find_hit(s, full, drop_last_block=True).num_blocks == 3
    short = RequestSpec("c", (RowSpec.of_tokens(list(range(1, 15))),))  # 14 ids: 3 whole blocks, hit capped at 13
    assert find_hit(s, short).num_blocks == 3 and find_hit(s, short, drop_last_block=True).num_blocks == 2
    capped = RequestSpec("d", (RowSpec.of_tokens(list(range(1, 17)) + [99]),), max_hit=8)  # a limit of two blocks:
    assert find_hit(s, capped, drop_last_block=True).num_blocks == 2  # the third is matched, then given back


def test_under_the_drop_a_window_holds_the_block_after_the_hit() -> None:
    window = cfg(groups=(GroupSpec("full"), GroupSpec("w", GroupKind.SLIDING_WINDOW, window=4)))
    s = served(window, list(range(1, 17)))
    s = commit(s, "a", [16]).unwrap().state
    spec = RequestSpec("b", (RowSpec.of_tokens(list(range(1, 17)) + [99]),))
    plain, dropped = find_hit(s, spec), find_hit(s, spec, drop_last_block=True)
    assert plain.num_blocks == 4 and dropped.num_blocks == 3
    # the window's blocks are those a query at the hit can see; the peeked block is not taken
    window_ids = dropped.ids[0][1]
    assert len(window_ids) == 3 and window_ids[:2] == (0, 0) and window_ids[2]
    assert check_invariants(admit(s, spec).unwrap().state) == []
