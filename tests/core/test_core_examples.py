"""Example tests that pin the documented numbers of the core (issue 2, docs/core.md and docs/trace.md)."""

import pickle

import pytest

from pagedkv.core import (
    CacheConfig,
    ErrorCode,
    GroupSpec,
    InvalidConfig,
    Placeholders,
    RequestSpec,
    RowSpec,
    admit,
    append,
    append_decode,
    append_many,
    commit,
    digest,
    free_queue,
    initial_state,
    publish,
    release,
    request_blocks,
    reset,
)


def pool(block_size: int = 4, usable: int = 8, **kw: object) -> object:
    return initial_state(CacheConfig(block_size=block_size, num_blocks=usable + 1, **kw))  # type: ignore[arg-type]


CFG_ROWS = (RowSpec(8, prefix_len=4, target_len=4),) * 2


def test_cfg_request_takes_four_blocks_and_release_gives_them_back() -> None:
    s0 = pool()
    step = admit(s0, RequestSpec("img", CFG_ROWS)).unwrap()
    assert step.effect.generation == 1
    assert step.effect.blocks == (((1, 2),), ((3, 4),))
    assert step.state.free_blocks == 4
    back = release(step.state, "img", "finished").unwrap()
    assert back.effect.freed_blocks == 4
    assert back.state.free_blocks == 8
    # tail first: position 1 of both rows, then position 0
    assert free_queue(back.state) == [5, 6, 7, 8, 2, 4, 1, 3]
    assert s0.free_blocks == 8 and step.state.free_blocks == 4  # old snapshots unchanged


def test_unschedulable_changes_nothing() -> None:
    s = admit(pool(), RequestSpec("a", (RowSpec(8),))).unwrap().state
    before = digest(s)
    err = admit(s, RequestSpec("big", (RowSpec(20, prefix_len=10, target_len=10),) * 2)).failure()
    assert err.code is ErrorCode.UNSCHEDULABLE and err.permanent
    assert (err.requested, err.available) == (10, 8)
    assert digest(s) == before


def test_no_capacity_when_it_would_fit_later() -> None:
    s = admit(pool(), RequestSpec("a", (RowSpec(24),))).unwrap().state  # 6 of 8 blocks
    err = admit(s, RequestSpec("b", (RowSpec(12),))).failure()
    assert err.code is ErrorCode.NO_CAPACITY and not err.permanent
    assert (err.requested, err.available) == (3, 2)
    s = release(s, "a", "finished").unwrap().state
    assert admit(s, RequestSpec("b", (RowSpec(12),))).unwrap().state.free_blocks == 5


def test_readmitting_a_released_id_gets_a_larger_generation() -> None:
    s = pool()
    first = admit(s, RequestSpec("a", (RowSpec(4),))).unwrap()
    s = release(first.state, "a", "cancelled").unwrap().state
    again = admit(s, RequestSpec("a", (RowSpec(4),))).unwrap()
    assert first.effect.generation == 1 and again.effect.generation == 3


def test_publish_slots_of_a_row_with_block_table_3_1() -> None:
    s = initial_state(CacheConfig(block_size=16, num_blocks=4))
    s = admit(s, RequestSpec("a", (RowSpec(16),))).unwrap().state  # block 1
    s = admit(s, RequestSpec("b", (RowSpec(16),))).unwrap().state  # block 2
    s = release(s, "a", "finished").unwrap().state  # free queue: 3, 1
    s = admit(s, RequestSpec("c", (RowSpec(19),))).unwrap().state
    assert request_blocks(s, "c") == (((3, 1),),)
    s = commit(s, "c", [17]).unwrap().state
    row = publish(s, ["c"], "prefill").unwrap().effect.rows[0]
    assert (row.kv_start_pos, row.query_len, row.seq_len) == (17, 2, 19)
    assert row.slots == (17, 18)


def test_duplicate_and_unknown_requests() -> None:
    s = admit(pool(), RequestSpec("a", (RowSpec(4),))).unwrap().state
    assert admit(s, RequestSpec("a", (RowSpec(4),))).failure().code is ErrorCode.DUPLICATE_REQUEST
    assert append(s, "zz", [1]).failure().code is ErrorCode.UNKNOWN_REQUEST
    assert commit(s, "zz", [1]).failure().code is ErrorCode.UNKNOWN_REQUEST
    assert release(s, "zz", "error").failure().code is ErrorCode.UNKNOWN_REQUEST
    assert publish(s, ["zz"], "decode").failure().code is ErrorCode.UNKNOWN_REQUEST


