"""A transition interrupted at any point leaves every state its caller holds readable and unchanged.

The promise the core's representation keeps (docs/core.md, "State"): a transition returns a new state, and a
refusal, any exception or a ``KeyboardInterrupt`` at any line of the core leaves every state the caller still
holds exactly as it was, digest for digest, its invariants holding, and the same call made again gives the
same state as if nothing had happened. Here a ``KeyboardInterrupt`` is raised at line events of the core's
code (through ``sys.settrace``), spread over every call of a scripted run, over four pools: full attention
with prefix caching and vLLM's policies, a sliding window beside it, a Mamba state group, and a host tier (blocks
kept there as pops evict them, a full tier dropping entries, a hit there loaded back, ``forget_host``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from returns.result import Success

from pagedkv.core import (
    CacheConfig,
    GroupKind,
    GroupSpec,
    KVState,
    RequestSpec,
    RowSpec,
    admit,
    append,
    cache_ahead_many,
    commit,
    decode_step,
    digest,
    forget_host,
    initial_state,
    release,
    release_many,
    reset_prefix_cache,
)
from pagedkv.core.verify.invariants import check_invariants

CORE = str(Path(__file__).resolve().parents[2] / "pagedkv" / "core")
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]

Call = Callable[[KVState], Any]


OTHER = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
THIRD = [31, 32, 33, 34, 35, 36, 37, 38, 39, 40]


def _tier_script() -> list[tuple[str, Call]]:
    """A pool of 6 usable blocks and a tier of 3: a's cached blocks evicted by x's pops go to the tier (the full
    tier drops one it took in the same transition), y's pops store x's and drop entries earlier transitions made,
    x's prompt again hits in the tier (its entries touched and pinned, loaded back), a slot forgotten."""
    return [
        ("admit a", lambda s: admit(s, RequestSpec("a", (RowSpec.of_tokens(PROMPT),)))),
        ("commit a", lambda s: commit(s, "a", [10])),
        ("release a", lambda s: release(s, "a", "finished")),
        ("admit x (a's blocks to the tier)", lambda s: admit(s, RequestSpec("x", (RowSpec.of_tokens(OTHER),)))),
        ("commit x", lambda s: commit(s, "x", [10])),
        ("release x", lambda s: release(s, "x", "finished")),
        ("admit y (x's to the tier, a's dropped)", lambda s: admit(s, RequestSpec("y", (RowSpec.of_tokens(THIRD),)))),
        ("commit y", lambda s: commit(s, "y", [10])),
        ("release y", lambda s: release(s, "y", "finished")),
        ("admit b (x's prompt: a hit in the tier)", lambda s: admit(s, RequestSpec("b", (RowSpec.of_tokens(OTHER),)))),
        ("forget host slot 0", lambda s: forget_host(s, [0])),
        ("release b", lambda s: release(s, "b", "cancelled")),
        ("reset prefix cache", lambda s: reset_prefix_cache(s)),
    ]


def _script(schedule_caching: bool) -> list[tuple[str, Call]]:
    steps: list[tuple[str, Call]] = [
        ("admit a", lambda s: admit(s, RequestSpec("a", (RowSpec.of_tokens(PROMPT),)))),
        ("decode a", lambda s: decode_step(s, ["a"], [11])),
        ("append a", lambda s: append(s, "a", [[12, 13, 14]])),
        ("commit a", lambda s: commit(s, "a", [14])),
        ("admit b (a hit)", lambda s: admit(s, RequestSpec("b", (RowSpec.of_tokens([*PROMPT, 99]),)))),
        ("decode a b", lambda s: decode_step(s, ["a", "b"], [15, 16])),
        ("release a", lambda s: release(s, "a", "finished")),
        ("admit c (a's blocks)", lambda s: admit(s, RequestSpec("c", (RowSpec.of_tokens(PROMPT[:7]),)))),
        ("reset prefix cache", lambda s: reset_prefix_cache(s)),
        ("release b c", lambda s: release_many(s, ["b", "c"], "cancelled")),
    ]
    if schedule_caching:  # vLLM's caching point: blocks cached when planned
        steps.insert(2, ("cache ahead a", lambda s: cache_ahead_many(s, [("a", [11])])))
    return steps


def _config(kind: str) -> CacheConfig:
    groups: tuple[GroupSpec, ...] = (GroupSpec("full"),)
    if kind == "window":
        groups += (GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=3),)
    if kind == "mamba":
        groups += (GroupSpec("mamba", GroupKind.MAMBA),)
    vllm = kind == "full"
    if kind == "tier":
        return CacheConfig(block_size=2, num_blocks=7, enable_prefix_caching=True, host_blocks=3)
    return CacheConfig(
        block_size=2,
        num_blocks=40,
        groups=groups,
        enable_prefix_caching=True,
        free_queue="vllm" if vllm else "tail",
        caching_point="schedule" if vllm else "commit",
        cache_duplicates=vllm,
    )


class _Interrupt:
    """Raises ``KeyboardInterrupt`` at the ``at``-th line event in the core's code (0: never), counting them."""

    def __init__(self, at: int) -> None:
        self.at, self.lines, self.fired = at, 0, False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(CORE):
            return None
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.fired = True
                raise KeyboardInterrupt(f"injected at line event {self.at}")
        return self._line


