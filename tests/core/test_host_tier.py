"""The prefix cache's host tier (issue 51, core/store/host.py): what the core decides, pinned with exact numbers, and
the model checker over it (a planted bug in a load's ordering caught)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.app.cli import main
from pagedkv.core import CacheConfig, GroupKind, GroupSpec, RequestSpec, RowSpec, admit, commit, digest, initial_state
from pagedkv.core import release, reset_prefix_cache
from pagedkv.core.config import InvalidConfig
from pagedkv.core.outputs.events import BlockOffloaded, BlockOnloaded, BlockRemoved, BlockStored, HostBlockRemoved
from pagedkv.core.store.host import HostEdit
from pagedkv.core.store.state import KVState
from pagedkv.core.verify.alphabet import CheckConfig
from pagedkv.core.verify.check import check
from pagedkv.core.verify.invariants import check_invariants, copy_violations

A, B, C = list(range(1, 14)), list(range(100, 113)), list(range(200, 213))  # 13 tokens: 3 full blocks of 4


def served(s: KVState, rid: str, toks: list[int]) -> tuple[KVState, object]:
    """``toks`` admitted, computed, finished; the admission's effect."""
    step = admit(s, RequestSpec(rid, (RowSpec.of_tokens(toks),))).unwrap()
    assert copy_violations(s, step.effect, step.state) == [] and check_invariants(step.state) == []
    s = release(commit(step.state, rid, [len(toks)]).unwrap().state, rid, "finished").unwrap().state
    assert check_invariants(s) == []
    return s, step.effect


def test_an_evicted_block_is_kept_in_the_tier_and_a_hit_there_loads_it_back() -> None:
    """A pool of 6 blocks: b's admission evicts a's third cached block, which goes to host slot 0 (stored before it
    is overwritten); c, a's prompt again, hits two blocks on the device and the third in the tier: a fresh block,
    loaded from slot 0 (after the store its own pops needed), and 12 tokens count as computed."""
    s = initial_state(CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True, host_blocks=4))
    s, _ = served(s, "a", A)
    s, b = served(s, "b", B)
    assert [type(e) for e in b.events] == [BlockOffloaded, BlockRemoved] and b.events[0][2:] == (3, 0)
    assert len(s.host) == 1
    s, c = served(s, "c", A)
    assert c.cached_tokens == (12,) and c.blocks == (((1, 2, 3, 4),),)
    assert [type(e) for e in c.events] == [BlockOffloaded, BlockRemoved, BlockOnloaded]
    assert c.events[0][2:] == (4, 1) and c.events[2][2:] == (0, 3)  # block 4 saved to slot 1; slot 0 into block 3
    assert len(s.host) == 2


def test_a_full_tier_drops_its_least_recently_used_entry_but_never_one_it_loads() -> None:
    """One host block: each eviction drops the entry before (``HostBlockRemoved``); a transition that loads the
    entry and evicts another block keeps the entry (pinned) and does not keep the evicted one."""
    s = initial_state(CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True, host_blocks=1))
    s, _ = served(s, "a", A)
    s, _ = served(s, "b", B)  # a's third block in the tier
    s, c = served(s, "c", C)  # its pops evict three cached blocks: each stored in the one slot, the one before dropped
    assert [type(e) for e in c.events if type(e) is not BlockRemoved] == [HostBlockRemoved, BlockOffloaded] * 3
    s, d = served(s, "d", B)  # loads b's block from the tier; the block its pops evict is not kept
    assert [type(e) for e in d.events if type(e) is not BlockRemoved] == [BlockOnloaded]
    assert d.cached_tokens == (12,)