def test_limits_are_unschedulable() -> None:
    s = pool(max_rows_per_request=2, max_model_len=10)
    assert admit(s, RequestSpec("a", (RowSpec(1),) * 3)).failure().code is ErrorCode.UNSCHEDULABLE
    assert admit(s, RequestSpec("a", (RowSpec(11),))).failure().code is ErrorCode.UNSCHEDULABLE
    s = admit(s, RequestSpec("a", (RowSpec(10),))).unwrap().state
    err = append(s, "a", [1]).failure()  # an append that passes max_model_len is INVALID
    assert err.code is ErrorCode.INVALID and "max_model_len" in err.message


@pytest.mark.parametrize(
    "rows, needle",
    [
        ((), "at least one row"),
        ((RowSpec(0),), "positive"),
        ((RowSpec(-3),), "positive"),
        ((RowSpec(True),), "positive"),  # type: ignore[arg-type]
        ((RowSpec(8, prefix_len=4),), "together"),
        ((RowSpec(8, prefix_len=5, target_len=4),), "exceeds seq_len"),
        ((RowSpec(8, prefix_len=-1, target_len=4),), "prefix_len"),
        ((RowSpec(8, prefix_len=4, target_len=0),), "target_len"),
        ((RowSpec(8, spans=((4, 6), (2, 3))),), "unsorted"),
        ((RowSpec(8, spans=((2, 5), (4, 6))),), "overlaps"),
        ((RowSpec(8, spans=((6, 9),)),), "outside"),
        ((RowSpec(8, spans=((3, 3),)),), "empty"),
        ((RowSpec(3, tokens=(1, 2)),), "tokens"),
        ((RowSpec(2, tokens=(1, -2)),), "non-negative"),
    ],
)
def test_malformed_specs_are_invalid_and_change_nothing(rows: tuple[RowSpec, ...], needle: str) -> None:
    s = admit(pool(), RequestSpec("x", (RowSpec(5),))).unwrap().state
    before = digest(s)
    err = admit(s, RequestSpec("new", rows)).failure()
    assert err.code is ErrorCode.INVALID and needle in err.message
    assert digest(s) == before


def test_append_allocates_only_when_a_block_fills() -> None:
    s = admit(pool(), RequestSpec("a", (RowSpec(3), RowSpec(4)))).unwrap().state
    step = append(s, "a", [1, 0]).unwrap()  # row 0 reaches 4: still one block
    assert step.effect.allocations == () and step.state.generation == 1
    step = append(step.state, "a", [[7, 8], 1]).unwrap()  # both rows cross into a second block
    assert step.effect.allocations == (("a", 2),)
    assert request_blocks(step.state, "a") == (((1, 3),), ((2, 4),))


def test_append_refusals() -> None:
    s = admit(pool(), RequestSpec("d", (RowSpec(8, prefix_len=4, target_len=4),))).unwrap().state
    s = admit(s, RequestSpec("a", (RowSpec(4),))).unwrap().state
    assert "diffusion" in append(s, "d", [1]).failure().message
    assert append(s, "a", [1, 1]).failure().code is ErrorCode.INVALID
    assert append(s, "a", [-1]).failure().code is ErrorCode.INVALID
    assert append(s, "a", ["x"]).failure().code is ErrorCode.INVALID  # type: ignore[list-item]
    err = append(s, "a", [100]).failure()
    assert err.code is ErrorCode.NO_CAPACITY and (err.requested, err.available) == (25, 5)


def test_batched_appends_are_all_or_nothing() -> None:
    s = admit(pool(), RequestSpec("a", (RowSpec(4),))).unwrap().state
    s = admit(s, RequestSpec("b", (RowSpec(4),))).unwrap().state
    before = digest(s)
    assert append_many(s, [("a", [1]), ("nope", [1])]).failure().code is ErrorCode.UNKNOWN_REQUEST
    assert digest(s) == before
    step = append_decode(s, ["a", "b"]).unwrap()
    assert step.effect.allocations == (("a", 3), ("b", 4))
    assert step.state == append_many(s, [("a", [1]), ("b", [1])]).unwrap().state


