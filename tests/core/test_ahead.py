"""Issue 31, the core: rows that run ahead of their tokens. Placeholders (positions whose ids come later),
their ids filling in (``fill``), and a row's unverified tail cut back (``truncate``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.app.cli import main
from pagedkv.core import (
    CacheConfig,
    Placeholders,
    RequestSpec,
    RowSpec,
    admit,
    append,
    cache_ahead,
    commit,
    decode_step,
    digest,
    fill,
    fill_many,
    initial_state,
    request_blocks,
    row_token_ids,
    truncate,
    truncate_many,
)
from pagedkv.core.verify.invariants import check_invariants


def caching(**kw: object) -> CacheConfig:
    return CacheConfig(block_size=4, num_blocks=17, enable_prefix_caching=True, **kw)  # type: ignore[arg-type]


def admitted(cfg: CacheConfig, tokens: list[int], rid: str = "a") -> object:
    s = admit(initial_state(cfg), RequestSpec(rid, (RowSpec.of_tokens(tokens),))).unwrap().state
    return commit(s, rid, [len(tokens)]).unwrap().state


def test_placeholders_are_computed_but_never_hashed_until_their_ids_come() -> None:
    s = admitted(caching(), [1, 2, 3])
    s = append(s, "a", [Placeholders(5)]).unwrap().state  # positions 3..7: ids unknown (async scheduling)
    assert s.row_len[0] == 8 and row_token_ids(s, 0) == (1, 2, 3)
    s = commit(s, "a", [8]).unwrap().state  # their KV is computed (the device knew the ids)
    assert len(s.cache) == 0 and check_invariants(s) == []  # no block hashed over an unknown id
    with pytest.raises(Exception):
        append(s, "a", [[9]]).unwrap()  # ids may not go past the gap
    step = fill(s, "a", [[4, 5]]).unwrap()  # the first block completes: hashed, cached
    assert len(step.state.cache) == 1 and [e.block_id for e in step.effect.events] == list(
        request_blocks(s, "a")[0][0][:1]
    )
    s = fill(step.state, "a", [[6, 7, 8]]).unwrap().state
    assert len(s.cache) == 2 and row_token_ids(s, 0) == (1, 2, 3, 4, 5, 6, 7, 8) and check_invariants(s) == []
    # the same content reached by ids all along has the same cache (the chain hashes match)
    plain = admitted(caching(), [1, 2, 3, 4, 5, 6, 7, 8])
    assert sorted(k for k, _ in plain.cache.items()) == sorted(k for k, _ in s.cache.items())
    # and decoding goes on on the fast path once nothing awaits
    s = decode_step(s, ["a"], [9]).unwrap().state
    assert row_token_ids(s, 0) == (1, 2, 3, 4, 5, 6, 7, 8, 9) and check_invariants(s) == []


def test_one_id_at_a_time_into_positions_not_computed_keeps_the_row_awaiting_the_rest() -> None:
    """The fill loop's common row (one id, the position not computed): a row two placeholders ahead still awaits
    one after the first id, and takes no appended id past the gap until it comes."""
    s = admitted(caching(), [1, 2, 3])
    s = append(s, "a", [Placeholders(2)]).unwrap().state  # planned two steps ahead, nothing computed yet
    s = fill_many(s, [("a", [[4]])]).unwrap().state
    assert row_token_ids(s, 0) == (1, 2, 3, 4) and check_invariants(s) == []
    with pytest.raises(Exception):
        append(s, "a", [[9]]).unwrap()  # position 5 still awaits its id
    s = fill_many(s, [("a", [[5]])]).unwrap().state
    assert row_token_ids(s, 0) == (1, 2, 3, 4, 5) and check_invariants(s) == []
    s = decode_step(commit(s, "a", [5]).unwrap().state, ["a"], [6]).unwrap().state
    assert row_token_ids(s, 0) == (1, 2, 3, 4, 5, 6) and check_invariants(s) == []


def test_an_array_of_ids_grows_and_fills_a_row_as_a_list_does_and_a_wrong_one_is_refused() -> None:
    """Issue 62: ``array("Q")`` ids (checked when they joined the array, so taken with no per-id check) give the
    same state as a list's; an array of another type code is refused as any non-list is, nothing changed."""
    from array import array

    def grown(ids: object) -> object:
        s = admitted(caching(), [1, 2, 3])
        s = append(s, "a", [ids]).unwrap().state
        s = append(s, "a", [Placeholders(3)]).unwrap().state
        s = commit(s, "a", [len(row_token_ids(s, 0)) + 3]).unwrap().state
        return fill(s, "a", [array("Q", [9, 10, 11]) if type(ids) is array else [9, 10, 11]]).unwrap().state

    by_list, by_array = grown([4, 5, 6, 7, 8]), grown(array("Q", [4, 5, 6, 7, 8]))
    assert digest(by_array) == digest(by_list) and row_token_ids(by_array, 0) == tuple(range(1, 12))
    assert check_invariants(by_array) == []
    s = admitted(caching(), [1, 2, 3])
    for bad in (array("q", [4]), array("d", [4.0])):
        got = append(s, "a", [bad])
        assert got.failure().code.value == "INVALID" and digest(s) == digest(admitted(caching(), [1, 2, 3]))


