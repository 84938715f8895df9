"""The core against a small, obviously correct reference model.

The reference is plain lists and dicts written from the documented rules (docs/core.md, docs/trace.md); after
every step the two must agree on block ids, the free queue's order, lengths and
generations, the invariants must hold, a refused step must leave the digest
unchanged, and old snapshots must never change.
"""

from __future__ import annotations

from typing import Any

import pytest

from hypothesis import strategies as st
from pagedkv.core.verify.invariants import check_invariants
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from returns.result import Failure, Success

from pagedkv.core import (
    CacheConfig,
    GroupSpec,
    KVState,
    RequestSpec,
    RowSpec,
    admit,
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

IDS = [f"r{i}" for i in range(5)] + [7]
REASONS = ["finished", "cancelled", "error", "preempted"]


class Reference:
    def __init__(self, bs: int, usable: int, ngroups: int, max_rows: int | None, max_len: int | None) -> None:
        self.bs, self.usable, self.ng, self.max_rows, self.max_len = bs, usable, ngroups, max_rows, max_len
        self.free = list(range(1, usable + 1))  # head first
        self.reqs: dict[Any, list[dict[str, Any]]] = {}
        self.gen = 0

    def nblocks(self, n: int) -> int:
        return (n + self.bs - 1) // self.bs

    def take(self, k: int) -> list[int]:
        out, self.free = self.free[:k], self.free[k:]
        return out

    def admit(self, rid: Any, rows: list[tuple[int, int | None, int | None]]) -> str | None:
        if any(n < 1 for n, _, _ in rows) or any(p is not None and p + t > n for n, p, t in rows):  # type: ignore[operator]
            return "INVALID"
        if self.max_rows is not None and len(rows) > self.max_rows:
            return "UNSCHEDULABLE"
        if self.max_len is not None and any(n > self.max_len for n, _, _ in rows):
            return "UNSCHEDULABLE"
        need = self.ng * sum(self.nblocks(n) for n, _, _ in rows)
        if need > self.usable:
            return "UNSCHEDULABLE"
        if rid in self.reqs:
            return "DUPLICATE_REQUEST"
        if need > len(self.free):
            return "NO_CAPACITY"
        self.reqs[rid] = [
            {
                "len": n,
                "computed": 0,
                "diff": p is not None,
                "blocks": [self.take(self.nblocks(n)) for _ in range(self.ng)],
            }
            for n, p, t in rows
        ]
        self.gen += 1
        return None

    def append(self, items: list[tuple[Any, list[int]]]) -> str | None:
        free, reqs, gen = (
            list(self.free),
            {k: [dict(r, blocks=[list(b) for b in r["blocks"]]) for r in v] for k, v in self.reqs.items()},
            self.gen,
        )
        for rid, counts in items:
            if rid not in self.reqs:
                return self._undo(free, reqs, gen, "UNKNOWN_REQUEST")
            rows = self.reqs[rid]
            if len(counts) != len(rows):
                return self._undo(free, reqs, gen, "INVALID")
            need = 0
            for row, n in zip(rows, counts):
                if n < 0:
                    return self._undo(free, reqs, gen, "INVALID")
                if n == 0:
                    continue
                if row["diff"] or (self.max_len is not None and row["len"] + n > self.max_len):
                    return self._undo(free, reqs, gen, "INVALID")
                need += self.nblocks(row["len"] + n) - len(row["blocks"][0])
            if need * self.ng > len(self.free):
                return self._undo(free, reqs, gen, "NO_CAPACITY")
            for row, n in zip(rows, counts):
                if n:
                    extra = self.nblocks(row["len"] + n) - len(row["blocks"][0])
                    row["len"] += n
                    for g in row["blocks"]:
                        g.extend(self.take(extra))
            if need:
                self.gen += 1
        return None

    def _undo(self, free: list[int], reqs: dict[Any, Any], gen: int, code: str) -> str:
        self.free, self.reqs, self.gen = free, reqs, gen
        return code

    def commit(self, rid: Any, computed: list[int]) -> str | None:
        if rid not in self.reqs:
            return "UNKNOWN_REQUEST"
        rows = self.reqs[rid]
        if len(computed) != len(rows) or any(not r["computed"] <= c <= r["len"] for r, c in zip(rows, computed)):
            return "INVALID"
        for r, c in zip(rows, computed):
            r["computed"] = c
        return None

    def release(self, rid: Any, reason: str) -> str | None:
        if reason not in REASONS:
            return "INVALID"
        if rid not in self.reqs:
            return "UNKNOWN_REQUEST"
        rows = self.reqs.pop(rid)
        longest = max(len(g) for r in rows for g in r["blocks"])
        for pos in reversed(range(longest)):
            for r in rows:
                for g in r["blocks"]:
                    if pos < len(g):
                        self.free.append(g[pos])
        self.gen += 1
        return None

    def reset(self) -> None:
        self.free = list(range(1, self.usable + 1))
        self.reqs = {}


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[KVState, str]] = []

    @initialize(
        bs=st.sampled_from([1, 2, 4]),
        usable=st.integers(1, 16),
        ngroups=st.integers(1, 2),
        max_rows=st.sampled_from([None, 2]),
        max_len=st.sampled_from([None, 12]),
    )
    def setup(self, bs: int, usable: int, ngroups: int, max_rows: int | None, max_len: int | None) -> None:
        groups = tuple(GroupSpec(f"g{i}") for i in range(ngroups))
        cfg = CacheConfig(
            block_size=bs, num_blocks=usable + 1, groups=groups, max_rows_per_request=max_rows, max_model_len=max_len
        )
        self.state = initial_state(cfg)
        self.ref = Reference(bs, usable, ngroups, max_rows, max_len)
        self.max_gen = 0

    def apply(self, result: Any, expected: str | None) -> None:
        before = digest(self.state)
        if expected is None:
            assert isinstance(result, Success), result
            self.history = (self.history + [(self.state, before)])[-3:]
            self.state = result.unwrap().state
        else:
            assert isinstance(result, Failure), (result, expected)
            err = result.failure()
            assert err.code.value == expected, (err, expected)
            assert err.message
            assert digest(self.state) == before

    @rule(
        rid=st.sampled_from(IDS),
        rows=st.lists(st.tuples(st.integers(0, 14), st.booleans(), st.integers(0, 3)), min_size=1, max_size=3),
    )
    def admit(self, rid: Any, rows: list[tuple[int, bool, int]]) -> None:
        specs, ref_rows = [], []
        for n, diffusion, t in rows:
            p_t = (max(n - t - 1, 0), t + 1) if diffusion else (None, None)
            specs.append(RowSpec(n, prefix_len=p_t[0], target_len=p_t[1]))
            ref_rows.append((n, *p_t))
        self.apply(admit(self.state, RequestSpec(rid, tuple(specs))), self.ref.admit(rid, ref_rows))

    @rule(
        items=st.lists(
            st.tuples(st.sampled_from(IDS), st.lists(st.integers(-1, 6), min_size=1, max_size=3)),
            min_size=1,
            max_size=3,
        )
    )
    def append(self, items: list[tuple[Any, list[int]]]) -> None:
        self.apply(append_many(self.state, items), self.ref.append(items))

    @rule(rids=st.lists(st.sampled_from(IDS), max_size=4))
    def decode(self, rids: list[Any]) -> None:
        items = [(r, [1] * len(self.ref.reqs[r]) if r in self.ref.reqs else [1]) for r in rids]
        self.apply(append_decode(self.state, rids), self.ref.append(items))

    @rule(rid=st.sampled_from(IDS), data=st.data())
    def commit(self, rid: Any, data: st.DataObject) -> None:
        rows = self.ref.reqs.get(rid, [{"len": 3, "computed": 0}])
        computed = [data.draw(st.integers(r["computed"] - 1, r["len"] + 1)) for r in rows]
        self.apply(commit(self.state, rid, computed), self.ref.commit(rid, computed))

    @rule(rid=st.sampled_from(IDS), reason=st.sampled_from(REASONS + ["bored"]))
    def release(self, rid: Any, reason: str) -> None:
        self.apply(release(self.state, rid, reason), self.ref.release(rid, reason))

    @rule()
    def reset(self) -> None:
        epoch = self.state.epoch
        self.ref.reset()
        self.apply(reset(self.state), None)
        assert self.state.epoch == epoch + 1

    @rule(
        rids=st.lists(st.sampled_from(IDS), min_size=1, max_size=3, unique=True),
        phase=st.sampled_from(["prefill", "denoise", "decode"]),
    )
    def publish(self, rids: list[Any], phase: str) -> None:
        result = publish(self.state, rids, phase)
        if any(r not in self.ref.reqs for r in rids):
            assert isinstance(result, Failure) and result.failure().code.value == "UNKNOWN_REQUEST"
            return
        rows = [row for r in rids for row in self.ref.reqs[r]]
        refused = {
            "prefill": any(row["computed"] >= row["len"] for row in rows),
            "denoise": any(not row["diff"] for row in rows),
            "decode": any(row["diff"] for row in rows),
        }[phase]
        if refused:
            assert isinstance(result, Failure) and result.failure().code.value == "INVALID", result
            return
        meta = result.unwrap().effect
        assert result.unwrap().state is self.state
        assert meta.generation == self.state.generation
        expected_rows = [(r, i) for r in rids for i in range(len(self.ref.reqs[r]))]
        assert [(m.request_id, m.row) for m in meta.rows] == expected_rows
        for m in meta.rows:
            row = self.ref.reqs[m.request_id][m.row]
            if phase == "prefill":
                assert (m.kv_start_pos, m.seq_len) == (row["computed"], row["len"])
            elif phase == "decode":
                assert (m.kv_start_pos, m.query_len) == (row["len"] - 1, 1)
            blocks = row["blocks"][0]
            assert list(m.slots) == [
                blocks[p // self.ref.bs] * self.ref.bs + p % self.ref.bs
                for p in range(m.kv_start_pos, m.kv_start_pos + m.query_len)
            ]
            assert sum(s.q_end - s.q_start for s in m.segments) == m.query_len

    # -- invariants ------------------------------------------------------------
    @invariant()
    def agrees_with_reference(self) -> None:
        if not hasattr(self, "state"):
            return
        s, ref = self.state, self.ref
        assert free_queue(s) == ref.free
        assert s.free_blocks == len(ref.free)
        assert set(s.requests.keys()) == set(ref.reqs)
        for rid, rows in ref.reqs.items():
            assert request_blocks(s, rid) == tuple(tuple(tuple(g) for g in r["blocks"]) for r in rows)
            req = s.requests[rid]
            assert [s.row_len[x] for x in req.slots] == [r["len"] for r in rows]
            assert [s.row_computed[x] for x in req.slots] == [r["computed"] for r in rows]
        assert s.generation == ref.gen

    @invariant()
    def pool_is_whole(self) -> None:
        if not hasattr(self, "state"):
            return
        assert check_invariants(self.state) == []
        held = [
            b for rid in self.state.requests.keys() for row in request_blocks(self.state, rid) for g in row for b in g
        ]
        assert len(held) == len(set(held)), "a block is in two live rows (no prefix cache here)"

    @invariant()
    def generations_never_go_back_and_old_snapshots_never_change(self) -> None:
        if hasattr(self, "state"):
            self.max_gen = check_history(self.state, self.history, self.max_gen)


def check_history(state: KVState, history: list[tuple[KVState, str]], max_gen: int) -> int:
    """Generations never go back, and old snapshots never change; the new high-water mark."""
    assert state.generation >= max_gen
    for old, d in history:
        assert digest(old) == d, "an old snapshot changed"
    return state.generation


test_core_state_machine = CoreMachine.TestCase  # examples and steps: the Hypothesis profile (conftest)
test_core_state_machine.pytestmark = [pytest.mark.slow]