def test_a_batch_of_growths_that_open_blocks_pops_as_one_after_another() -> None:
    """Rows opening blocks in one ``append_many`` (one token, several, placeholders, a count; one named twice) take
    the blocks and generations that appends one after another give them; past the pool, the first that does not fit
    is refused with what was left for it."""
    s = pool(usable=24, enable_prefix_caching=True)
    for rid, n in (("a", 4), ("b", 3), ("c", 8), ("d", 1)):
        s = admit(s, RequestSpec(rid, (RowSpec.of_tokens(list(range(1, n + 1))),))).unwrap().state
    items = [("a", [[9]]), ("b", [[1, 2, 3, 4, 5, 6]]), ("c", [Placeholders(9)]), ("a", [[7] * 5]), ("d", [2])]
    one_by_one = s
    for rid, rows in items:
        one_by_one = append(one_by_one, rid, rows).unwrap().state
    step = append_many(s, items).unwrap()
    assert digest(step.state) == digest(one_by_one)  # (a popped block's stale back link is no part of the state)
    assert free_queue(step.state) == free_queue(one_by_one)
    assert [request_blocks(step.state, r) for r in "abcd"] == [request_blocks(one_by_one, r) for r in "abcd"]
    assert [g for _, g in step.effect.allocations] == sorted(g for _, g in step.effect.allocations)
    full = append_many(s, [("a", [[9] * 8]), ("b", [[1] * 70]), ("c", [1])]).failure()  # (5 blocks held, a takes 2)
    assert full.code is ErrorCode.NO_CAPACITY and full.request == "b"
    assert (full.requested, full.available) == (18, 24 - 5 - 2)


def test_commit_is_absolute_and_never_decreases() -> None:
    s = admit(pool(), RequestSpec("a", (RowSpec(6),))).unwrap().state
    s = commit(s, "a", [4]).unwrap().state
    assert commit(s, "a", [3]).failure().code is ErrorCode.INVALID
    assert commit(s, "a", [7]).failure().code is ErrorCode.INVALID
    assert digest(commit(s, "a", [4]).unwrap().state) == digest(s)
    assert publish(commit(s, "a", [6]).unwrap().state, ["a"], "prefill").failure().code is ErrorCode.INVALID


def test_release_reasons() -> None:
    s = admit(pool(), RequestSpec("a", (RowSpec(4),))).unwrap().state
    for reason in ("finished", "cancelled", "error", "preempted"):
        assert release(s, "a", reason).unwrap().effect.reason.value == reason
    assert release(s, "a", "bored").failure().code is ErrorCode.INVALID


def test_reset_starts_a_new_epoch_and_keeps_generations_growing() -> None:
    s = admit(pool(), RequestSpec("a", (RowSpec(4),))).unwrap().state
    step = reset(s).unwrap()
    assert step.effect.released == ("a",)
    assert (step.state.epoch, step.state.generation, step.state.free_blocks) == (1, 1, 8)
    assert admit(step.state, RequestSpec("a", (RowSpec(4),))).unwrap().effect.generation == 2


def test_phases_and_segments() -> None:
    s = admit(pool(), RequestSpec("d", (RowSpec(8, prefix_len=4, target_len=3, spans=((4, 7),)),))).unwrap().state
    pre = publish(s, ["d"], "prefill").unwrap().effect.rows[0]
    assert [(g.causal, g.q_start, g.q_end, g.kv_end) for g in pre.segments] == [
        (True, 0, 4, 4),
        (False, 4, 7, 7),
        (True, 7, 8, 8),
    ]
    den = publish(s, ["d"], "denoise").unwrap().effect.rows[0]
    assert (den.seq_len, den.query_len, den.kv_start_pos) == (7, 3, 4)
    assert [(g.causal, g.q_start, g.q_end, g.kv_end) for g in den.segments] == [(False, 4, 7, 7)]
    assert publish(s, ["d"], "decode").failure().code is ErrorCode.INVALID
    assert publish(s, ["d", "d"], "denoise").failure().code is ErrorCode.INVALID
    assert publish(s, [], "denoise").failure().code is ErrorCode.INVALID
    assert publish(s, ["d"], "warp").failure().code is ErrorCode.INVALID
    meta = publish(s, ["d"], "denoise").unwrap().effect
    assert pickle.loads(pickle.dumps(meta)) == meta


def test_bad_configs_raise_a_typed_error() -> None:
    for kw in (
        {"block_size": 0, "num_blocks": 4},
        {"block_size": 4, "num_blocks": 1},
        {"block_size": 4, "num_blocks": 4, "groups": ()},
        {"block_size": 4, "num_blocks": 4, "max_model_len": 0},
    ):
        with pytest.raises(InvalidConfig):
            CacheConfig(**kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig):
        GroupSpec("w", "sliding_window")  # type: ignore[arg-type]