def test_fill_under_the_schedule_caching_point_hashes_only_known_blocks() -> None:
    s = admitted(caching(caching_point="schedule"), [1, 2, 3])
    s = append(s, "a", [Placeholders(5)]).unwrap().state
    s = cache_ahead(s, "a", [8]).unwrap().state  # planned: still nothing hashed over the placeholders
    assert len(s.cache) == 0
    s = fill_many(s, [("a", [[4, 5, 6, 7, 8]])]).unwrap().state
    assert len(s.cache) == 0  # not computed yet, and fill hashes only computed blocks
    s = cache_ahead(s, "a", [8]).unwrap().state
    assert len(s.cache) == 2 and check_invariants(s) == []


def test_truncate_gives_back_the_blocks_of_rejected_drafts_and_a_new_generation() -> None:
    s = admitted(caching(), [1, 2, 3, 4, 5])
    free, gen = s.free_blocks, s.generation
    s = append(s, "a", [[6, 7, 8, 9, 10, 11, 12]]).unwrap().state  # 7 drafts: block 2 opens
    assert s.free_blocks == free - 1
    step = truncate(s, "a", [7]).unwrap()  # 2 accepted: position 6 is the last, block 1 holds it
    assert step.effect.freed_blocks == 1 and step.state.free_blocks == free and step.state.generation > gen
    assert row_token_ids(step.state, 0) == (1, 2, 3, 4, 5, 6, 7) and check_invariants(step.state) == []
    same = truncate(step.state, "a", [7]).unwrap()  # nothing to cut: no generation
    assert same.effect.generation is None and same.state.generation == step.state.generation


def test_truncate_of_placeholders_and_the_refusals_that_change_nothing() -> None:
    s = admitted(caching(caching_point="schedule"), [1, 2, 3])
    s = append(s, "a", [Placeholders(6)]).unwrap().state
    s = truncate(s, "a", [5]).unwrap().state  # a cut inside the gap: still awaiting ids for 3, 4
    assert check_invariants(s) == [] and s.row_len[0] == 5
    s = fill(s, "a", [[4, 5]]).unwrap().state
    s = cache_ahead(s, "a", [5]).unwrap().state  # block 0 cached ahead of the forward
    before = digest(s)
    for bad in (
        lambda: truncate(s, "a", [2]),  # below what is computed
        lambda: truncate(s, "a", [3]),  # into a block cached ahead
        lambda: truncate(s, "a", [6]),  # past the row
        lambda: truncate(s, "a", [4, 4]),  # not one length a row
        lambda: truncate(s, "zz", [4]),
        lambda: fill(s, "a", [[9]]),  # nothing awaits
        lambda: fill(s, "a", [[-1]]),
        lambda: truncate_many(s, [("a", [5]), ("a", [2])]),
    ):  # all or nothing
        assert bad().failure().code.value in ("INVALID", "UNKNOWN_REQUEST")
        assert digest(s) == before


def test_the_trace_contract_carries_placeholders_fill_and_truncate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = {"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "enable_prefix_caching": True}}
    events = [
        {"op": "admit", "request": "a", "rows": [{"tokens": [1, 2, 3]}]},
        {"op": "commit", "request": "a", "computed": [3]},
        {"op": "append", "request": "a", "placeholders": [3]},
        {"op": "commit", "request": "a", "computed": [5]},
        {"op": "fill", "request": "a", "tokens": [[4, 5]]},
        {"op": "truncate", "request": "a", "lengths": [5], "expect": {"ok": True, "blocks": [[[1, 2]]]}},
        {"op": "append", "request": "a", "placeholders": [1], "tokens": [[1]]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in [header, *events]) + "\n")
    assert main(["replay", "--check", "--json", str(path)]) == 0
    rs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["ok"] for r in rs] == [True] * 6 + [False]
    assert rs[2]["blocks"] == [[[1, 2]]] and rs[4]["generation"] == rs[3]["generation"]  # fill: no layout change
    assert rs[5]["generation"] == rs[4]["generation"]  # the cut freed nothing: block 1 still holds position 4
    assert rs[6]["error"]["message"].endswith('exactly one of "tokens", "num_tokens" and "placeholders"')
