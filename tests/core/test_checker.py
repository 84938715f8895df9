"""The model checker: pinned state counts, and tests of the tester.

Each planted bug is a kind real KV managers shipped. It is injected at a seam
every caller shares (the pool's functions, a Txn method, a kind's rules, or admit where it is bound), and
must be caught three ways: by the checker with a short counterexample, by
`pagedkv replay --check` of that counterexample, and by the caching state machine.
"""

from __future__ import annotations

import inspect
import json
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from returns.result import Failure, Success

import pagedkv.core.verify.alphabet as check_mod
import pagedkv.core.verify.trace_ops as trace_mod
import tests.core.test_state_machine_caching as sm_caching
from pagedkv.app.cli import main
from pagedkv.core import Admitted, KVState, Step, free_queue
from pagedkv.core.rules import admission, growth, pool
from pagedkv.core.rules import admission as admission_mod
from pagedkv.core.rules.kinds import FullAttention, MambaState, SlidingWindow
from pagedkv.core.store.txn import Txn
from pagedkv.core.verify.alphabet import CheckConfig
from pagedkv.core.verify.check import check

SMALL = CheckConfig(usable_blocks=4, requests=2, max_model_len=6)


@pytest.mark.parametrize(
    "cfg, states",
    [
        (CheckConfig(usable_blocks=2, requests=1, window=None), 219),
        (CheckConfig(usable_blocks=4, requests=2), 519),
        (CheckConfig(usable_blocks=4, requests=2, window=None, prefix_caching=False), 1194),
        (SMALL, 519),
    ],
)
def test_exhaustive_state_counts_are_pinned(cfg: CheckConfig, states: int) -> None:
    """A change in the reachable state space is noticed here."""
    result = check(cfg)
    assert result.violation == [] and result.exhaustive
    assert result.states == states


@pytest.mark.slow
def test_the_default_search_is_exhaustive_at_the_size_its_help_gives() -> None:
    """``pagedkv check`` with no flags: 15,353 states (its help and docs/checking.md say so), about 20 s."""
    result = check(CheckConfig())
    assert result.violation == [] and result.exhaustive and result.states == 15_353


def test_bounds_stop_the_search() -> None:
    r = check(replace(SMALL, max_states=100))
    assert r.states == 100 and not r.exhaustive
    r = check(replace(SMALL, max_depth=2))
    assert r.depth == 2 and not r.exhaustive


def test_cli_prints_figures_and_a_json_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--blocks", "4", "--requests", "2", "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("states explored:") for line in out)
    assert any(line.startswith("states/second:") for line in out)
    last = json.loads(out[-1])
    assert set(last) == {"states", "depth", "violations", "seconds", "exhaustive"}
    assert last["states"] == 519 and last["violations"] == 0 and last["exhaustive"] is True
    assert main(["check", "--blocks", "0"]) == 2


# -- planted bugs -------------------------------------------------------------


def _double_free(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Txn.free_slot

    def free_slot(self: Txn, slot: int) -> None:
        blocks = self.rows[slot].blocks
        if blocks and blocks[0] and blocks[0][-1]:
            pool.link_free(self, [blocks[0][-1]], [])  # the last block goes back a second time
        original(self, slot)

    monkeypatch.setattr(Txn, "free_slot", free_slot)


def _refcount_left_by_refused_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    original = admission_mod.admit

    def admit(state: KVState, spec: Any, **kw: Any) -> Any:
        result = original(state, spec, **kw)
        if isinstance(result, Failure) and result.failure().code.value == "NO_CAPACITY":
            # a mutable manager that took a reference, then found too few blocks and forgot to give it back
            head = state.free_next[0]
            if head:
                leaked = replace(state, refcount=state.refcount.set(head, 1))
                return Success(Step(leaked, Admitted(spec.request_id, state.generation, (0,), ())))
        return result

    for module in (check_mod, trace_mod, sm_caching):
        monkeypatch.setattr(module, "admit", admit)


def _hash_kept_after_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    def pop_blocks(txn: Txn, k: int) -> tuple[int, ...]:
        out = []
        for _ in range(k):
            b = txn.nxt[0]
            after = txn.nxt[b]
            txn.nxt[0] = after
            txn.prv[after] = 0
            txn.free_blocks -= 1
            txn.refcount[b] = 1
            out.append(b)  # the cache entry of b survives: a later hit reads someone else's KV
        return tuple(out)

    monkeypatch.setattr(pool, "pop_blocks", pop_blocks)


def _window_block_freed_while_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    original = SlidingWindow.first_visible_block
    monkeypatch.setattr(SlidingWindow, "first_visible_block", lambda self, pos, bs: original(self, pos, bs) + 1)


def _generation_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Txn, "next_generation", lambda self: self.generation)