def _traced(call: Call, state: KVState, at: int) -> tuple[Any, _Interrupt]:
    trap = _Interrupt(at)
    sys.settrace(trap)
    try:
        return call(state), trap
    except KeyboardInterrupt:
        return None, trap
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("kind", ["full", "window", "mamba", "tier"])
def test_an_interrupt_anywhere_leaves_every_held_state_as_it_was(kind: str) -> None:
    cfg = _config(kind)
    held: list[tuple[KVState, str]] = []
    state = initial_state(cfg)
    injected = 0
    for name, call in _tier_script() if kind == "tier" else _script(cfg.caching_point == "schedule"):
        held.append((state, digest(state)))
        expected, count = _traced(call, state, 0)  # the call's line events, and its outcome uninterrupted
        assert isinstance(expected, Success), (name, expected)
        for at in range(1, count.lines + 1):  # every line event of the core the call runs
            _, trap = _traced(call, state, at)
            # (a run may end sooner than the first: a version the first had to reroot to may be current now)
            assert trap.fired or trap.lines < at, (name, at)
            injected += trap.fired
            for old, was in held:
                assert digest(old) == was, f"{name}: a held state changed after an interrupt at line event {at}"
            assert check_invariants(state) == [], (name, at)
            again = call(state)  # the same call, uninterrupted: the same state
            assert digest(again.unwrap().state) == digest(expected.unwrap().state), (name, at)
        state = expected.unwrap().state
    assert injected > 300


def test_the_trap_fires_inside_the_core_only() -> None:
    """The tester tested: an interrupt is injected into a transition (so the loop above is not vacuous), and the
    same interrupt with no core code to run never fires."""
    s = initial_state(_config("full"))
    out, trap = _traced(lambda st: admit(st, RequestSpec("a", (RowSpec.of_tokens(PROMPT),))), s, 5)
    assert out is None and trap.fired
    out, trap = _traced(lambda st: len(PROMPT), s, 1)
    assert out == len(PROMPT) and not trap.fired and trap.lines == 0


def test_an_undo_an_interrupt_skips_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a decode step that writes the caller's state in place and puts it back when done (the way a
    rerooting representation works), without putting it back when interrupted: the held state is caught
    changed."""
    import pagedkv.core.rules.decode as decode_mod

    real = decode_mod.commit_each

    def in_place(txn: Any, ids: Any, counts: Any, effects: Any = None) -> Any:
        leaf = txn.base.row_len.leaves[0]
        saved = leaf[0]
        leaf[0] = saved + 1000  # (written in place: the caller's state changes until the undo)
        out = real(txn, ids, counts, effects)
        leaf[0] = saved
        return out

    monkeypatch.setattr(decode_mod, "commit_each", in_place)
    with pytest.raises(AssertionError, match="a held state changed after an interrupt"):
        test_an_interrupt_anywhere_leaves_every_held_state_as_it_was("full")


def test_an_interrupt_anywhere_in_the_scheduler_leaves_every_held_state_as_it_was() -> None:
    """The scheduler's transitions keep the promise too: submissions, steps that admit, chunk a prompt, decode
    and preempt (a pool too small for all three: the third request is preempted at step 2), outputs that end
    requests, a cancel; an interrupt at every line event of the core each of them runs."""
    from pagedkv.core.scheduler import (
        SchedulerConfig,
        SeqRequest,
        cancel,
        new_scheduler,
        on_output,
        sched_digest,
        schedule,
        submit,
    )

    cache = CacheConfig(block_size=2, num_blocks=9, enable_prefix_caching=True)
    state = new_scheduler(cache, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=6))
    planned: dict[str, Any] = {}

    def step(s: Any) -> Any:
        got = schedule(s)
        if isinstance(got, Success):
            planned["plan"] = got.unwrap()[1]
        return got

    def output(s: Any) -> Any:
        plan = planned["plan"]
        return on_output(s, {rid: 7 for rid in plan.samples})

    script: list[tuple[str, Call]] = [
        ("submit a", lambda s: submit(s, SeqRequest("a", (1, 2, 3, 4, 5), max_tokens=3))),
        ("submit b", lambda s: submit(s, SeqRequest("b", (1, 2, 3, 4, 6), max_tokens=4))),
        ("submit c", lambda s: submit(s, SeqRequest("c", (9, 8, 7), max_tokens=6))),
    ]
    for k in range(6):
        script += [(f"schedule {k}", step), (f"output {k}", output)]
    script.append(("cancel c", lambda s: cancel(s, "c")))
    held: list[tuple[Any, str]] = []
    injected = 0
    for name, call in script:
        held.append((state, sched_digest(state)))
        expected, count = _traced(call, state, 0)
        assert isinstance(expected, Success), (name, expected)
        after = expected.unwrap()
        after = after[0] if isinstance(after, tuple) else after
        for at in range(1, count.lines + 1):
            _, trap = _traced(call, state, at)
            # (a run may end sooner than the first: a version the first had to reroot to may be current now)
            assert trap.fired or trap.lines < at, (name, at)
            injected += trap.fired
            for old, was in held:
                assert sched_digest(old) == was, f"{name}: a held state changed after an interrupt at {at}"
            again = call(state).unwrap()
            assert sched_digest(again[0] if isinstance(again, tuple) else again) == sched_digest(after), (name, at)
        state = after
    assert injected > 1000