def test_check_invariants_reports_broken_states() -> None:
    from dataclasses import replace

    from pagedkv.core.verify.invariants import check_invariants

    s = admit(pool(), RequestSpec("a", (RowSpec(8),))).unwrap().state
    assert check_invariants(s) == []
    leaked = replace(s, refcount=s.refcount.set(1, 2))
    assert "block 1: refcount 2, 1 references held" in check_invariants(leaked)
    cycle = replace(s, free_next=s.free_next.set(8, 3))
    assert "the free queue has a cycle" in check_invariants(cycle)
    lost = replace(s, free_blocks=s.free_blocks - 1)
    assert any("free_blocks" in m for m in check_invariants(lost))


def test_a_row_of_an_array_of_ids_is_the_row_of_their_tuple() -> None:
    """``RowSpec.of_tokens(array("Q", ids))`` keeps the array (no per-id check, packed at C speed: what a long prompt
    costs at each admission otherwise): admitted and decoded, the state is the one the tuple of the same ids gives;
    an array of the wrong length or of another type code is refused."""
    from array import array

    from pagedkv.core import decode_step, digest
    from pagedkv.core.errors import ErrorCode

    s = initial_state(CacheConfig(block_size=4, num_blocks=32, enable_prefix_caching=True))
    ids = [(7 * i) % 50 + 1 for i in range(37)]
    states = []
    for tokens in (array("Q", ids), ids):
        row = RowSpec.of_tokens(tokens)
        assert type(row.tokens) is (array if tokens is not ids else tuple)
        t = admit(s, RequestSpec("a", (row,))).unwrap().state
        states.append(decode_step(decode_step(t, ["a"], [3]).unwrap().state, ["a"], [4]).unwrap().state)
    assert digest(states[0]) == digest(states[1])
    assert admit(states[0], RequestSpec("b", (RowSpec.of_tokens(array("Q", ids)),))).unwrap().effect.cached_tokens == (
        36,
    )
    for bad in (RowSpec(5, array("Q", [1, 2])), RowSpec(2, array("q", [1, 2]))):  # type: ignore[arg-type]
        assert admit(s, RequestSpec("c", (bad,))).failure().code is ErrorCode.INVALID


def test_a_long_rows_ids_are_kept_in_chunks_and_read_across_them() -> None:
    """A row's ids live in chunks of 1,024 (``store.tails.Ids``: a block moving past copies the last chunk, never
    the row's history). A 1,100-token prompt (its ids in two chunks) decoding past position 1,104 keeps every id,
    hashes the blocks on either side of the chunks' seam (one span read across it) as a fresh prompt of the same
    ids does (a second request hits all 69 blocks), its events carry each block's ids, and the invariants hold
    (whole chunks, the last one short and not empty)."""
    from pagedkv.core import decode_step
    from pagedkv.core.store.state import row_token_ids
    from pagedkv.core.store.tails import CHUNK
    from pagedkv.core.verify.invariants import check_invariants

    prompt = [(7 * k) % 5000 + 1 for k in range(1100)]
    s = initial_state(CacheConfig(block_size=16, num_blocks=200, enable_prefix_caching=True, kv_events=True))
    s = admit(s, RequestSpec("a", (RowSpec.of_tokens(prompt),))).unwrap().state
    decoded, stored = [], []
    for k in range(6):
        step = decode_step(s, ["a"], [9000 + k]).unwrap()
        s = step.state
        decoded.append(9000 + k)
        stored += [ev for ev in step.effect.events if type(ev).__name__ == "BlockStored"]
        assert check_invariants(s) == [], k
    slot = s.requests["a"].slots[0]
    ids = prompt + decoded
    assert row_token_ids(s, slot) == tuple(ids)
    assert [len(c) for c in s.rows[slot].ids] == [CHUNK, (1104 - 1024) * 8]  # (the open block's ids in the tail)
    assert [tuple(ev.token_ids) for ev in stored] == [tuple(ids[j * 16 : (j + 1) * 16]) for j in range(69)]
    hit = admit(s, RequestSpec("b", (RowSpec.of_tokens(ids[:1105]),))).unwrap()
    assert hit.effect.cached_tokens == (1104,)