def test_reset_prefix_cache_empties_the_tier_and_the_digest_names_it() -> None:
    s = initial_state(CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True, host_blocks=4))
    s, _ = served(s, "a", A)
    before = digest(s)
    s, _ = served(s, "b", B)
    assert len(s.host) == 1 and digest(s) != before
    assert len(reset_prefix_cache(s).unwrap().state.host) == 0
    plain = initial_state(CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True))
    assert digest(plain) != digest(initial_state(CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True,
                                                             host_blocks=4)))  # fmt: skip


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"host_blocks": 4}, "needs prefix caching"),
        ({"host_blocks": -1, "enable_prefix_caching": True}, "host_blocks must be"),
    ],
)
def test_a_tier_the_core_cannot_keep_is_refused(kw: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidConfig, match=says):
        CacheConfig(block_size=4, num_blocks=7, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("threshold, hit", [(0, 12), (2, 8)])
def test_the_trace_header_carries_the_tier_and_replay_checks_its_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], threshold: int, hit: int
) -> None:
    """The tier in the header (``host_store_threshold`` too, written only when not the default) and replayed: c's
    third block loaded from the tier, or (kept only at two uses) computed again."""
    from pagedkv.core.verify.record import policy_keys

    cfg = CacheConfig(
        block_size=4, num_blocks=7, enable_prefix_caching=True, host_blocks=4, host_store_threshold=threshold
    )
    config = {"block_size": 4, "num_blocks": 7, "enable_prefix_caching": True, **policy_keys(cfg)}
    assert config.get("host_store_threshold") == (threshold or None) and "host_tracker_size" not in config
    events = []
    for rid, toks in (("a", A), ("b", B), ("c", A)):
        events += [
            {"op": "admit", "request": rid, "rows": [{"tokens": toks}]},
            {"op": "commit", "request": rid, "computed": [13]},
            {"op": "release", "request": rid, "reason": "finished"},
        ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in [{"pagedkv_trace": 1, "config": config}, *events]) + "\n")
    assert main(["replay", "--check", "--json", str(path)]) == 0
    rs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rs[6]["cached_tokens"] == [hit]


@pytest.mark.slow
def test_the_model_checker_covers_the_tier() -> None:
    """One host block, two request ids, three usable blocks, prompts of up to 4 tokens: exhaustive (30,266 states;
    the planted bug below is found in it too), every transition's copies checked in order (``copy_violations``), no
    violation."""
    result = check(CheckConfig(window=None, host_blocks=1, requests=2, usable_blocks=3, max_model_len=4))
    assert result.violation == [] and result.exhaustive and result.states > 30_000


@pytest.mark.parametrize("window, usable, longest", [(None, 3, 6), (2, 4, 6)])
def test_a_load_whose_slot_a_store_reuses_is_caught(
    monkeypatch: pytest.MonkeyPatch, window: int | None, usable: int, longest: int
) -> None:
    """The planted bug: a hit's entry not pinned, so the pops of the same admission may drop it and store another
    block in its slot before the load reads it. The checker finds it, with a trace (with a window group beside the
    full one too)."""
    real = HostEdit.touch

    def unpinned(self: HostEdit, key: object) -> int:
        slot = real(self, key)  # type: ignore[arg-type]
        self.pinned.discard(key)  # type: ignore[arg-type]
        return slot

    monkeypatch.setattr(HostEdit, "touch", unpinned)
    result = check(CheckConfig(window=window, host_blocks=1, requests=2, usable_blocks=usable, max_model_len=longest))
    assert any("a load of slot 0" in v for v in result.violation) and result.trace


def test_forget_host_drops_the_entries_of_slots_never_written_and_their_slots_go_first() -> None:
    """A store the shell could not carry out: ``forget_host`` drops the entry in that slot (``HostBlockRemoved``),
    a hit no longer reaches it, and the next block the tier keeps takes that slot; slots outside the tier are
    refused with nothing changed; the trace op replays it."""
    from pagedkv.core import forget_host
    from pagedkv.core.verify.trace import replay

    s = initial_state(CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True, host_blocks=2))
    s, _ = served(s, "a", A)
    s, _ = served(s, "b", B)  # a's third block in slot 0
    assert [slot for slot, _ in s.host.entries.values()] == [0]
    before = digest(s)
    bad = forget_host(s, [2])
    assert bad.failure().field == "slots" and digest(s) == before  # type: ignore[union-attr]
    step = forget_host(s, [0, 1]).unwrap()
    assert step.effect.forgotten == 1 and [type(e) for e in step.effect.events] == [HostBlockRemoved]
    s = step.state
    assert len(s.host) == 0 and s.host.spare == (0,) and check_invariants(s) == []
    s, c = served(s, "c", A)  # a's prompt again: two blocks hit on the device, the third not in the tier any more
    assert c.cached_tokens == (8,) and not any(isinstance(e, BlockOnloaded) for e in c.events)
    stores = [e for e in c.events if isinstance(e, BlockOffloaded)]
    assert stores and stores[0].host_slot == 0 and s.host.spare == ()  # (the spare slot taken first)
    header = {
        "pagedkv_trace": 1,
        "config": {"block_size": 4, "num_blocks": 7, "enable_prefix_caching": True, "host_blocks": 2},
    }
    lines = [json.dumps(header), json.dumps({"op": "forget_host", "slots": [0], "expect": {"ok": True, "forgotten": 0}}),
             json.dumps({"op": "forget_host", "slots": "0", "expect": {"ok": False}})]  # fmt: skip
    assert [ev.divergence for ev in replay(lines)] == [None, None]


