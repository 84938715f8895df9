"""The rules of each group kind (``core.rules.kinds``): the numbers docs/architecture.md's table gives, and the house
rule that no transition asks a group's kind (only ``core.rules.kinds`` does; the checker's invariants keep their
own formula on purpose)."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from pagedkv.core import CacheConfig, GroupKind, GroupSpec
from pagedkv.core.rules.kinds import (
    RULES,
    ChunkedLocal,
    FullAttention,
    LatentAttention,
    MambaAlign,
    MambaState,
    SlidingWindow,
)

CORE = Path(__file__).resolve().parents[2] / "pagedkv" / "core"


def _pop_from(start: int):  # type: ignore[no-untyped-def]
    """A pool's pop over fresh ids start, start + 1, ..."""
    nxt = [start]

    def pop(n: int) -> tuple[int, ...]:
        out = tuple(range(nxt[0], nxt[0] + n))
        nxt[0] += n
        return out

    return pop


def test_every_kind_has_one_class_and_each_group_its_rules() -> None:
    assert set(RULES) == set(GroupKind)
    assert type(GroupSpec("w", GroupKind.SLIDING_WINDOW, window=8).rules) is SlidingWindow
    assert type(GroupSpec("m", GroupKind.MLA).rules) is LatentAttention
    rules = GroupSpec("c", GroupKind.CHUNKED_LOCAL, chunk=32).rules
    assert pickle.loads(pickle.dumps(rules)).chunk == 32  # (a config crosses to other ranks)


def test_what_a_query_sees() -> None:
    assert FullAttention().first_visible_position(112) == 0
    assert SlidingWindow(window=32).first_visible_position(112) == 81
    assert ChunkedLocal(chunk=32).first_visible_position(112) == 96
    assert MambaState().first_visible_position(112) == 0
    assert MambaAlign().first_visible_position(112) == 111
    assert SlidingWindow(window=32).first_visible_block(112, 16) == 5


def test_what_a_row_holds_and_what_admission_and_growth_take() -> None:
    assert [k.most_held(5) for k in (FullAttention(), SlidingWindow(4), MambaState(), MambaAlign())] == [5, 5, 1, 2]
    # computing [96, 112) of a row: the window's 31 tokens before 96 from block 4 on, and the chunk's, in blocks 4-6
    assert SlidingWindow(window=32).held_computing(96, 112, 16) == 3
    assert SlidingWindow(window=32).held_computing(97, 113, 16) == 4  # (out of line: one block more)
    assert ChunkedLocal(chunk=32).held_computing(97, 113, 16) == 2  # (the local chunk from 96: blocks 6 and 7)
    assert [k.held_computing(97, 113, 16) for k in (FullAttention(), MambaState(), MambaAlign())] == [8, 1, 2]
    assert FullAttention().admission_cost(nb=4, hit=(7, 8), first=0) == (2, (7, 8))
    assert SlidingWindow(window=5).admission_cost(nb=4, hit=(7, 8), first=1) == (2, (8,))
    assert MambaState().admission_cost(nb=4, hit=(0, 9), first=0) == (1, ())
    assert MambaAlign().admission_cost(nb=4, hit=(0, 9), first=1) == (1, (9,))
    assert SlidingWindow(window=5).admitted((7, 8), 4, 1, _pop_from(20)) == (0, 8, 20, 21)
    assert MambaState().admitted((0, 9), 4, 0, _pop_from(20)) == (0, 0, 0, 9)
    assert MambaAlign().admitted((0, 9), 4, 1, _pop_from(20)) == (0, 9, 0, 20)
    assert [k.growth_blocks(3) for k in (FullAttention(), MambaState(), MambaAlign())] == [3, 0, 1]
    assert MambaState().grown((0, 5), 2, _pop_from(20)) == (0, 0, 0, 5)
    assert MambaAlign().grown((0, 5), 2, _pop_from(20)) == (0, 5, 0, 20)


def test_what_a_commit_lets_go() -> None:
    assert list(FullAttention().let_go((1, 2, 3), 12, 0, 4)) == []
    assert list(SlidingWindow(window=4).let_go((1, 2, 3), 12, 0, 4)) == [1, 0]  # tail first
    assert list(SlidingWindow(window=4).let_go((0, 2, 3), 12, 0, 4)) == [1]  # back to the first null
    assert list(MambaAlign().let_go((0, 5, 0, 7, 8), 17, 8, 4)) == [1, 3]  # the state blocks behind the newest


def test_pool_wide_counts_are_the_kinds_summed() -> None:
    cfg = CacheConfig(
        block_size=4,
        num_blocks=64,
        groups=(
            GroupSpec("f"),
            GroupSpec("w", GroupKind.SLIDING_WINDOW, window=8),
            GroupSpec("m", GroupKind.MAMBA),
            GroupSpec("a", GroupKind.MAMBA_ALIGN),
        ),
    )
    assert cfg.row_blocks(17) == 5 + 5 + 1 + 2
    assert cfg.growth_blocks(2) == 2 + 2 + 0 + 1 and cfg.opening_blocks == 1 + 1 + 0 + 1
    assert cfg.has_windows and cfg.recurrent and cfg.stops_at_block_end and cfg.state_group_set == {2}


# Only core.rules.kinds names a kind's members; the exceptions: the checker's invariants and alphabet (their own
# formula, so that a bug in the rules cannot hide from them) and the geometry that builds groups from layers.
TRANSITIONS = sorted(
    p for p in CORE.rglob("*.py") if p.name not in ("kinds.py", "grouping.py") and p.parent.name != "verify"
)


@pytest.mark.parametrize("path", TRANSITIONS, ids=lambda p: p.name)
def test_no_transition_asks_a_groups_kind(path: Path) -> None:
    names = {m.name for m in GroupKind}
    tree = ast.parse(path.read_text())
    defaults = {id(n) for a in ast.walk(tree) if isinstance(a, ast.AnnAssign) and a.value for n in ast.walk(a.value)}
    for node in ast.walk(tree):
        if id(node) in defaults:  # (a field's default: GroupSpec's kind is full unless told)
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "GroupKind":
            assert node.attr not in names, f"{path.name}:{node.lineno} branches on GroupKind.{node.attr}"
        if (
            isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) for op in node.ops)
            and any(  # (``g.kind``, ``g.kind.value`` alike)
                isinstance(a, ast.Attribute) and a.attr == "kind"
                for x in (node.left, *node.comparators)
                for a in ast.walk(x)
            )
        ):
            raise AssertionError(f"{path.name}:{node.lineno} compares a group's kind")