def _hit_evicted_by_its_own_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    def take_hits(txn: Txn, blocks: Sequence[int]) -> None:
        for b in blocks:
            txn.refcount[b] = txn.refcount[b] + 1  # the hit stays in the free queue, where a pop can take it

    monkeypatch.setattr(pool, "take_hits", take_hits)


PLANTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "double free": _double_free,
    "refcount left raised by a refused admission": _refcount_left_by_refused_admission,
    "hash kept after its block was evicted": _hash_kept_after_eviction,
    "window block freed while still visible": _window_block_freed_while_visible,
    "generation reused": _generation_reused,
    "hit evicted by its own admission": _hit_evicted_by_its_own_admission,
}


@pytest.fixture(params=sorted(PLANTS))
def planted(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    PLANTS[request.param](monkeypatch)
    yield request.param


def test_the_checker_catches_the_planted_bug_with_a_short_replayable_trace(
    planted: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = check(SMALL)
    assert result.violation, f"the checker missed: {planted}"
    assert len(result.trace) - 2 <= 8, result.trace  # breadth first: the shortest sequence (header, end record)
    path = tmp_path / "counterexample.jsonl"
    path.write_text("\n".join(result.trace) + "\n")
    assert main(["replay", "--check", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"line {len(result.trace) - 1} " in err, err  # reproduced at the trace's last event (before its end)


@pytest.mark.slow
def test_the_state_machine_catches_the_planted_bug(planted: str) -> None:
    """The claim is a budget: 400 examples of 40 steps, generation only (no shrinking, no database),
    find each plant; so this test sets its own settings, apart from the profiles."""
    budget = settings(
        max_examples=400,
        stateful_step_count=40,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    case = sm_caching.CachingMachine.TestCase
    old = case.settings
    case.settings = budget
    try:
        with pytest.raises(AssertionError):  # an invariant or a rule's check fails, not a crash of the machine
            case("runTest").runTest()
    finally:
        case.settings = old


def test_without_a_plant_the_free_queue_is_whole() -> None:
    from pagedkv.core import initial_state

    assert free_queue(initial_state(SMALL.cache_config())) == [1, 2, 3, 4]


# -- planted bugs in state (Mamba) groups: full + window + mamba ------------------------------------------------

MAMBA = CheckConfig(usable_blocks=6, requests=2, mamba=True)  # 4,030 states


def test_full_window_and_mamba_is_exhaustive_without_a_violation() -> None:
    result = check(MAMBA)
    assert result.exhaustive and not result.violation and result.states > 1000


def _saved_state_left_in_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "take_state", lambda txn, b: pool.take_hits(txn, (b,)))  # a second hit shares it


def _state_allocated_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MambaState, "grown", FullAttention.grown)


MAMBA_PLANTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "saved state left in the cache when a hit takes it": _saved_state_left_in_the_cache,
    "state allocated a block per token block": _state_allocated_per_block,
}


@pytest.mark.parametrize("plant", sorted(MAMBA_PLANTS))
def test_the_checker_catches_planted_state_group_bugs(
    plant: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    MAMBA_PLANTS[plant](monkeypatch)
    result = check(MAMBA)
    assert result.violation, f"the checker missed: {plant}"
    path = tmp_path / "counterexample.jsonl"
    path.write_text("\n".join(result.trace) + "\n")
    assert main(["replay", "--check", str(path)]) == 1
    capsys.readouterr()


# -- planted bugs in the commit and growth loops' common rows (full attention: no window to move) --

FULL = CheckConfig(usable_blocks=3, requests=2, max_model_len=6, window=None)  # 9,076 states


def _mutated(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, old: str, new: str) -> None:
    """Plant a bug inside a loop (no function to wrap there): ``module.name`` recompiled with ``old`` -> ``new``
    in its source, in the module's own namespace."""
    source = textwrap.dedent(inspect.getsource(getattr(module, name)))
    assert source.count(old) == 1, f"the plant's line is not in {name}: {old}"
    namespace: dict[str, Any] = {}
    exec(compile(source.replace(old, new), module.__file__, "exec"), vars(module).copy(), namespace)
    original = getattr(module, name)
    for user in list(sys.modules.values()):  # every module that imported it by name
        if getattr(user, "__name__", "").startswith("pagedkv.") and getattr(user, name, None) is original:
            monkeypatch.setattr(user, name, namespace[name])


def _open_block_id_dropped(monkeypatch: pytest.MonkeyPatch) -> None:  # the id never joins the open block's ids
    _mutated(
        monkeypatch, growth, "grow_each", 'tail_leaf[o] = tail + token.to_bytes(8, "little")', "tail_leaf[o] = tail"
    )


def _completed_block_not_hashed(monkeypatch: pytest.MonkeyPatch) -> None:  # a commit past a boundary, one write
    _mutated(
        monkeypatch,
        sys.modules["pagedkv.core.rules.commit"],
        "commit_each",
        "cache_full_blocks(txn, req, 0, slot, c, hashes.get(rid) if hashes else None)",
        "pass",
    )


def _boundary_without_a_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Txn.new_layout

    def same_generation(txn: Txn, first_slot: int) -> int:  # growth's new block installed under the old generation
        if sys._getframe(1).f_code.co_filename == growth.__file__:
            return txn.row_generation[first_slot]  # type: ignore[no-any-return]
        return real(txn, first_slot)

    monkeypatch.setattr(Txn, "new_layout", same_generation)


@pytest.mark.parametrize("plant", [_open_block_id_dropped, _completed_block_not_hashed, _boundary_without_a_generation])
def test_the_checker_catches_a_planted_bug_in_the_decode_loops(
    plant: Callable[[pytest.MonkeyPatch], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = check(FULL)
    assert clean.violation == [] and clean.states == 9076
    plant(monkeypatch)
    result = check(FULL)
    assert result.violation, "the checker missed a bug in the decode loops"
    assert any(op in line for line in result.trace[1:] for op in ("decode", "append", "commit"))


def test_destination_reservations_are_explored_and_the_window_bug_is_caught(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 17, defect 4: ``admit`` with ``pending_tokens`` under a sliding window reserved blocks no query
    could see (found by hand). With ``destinations`` the checker admits such rows and marks their KV ready,
    so the fixed core holds every invariant over the whole space, and the old admission is caught with a
    short trace that ``pagedkv replay --check`` reproduces."""
    cfg = replace(SMALL, destinations=True)
    fixed = check(cfg)
    assert fixed.violation == [] and fixed.exhaustive and fixed.states > check(SMALL).states
    monkeypatch.setattr(SlidingWindow, "admitted", lambda self, hit, nb, first, pop: hit + pop(nb - len(hit)))
    old = check(cfg)
    assert old.violation and any("no query can see" in v for v in old.violation), old.violation
    path = tmp_path / "counterexample.jsonl"
    path.write_text("\n".join(old.trace) + "\n")
    assert '"pending_tokens"' in path.read_text()
    assert main(["replay", "--check", str(path)]) == 1
    capsys.readouterr()


# -- admissions judged: a window group counted whole (issue 28) ------------------------------------------------

LONG = CheckConfig(usable_blocks=5, requests=1, max_model_len=6, long_prompts=True)  # 2,510 states


def test_long_prompts_with_hits_below_the_window_are_exhaustive_without_a_violation() -> None:
    result = check(LONG)
    assert result.violation == [] and result.exhaustive and result.states == 2510


def test_the_checker_catches_a_planted_window_over_count(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The old rule: every group of a row counted for all its blocks, so a request whose hit leaves its window
    group holding two blocks was refused for good (inside vLLM: ManagerError from Scheduler.schedule)."""
    original = admission._cost

    def whole_rows(state: KVState, spec: Any, hit: Any, firsts: Any) -> tuple[int, int]:
        return sum(state.config.row_blocks(r.num_tokens) for r in spec.rows), original(state, spec, hit, firsts)[1]

    monkeypatch.setattr(admission, "_cost", whole_rows)
    assert check(SMALL).violation == []  # no hit there leaves a window block null: this is why LONG exists
    result = check(LONG)
    assert result.violation == ["admit 'A' refused for good, though alone it holds 5 of 5 usable blocks"]
    path = tmp_path / "counterexample.jsonl"
    path.write_text("\n".join(result.trace) + "\n")
    assert main(["replay", "--check", str(path)]) == 1
    assert f"line {len(result.trace) - 1} " in capsys.readouterr().err


# -- rows that run ahead of their tokens (issue 31) ----------------------------------------------------------------

AHEAD = CheckConfig(usable_blocks=4, requests=1, max_model_len=6, ahead=True, cache_at_schedule=True)


def test_placeholders_fills_and_cuts_are_exhaustive_without_a_violation() -> None:
    for cfg in (AHEAD, replace(AHEAD, cache_at_schedule=False, window=None), replace(AHEAD, free_queue="vllm")):
        result = check(cfg)
        assert result.violation == [] and result.exhaustive and result.states > 900, cfg


def _hash_over_a_placeholder(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedkv.core.rules.caching as caching_mod

    monkeypatch.setattr(caching_mod, "known_ids", lambda *_: 1 << 20)  # every position taken as known


def _cut_frees_a_cached_block(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedkv.core.rules.placeholders as placeholders_mod

    monkeypatch.setattr(
        placeholders_mod, "cut_floor", lambda txn, slot: txn.row_computed[slot]
    )  # blocks cached ahead too


@pytest.mark.parametrize("plant", [_hash_over_a_placeholder, _cut_frees_a_cached_block])
def test_the_checker_catches_planted_bugs_of_rows_ahead_of_their_tokens(
    plant: Callable[[pytest.MonkeyPatch], None],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    plant(monkeypatch)
    result = check(AHEAD)
    assert result.violation, "the checker missed it"
    # a hash over positions without ids (placeholders, or ids stopped by a count), or a cut into the cache
    assert any("hashed" in v or "hash" in v for v in result.violation) or any('"truncate"' in x for x in result.trace)
    path = tmp_path / "counterexample.jsonl"
    path.write_text("\n".join(result.trace) + "\n")
    assert main(["replay", "--check", str(path)]) == 1
    capsys.readouterr()


@pytest.mark.slow
def test_the_vllm_omni_free_order_is_exhaustive_without_a_violation() -> None:
    """free_queue="vllm-omni" (a CFG request's rows let go the last first: integrations.vllm_omni) over the checker's
    alphabet, CFG rows and a diffusion row among its requests, and ``turn_away`` (vLLM-Omni's refusal of each spec
    that does not fit), with and without prefix caching (its queue orders make more states: three usable blocks and
    prompts of at most 4 tokens keep the search whole with caching, 5,829 states, where a CFG request's block kept at
    its release is found in 54; four blocks without)."""
    small = replace(SMALL, window=None, free_queue="vllm-omni", max_model_len=4)
    for cfg in (replace(small, usable_blocks=3), replace(small, prefix_caching=False)):
        result = check(cfg)
        assert result.violation == [] and result.exhaustive and result.states > 500, (cfg, result.states)