def test_a_window_groups_visible_block_comes_back_from_the_tier() -> None:
    """A sliding-window group (a window of 4 tokens: one block) beside the full one, a pool of 10 usable blocks. b's
    admission evicts a's blocks to the tier, the window group's last two among them; c, a's prompt again, hits 12
    tokens: the full group's first two blocks on the device, its third loaded from slot 2 into block 8; the window
    group sees only the block at the boundary (the null block before it), loaded from slot 3 into block 5. Without
    the tier the window group's block is gone and c hits nothing."""
    groups = (GroupSpec("full"), GroupSpec("w", GroupKind.SLIDING_WINDOW, window=4))
    s = initial_state(
        CacheConfig(block_size=4, num_blocks=11, groups=groups, enable_prefix_caching=True, host_blocks=4)
    )
    s, _ = served(s, "a", A)
    s, b = served(s, "b", B)
    stores = [(e.group, e.block_id, e.host_slot) for e in b.events if isinstance(e, BlockOffloaded)]
    assert stores == [(1, 6, 0), (1, 5, 1), (0, 3, 2), (1, 7, 3)]
    s, c = served(s, "c", A)
    assert c.cached_tokens == (12,) and c.blocks == (((1, 2, 8, 4), (0, 0, 5, 7)),)
    loads = [(e.group, e.host_slot, e.block_id) for e in c.events if isinstance(e, BlockOnloaded)]
    assert loads == [(0, 2, 8), (1, 3, 5)]
    plain = initial_state(CacheConfig(block_size=4, num_blocks=11, groups=groups, enable_prefix_caching=True))
    plain, _ = served(plain, "a", A)
    plain, _ = served(plain, "b", B)
    assert served(plain, "c", A)[1].cached_tokens == (0,)  # type: ignore[attr-defined]


def test_the_model_checker_covers_the_tier_beside_a_window_group() -> None:
    """A sliding-window group beside the full one, one host block, four usable blocks, prompts of up to 6 tokens:
    exhaustive (1,878 states, 60 loads into window blocks; with five usable blocks 27,728 states, 914 of them),
    every transition's copies checked in order, no violation; the planted bug above is found in it too."""
    result = check(CheckConfig(window=2, host_blocks=1, requests=2, usable_blocks=4, max_model_len=6))
    assert result.violation == [] and result.exhaustive and result.states > 1_800


