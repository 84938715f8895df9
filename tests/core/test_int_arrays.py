"""The per-block numbers are rerooted persistent arrays (core/store/rerooted.py's ``IntArray``): every version of a
lineage shares one ``array('q')`` written in place, the others hold undo logs, sparse (the entries written) or dense
(the whole array, where a transition writes many). Held beside a model (a list per version), every version reads
as it was made, whatever was edited, read, refused or interrupted since, with either kind of log."""

from __future__ import annotations

import pickle
import sys
from types import FrameType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.core.store import rerooted
from pagedkv.core.store.rerooted import IntArray

N = 24

ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "write_many", "read_base", "abandon", "commit"]),
        st.integers(0, N - 1),
        st.integers(-5, 1 << 40),
        st.integers(0, 30),  # which version to edit from
        st.lists(st.tuples(st.integers(0, N - 1), st.integers(0, 9)), max_size=10),  # a bulk write (repeats too)
    ),
    max_size=80,
)


@given(ops, st.sampled_from([(256, 64), (1, 4), (1, 1)]))
def test_every_version_reads_as_it_was_made(script: list[Any], dense: tuple[int, int]) -> None:
    """Single writes and bulk ones (``writable`` then writes in place), with sparse logs, dense ones, and an edit
    whose log turns dense half way, read as the model's writes one at a time."""
    saved = rerooted.DENSE, rerooted.DENSE_MIN
    rerooted.DENSE, rerooted.DENSE_MIN = dense
    try:
        versions = [IntArray.of(range(N))]
        models = [list(range(N))]
        edit, model, base_at = versions[0].edit(), list(range(N)), 0
        for op, i, x, pick, many in script:
            if op == "set":
                edit[i] = x
                model[i] = x
            elif op == "write_many":
                data = edit.writable([j for j, _ in many])
                for j, y in many:
                    data[j] = y
                    model[j] = y
            elif op == "read_base":  # (a transition reading its old state mid-edit: the edit rolls back, then on)
                assert list(versions[base_at]) == models[base_at]
            elif op == "abandon":  # (a refusal or an exception: the edit is dropped, its version never made)
                base_at = pick % len(versions)
                edit, model = versions[base_at].edit(), list(models[base_at])
            else:  # commit, then go on from a version taken at random (an old one: a branch)
                versions.append(edit.persistent())
                models.append(list(model))
                base_at = pick % len(versions)
                edit, model = versions[base_at].edit(), list(models[base_at])
            assert list(edit.values()) == model and [edit[j] for j in range(N)] == model  # (its own writes)
        for v, m in zip(versions, models):
            assert list(v) == m and [v[j] for j in range(N)] == m
        for v, m in reversed(list(zip(versions, models))):  # (and again, rerooted the other way)
            assert list(v) == m and pickle.loads(pickle.dumps(v)) == v
    finally:
        rerooted.DENSE, rerooted.DENSE_MIN = saved


def _lineage() -> list[tuple[IntArray, list[int]]]:
    """Three versions: a sparse log, then a dense one (a write of every entry)."""
    old = IntArray.of([0] * N)
    e = old.edit()
    for j in (3, 5, 3):
        e[j] = j + 1
    new = e.persistent()
    e = new.edit()
    data = e.writable(range(N))
    for j in range(N):
        data[j] = 100 + j
    newer = e.persistent()
    return [(v, list(v)) for v in (old, new, newer)]


@pytest.mark.parametrize("at", range(1, 66))  # (the reroot runs 64 line events)
def test_an_interrupt_anywhere_in_a_reroot_is_finished_by_the_next_read(at: int) -> None:
    """A ``KeyboardInterrupt`` at the ``at``-th line of rerooted.py during a read of the oldest version (a reroot
    across a dense log and a sparse one): the store is between versions, marked pending; any read finishes the
    reroot first, and every version reads as it was made."""
    saved = rerooted.DENSE_MIN
    rerooted.DENSE_MIN = 8
    try:
        held = _lineage()
    finally:
        rerooted.DENSE_MIN = saved
    lines = [0]

    def trap(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != rerooted.__file__:
            return None

        def line(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                lines[0] += 1
                if lines[0] == at:
                    raise KeyboardInterrupt
            return line

        return line

    sys.settrace(trap)
    try:
        list(held[0][0])
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    for v, want in (held[2], held[0], held[1], held[2], held[0]):
        assert list(v) == want


def test_a_dense_log_is_taken_where_a_transition_writes_many_entries() -> None:
    """The log's kind as documented: a few writes logged one by one; more than ``len / DENSE`` (and ``DENSE_MIN``)
    the whole array, once, with the entries logged before it folded in."""
    n = 1 << 16
    base = IntArray.of(range(n))
    e = base.edit()
    e[7] = 70
    assert type(base._diff) is tuple and base._diff[0] == [7]
    e.writable(list(range(100, 100 + rerooted.DENSE_MIN)))
    assert type(base._diff) is tuple  # (65 writes of 65,536 entries: cheaper one by one)
    data = e.writable(list(range(n // rerooted.DENSE)))
    assert type(base._diff) is not tuple and base._diff[7] == 7  # (the array as it was, 7's old value folded in)
    data[9] = 90
    new = e.persistent()
    assert base[7] == 7 and base[9] == 9 and new[7] == 70 and new[9] == 90