@pytest.mark.parametrize(
    "kind, blocks",
    [(GroupKind.MAMBA, ((1, 2, 3, 4), (0, 0, 0, 7))), (GroupKind.MAMBA_ALIGN, ((1, 2, 3, 4), (0, 0, 7, 6)))],
)
def test_a_saved_state_comes_back_from_the_tier(kind: GroupKind, blocks: tuple[tuple[int, ...], ...]) -> None:
    """A state group beside the full one, 7 usable blocks. a computes 12 tokens: its state there is saved (block 4).
    b's 16 tokens evict a's last key block (3, to slot 0) and the state (4, to slot 1); c, a's prompt again, hits 12
    tokens: its third key block loaded into block 3, the state into a fresh block 7 where the row keeps its state (a
    state per row: its last position; align mode: the hit's boundary, a fresh block after it for the state the
    forward writes). Without the tier c hits nothing."""
    groups = (GroupSpec("full"), GroupSpec("m", kind))
    for host in (4, 0):
        s = initial_state(
            CacheConfig(block_size=4, num_blocks=8, groups=groups, enable_prefix_caching=True, host_blocks=host)
        )
        s, _ = served(s, "a", A[:12])
        s, b = served(s, "b", list(range(100, 116)))
        stores = [(e.group, e.block_id, e.host_slot) for e in b.events if isinstance(e, BlockOffloaded)]
        s, c = served(s, "c", A)
        loads = [(e.group, e.host_slot, e.block_id) for e in c.events if isinstance(e, BlockOnloaded)]
        if host:
            assert stores == [(0, 3, 0), (1, 4, 1)] and loads == [(0, 0, 3), (1, 1, 7)]
            assert c.cached_tokens == (12,) and c.blocks == (blocks,)  # type: ignore[attr-defined]
        else:
            assert c.cached_tokens == (0,)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind, longest", [("mamba", 4), ("mamba_align", 6)])
def test_the_model_checker_covers_the_tier_beside_a_state_group(kind: str, longest: int) -> None:
    """A state group beside the full one, one host block, four usable blocks: exhaustive (a state per row, prompts of
    up to 4 tokens: 6,883 states, 184 states loaded; align mode, up to 6 tokens: 5,357 and 64), every load's block
    checked to be its row's alone in the load's group (a load into the wrong position of a state group's list is
    caught: a planted one, below, is found)."""
    cfg = CheckConfig(window=None, host_blocks=1, requests=2, usable_blocks=4, max_model_len=longest, **{kind: True})
    result = check(cfg)
    assert result.violation == [] and result.exhaustive and result.states > 5_000


def test_a_state_loaded_into_the_wrong_position_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a state per row loaded where a key group's block would be (the hit's last position, the null block
    in its list) instead of its last position. The checker finds it."""
    from pagedkv.core.rules.kinds import KindRules, MambaState

    monkeypatch.setattr(MambaState, "loaded_into", KindRules.loaded_into)
    result = check(CheckConfig(window=None, host_blocks=1, requests=2, usable_blocks=3, max_model_len=6, mamba=True))
    assert result.violation and "no row holds it alone" in result.violation[0]


def test_under_a_store_threshold_the_tier_keeps_only_contents_seen_twice() -> None:
    """``host_store_threshold=2`` (vLLM's offloading store_threshold): b's admission evicts a's third block, a
    content one row computed once: not kept (no ``BlockOffloaded``, its ``BlockRemoved`` still), so c (a's prompt
    again) hits two blocks, not three, and computes the third a second time; d's pops then evict it (seen twice: kept)
    and b's two (seen once: not kept); e hits all three, the third loaded from the tier. Without the threshold every
    evicted block is kept."""
    kinds = {}
    for threshold in (0, 2):
        cfg = CacheConfig(
            block_size=4, num_blocks=7, enable_prefix_caching=True, host_blocks=4, host_store_threshold=threshold
        )
        s, got = initial_state(cfg), []
        for rid, toks in (("a", A), ("b", B), ("c", A), ("d", C), ("e", A)):
            s, effect = served(s, rid, toks)
            got.append(
                (effect.cached_tokens[0], [type(e).__name__ for e in effect.events if type(e) is not BlockStored])
            )
        kinds[threshold] = got
    assert kinds[2] == [
        (0, []),
        (0, ["BlockRemoved"]),
        (8, ["BlockRemoved"]),
        (0, ["BlockRemoved", "BlockRemoved", "BlockOffloaded", "BlockRemoved"]),
        (12, ["BlockRemoved", "BlockOnloaded"]),
    ]
    assert [c for c, _ in kinds[0]] == [0, 0, 12, 0, 12] and kinds[0][1][1] == ["BlockOffloaded", "BlockRemoved"]
    assert len(s.host) == 1 and sorted(n for n, _ in s.host.uses.values()) == [1] * 6 + [2] * 3


def test_the_use_table_keeps_its_size_dropping_the_least_recently_used() -> None:
    """A use table of 4 contents: a's three blocks, then b's three: a's first two dropped (the least recently
    used); c (a's prompt) hits a's first two (each a new entry: a's third and b's first dropped for them) and
    computes a's third again: each of a's counts 1, and b's first two are gone."""
    cfg = CacheConfig(
        block_size=4, num_blocks=7, enable_prefix_caching=True, host_blocks=4, host_store_threshold=2,
        host_tracker_size=4,
    )  # fmt: skip
    s, _ = served(initial_state(cfg), "a", A)
    first = list(s.host.uses)
    s, _ = served(s, "b", B)
    assert len(s.host.uses) == 4 and first[2] in s.host.uses and first[0] not in s.host.uses
    b_last = list(s.host.uses)[-1]
    s, c = served(s, "c", A)
    assert c.cached_tokens == (8,) and set(s.host.uses) == {*first, b_last}
    assert [s.host.uses[h][0] for h in first] == [1, 1, 1]


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"host_store_threshold": 2}, "needs host_blocks"),
        ({"host_blocks": 4, "host_store_threshold": -1}, "host_store_threshold must be"),
        ({"host_blocks": 4, "host_tracker_size": 0}, "host_tracker_size must be"),
        ({"host_blocks": 4, "host_tracker_size": True}, "host_tracker_size must be"),
    ],
)
def test_a_store_threshold_the_core_cannot_keep_is_refused(kw: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidConfig, match=says):
        CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True, **kw)  # type: ignore[arg-type]


THRESHOLD_CHECK = CheckConfig(
    window=None, host_blocks=1, requests=1, usable_blocks=3, max_model_len=4, host_store_threshold=2,
    host_tracker_size=2, max_states=4_000,
)  # fmt: skip


def test_the_model_checker_covers_the_store_threshold() -> None:
    """A bounded search (the exhaustive one, 32,692 states, is docs/checking.md's): no violation, stores judged
    against the use table."""
    result = check(THRESHOLD_CHECK)
    assert result.violation == [] and result.states >= 4_000


def test_a_store_below_the_threshold_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the tier keeps every evicted block whatever its uses. The checker finds a store of a content seen
    once."""
    real = HostEdit.put_many
    monkeypatch.setattr(HostEdit, "put_many", lambda self, keys, capacity, threshold=0: real(self, keys, capacity))
    result = check(THRESHOLD_CHECK)
    assert result.violation and "fewer than host_store_threshold 2" in result.violation[0] and result.trace


def _tier_of(s: KVState) -> tuple[object, ...]:
    t = s.host
    return dict(t.entries), dict(t.by_tick), len(t), t.next_tick, t.next_slot, t.spare, dict(t.uses), t.uses_oldest


@pytest.mark.parametrize("threshold", [0, 2])
def test_every_version_of_the_tier_reads_as_it_was_made(threshold: int) -> None:
    """The tier is written in place with undo logs (store/host.py): each state a run of admissions, hits in the
    tier, drops and ``forget_host`` left behind reads, in any order afterwards and pickled, exactly as it did when
    it was made; a branch taken from an old state leaves the newer ones as they were."""
    import pickle
    import random

    from pagedkv.core import forget_host

    s = initial_state(
        CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True, host_blocks=2, host_store_threshold=threshold,
                    host_tracker_size=5)
    )  # fmt: skip
    states, seen = [s], [_tier_of(s)]
    for rid, toks in [("a", A), ("b", B), ("c", C), ("d", A), ("e", B), ("f", C), ("g", B)]:
        s, _ = served(s, rid, toks)
        states.append(s)
        seen.append(_tier_of(s))
    s = forget_host(s, [0]).unwrap().state
    states.append(s)
    seen.append(_tier_of(s))
    assert len({repr(x) for x in seen}) > 5  # (the tier changed along the way: touches, drops, a forget)
    branch, _ = served(states[3], "x", A)  # (an old state goes on differently: its own version of the tier)
    branched = _tier_of(branch)
    order = list(range(len(states)))
    random.Random(0).shuffle(order)
    for i in [*reversed(range(len(states))), *order]:
        assert _tier_of(states[i]) == seen[i], i
        assert _tier_of(pickle.loads(pickle.dumps(states[i]))) == seen[i]
    assert _tier_of(branch) == branched
