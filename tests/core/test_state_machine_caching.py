"""The core with prefix caching and windowed groups, against a content oracle.

The oracle tracks what KV each block holds: when a row's owner computes a full
block, the block holds (group, the row's token prefix up to the block's end,
extra keys). A prefix hit must hand a row blocks whose content is exactly its
own prefix: a hash kept after its block was evicted, a block freed while still
visible, a hit evicted by its own admission all break that. Beside it, the
structural invariants: the pool is whole, the cache index is a bijection, a
windowed group's live range never shows the null block, failures change nothing.
"""

from __future__ import annotations

from itertools import count
from typing import Any

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from returns.result import Failure, Success

from pagedkv.core import (
    Admitted,
    Appended,
    CacheConfig,
    Committed,
    Decoded,
    GroupKind,
    GroupSpec,
    KVState,
    Placeholders,
    Released,
    RequestSpec,
    RowSpec,
    Truncated,
    admit,
    append_decode,
    append_many,
    cache_ahead,
    commit,
    digest,
    fill,
    initial_state,
    release,
    request_blocks,
    reset,
    reset_prefix_cache,
    truncate,
)
from pagedkv.core.rules.placeholders import cut_floor
from pagedkv.core.store.tails import known_ids
from pagedkv.core.store.txn import Txn
from pagedkv.core.verify.invariants import admission_violations, check_invariants
from tests.core.sm_decode_rules import IDS, DecodeRules
from tests.core.test_state_machine import check_history

BASES = [[0, 1, 0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]]  # shared prefixes hit
GROUPINGS = {
    "full": (GroupSpec("full"),),
    "full+swa": (GroupSpec("full"), GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=3)),
    "full+local": (GroupSpec("full"), GroupSpec("local", GroupKind.CHUNKED_LOCAL, chunk=4)),
    "swa": (GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=2),),
    "full+swa+mamba": (
        GroupSpec("full"),
        GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=3),
        GroupSpec("mamba", GroupKind.MAMBA),
    ),
}
_opaque = count()


class _Everything:
    """Stands in for st.data() in `finish`: draws each row's full length."""

    def __init__(self, state: KVState, req: Any) -> None:
        self.lens = iter([state.row_len[s] for s in req.slots])

    def draw(self, strategy: object) -> int:
        return next(self.lens)


class CachingMachine(DecodeRules, RuleBasedStateMachine):
    @initialize(
        bs=st.sampled_from([1, 2]),
        usable=st.integers(6, 32),
        grouping=st.sampled_from(sorted(GROUPINGS)),
        free_queue=st.sampled_from(["tail", "vllm"]),
        reset_policy=st.sampled_from(["always", "when_idle"]),
        caching_point=st.sampled_from(["commit", "schedule"]),
        block_hash=st.sampled_from(["blake2b", "sha256_cbor"]),
        duplicates=st.booleans(),
    )
    def setup(
        self,
        bs: int,
        usable: int,
        grouping: str,
        free_queue: str,
        reset_policy: str,
        caching_point: str,
        block_hash: str,
        duplicates: bool,
    ) -> None:
        self.cfg = CacheConfig(
            block_size=bs,
            num_blocks=usable + 1,
            groups=GROUPINGS[grouping],
            enable_prefix_caching=True,
            free_queue=free_queue,
            reset_prefix_cache=reset_policy,
            caching_point=caching_point,
            block_hash=block_hash,
            cache_duplicates=duplicates,
        )
        self.state = initial_state(self.cfg)
        self.content: dict[int, object] = {}  # block id -> what its KV holds
        self.tokens: dict[Any, list[list[int] | None]] = {}  # per request, per row: known token ids
        self.extra: dict[Any, tuple[str, ...]] = {}
        self.history: list[tuple[KVState, str]] = []
        self.max_gen = 0

    def step(self, result: Any) -> Any:
        before = digest(self.state)
        if isinstance(result, Failure):
            assert result.failure().message
            assert digest(self.state) == before, "a refused transition changed the state"
            return None
        assert isinstance(result, Success)
        self.history = (self.history + [(self.state, before)])[-3:]
        old, self.state = self.state, result.unwrap().state
        effect = result.unwrap().effect
        several = effect if isinstance(effect, tuple) else (effect,)  # release_many, commit_many
        changed_layout = any(
            isinstance(e, (Admitted, Released))
            or (isinstance(e, (Appended, Decoded)) and bool(e.allocations))
            or (isinstance(e, Truncated) and bool(e.freed_blocks))
            or (isinstance(e, Committed) and self._nulled(old, self.state))
            for e in several
        )
        if changed_layout:
            assert self.state.generation > old.generation, "a layout change reused a generation"
        elif not hasattr(effect, "released"):
            assert self.state.generation == old.generation, "a generation was taken without a layout change"
        return effect

    @staticmethod
    def _nulled(old: KVState, new: KVState) -> bool:
        """Did a commit put the null block anywhere the old state had a real one?"""
        return any(
            0 in ids and ids != old.row_blocks[slot][g]
            for req in new.requests.values()
            for slot in req.slots
            for g, ids in enumerate(new.row_blocks[slot])
        )

    def expected_content(self, rid: Any, row: int, group: int, j: int) -> object:
        toks = self.tokens[rid][row]
        req = self.state.requests[rid]
        layout = req.layouts[row]
        end = (j + 1) * self.cfg.block_size
        if toks is None or len(toks) < end or (layout.prefix_len is not None and end > layout.prefix_len):
            return ("opaque", next(_opaque))  # unknown ids, or a diffusion target rewritten every step
        return (group, tuple(toks[:end]), self.extra[rid])

    @rule(rid=st.sampled_from(IDS), data=st.data(), extra=st.sampled_from([(), ("img:1",)]))
    def admit(self, rid: Any, data: st.DataObject, extra: tuple[str, ...]) -> None:
        rows = []
        for _ in range(data.draw(st.integers(1, 2))):
            base = data.draw(st.sampled_from(BASES))
            toks = base[: data.draw(st.integers(0, 8))] + data.draw(st.lists(st.integers(0, 1), max_size=2))
            toks = toks or [0]
            kind = data.draw(st.sampled_from(["ids", "ids", "count", "diffusion"]))
            if kind == "count":
                rows.append(RowSpec(len(toks)))
            elif kind == "diffusion" and len(toks) >= 2:
                t = data.draw(st.integers(1, len(toks) - 1))
                rows.append(RowSpec.of_tokens(toks, prefix_len=len(toks) - t, target_len=t))
            else:
                rows.append(RowSpec.of_tokens(toks))
        spec = RequestSpec(rid, tuple(rows), extra)
        result = admit(self.state, spec)
        event(f"admit {'ok' if isinstance(result, Success) else result.failure().code.value}")
        ok = isinstance(result, Success)  # judged by the admission count written apart from admission's own
        assert (
            admission_violations(
                self.state, spec, result.unwrap().state if ok else None, None if ok else result.failure().code.value
            )
            == []
        )
        effect = self.step(result)
        if effect is None:
            return
        if any(effect.cached_tokens):
            event("admit with a prefix hit")
        if effect.events:
            event("admit evicted a cached block")
        self.tokens[rid] = [list(r.tokens) if r.tokens is not None else None for r in rows]
        self.extra[rid] = extra
        bs = self.cfg.block_size
        for i, (cached, row_blocks) in enumerate(zip(effect.cached_tokens, effect.blocks)):
            hit = cached // bs
            for g, ids in enumerate(row_blocks):
                if (
                    self.cfg.groups[g].kind is GroupKind.MAMBA
                ):  # the row's state: a saved one holds exactly the hit's tokens
                    if hit:
                        event("admit took a saved state over")
                        assert self.content.get(ids[-1]) == self.state_content(rid, i, g, cached), (
                            f"state block {ids[-1]} holds {self.content.get(ids[-1])!r}"
                        )
                    else:
                        self.content[ids[-1]] = self.state_content(rid, i, g, 0)
                    continue
                for j, b in enumerate(ids):
                    if j < hit and b:
                        assert self.content.get(b) == self.expected_content(rid, i, g, j), (
                            f"hit block {b} at position {j} holds {self.content.get(b)!r}"
                        )
                    elif j >= hit:
                        self.content[b] = None  # fresh: garbage until computed

    def state_content(self, rid: Any, row: int, group: int, computed: int) -> object:
        """What a state holds after ``computed`` tokens of a row: those tokens (the state absorbed them)."""
        toks = self.tokens[rid][row]
        if toks is None or len(toks) < computed:
            return ("opaque", next(_opaque))
        return ("state", group, tuple(toks[:computed]), self.extra[rid])

    def _fresh_after_append(self, before: dict[Any, Any]) -> None:
        for rid in self.state.requests.keys():
            for i, row in enumerate(request_blocks(self.state, rid)):
                for g, ids in enumerate(row):
                    if self.cfg.groups[g].kind is GroupKind.MAMBA:
                        continue  # the state moved, nothing fresh
                    old = before.get(rid, ((),) * 0)
                    old_len = len(old[i][g]) if old else 0
                    for b in ids[old_len:]:
                        self.content[b] = None

    def _snapshot(self) -> dict[Any, Any]:
        return {rid: request_blocks(self.state, rid) for rid in self.state.requests.keys()}

    @rule(
        items=st.lists(
            st.tuples(
                st.sampled_from(IDS),
                st.lists(st.one_of(st.integers(0, 2), st.lists(st.integers(0, 1), max_size=3)), min_size=1, max_size=2),
            ),
            min_size=1,
            max_size=2,
        )
    )
    def append(self, items: list[tuple[Any, list[Any]]]) -> None:
        self._append(items, append_many(self.state, items))

    def _append(self, items: list[tuple[Any, list[Any]]], result: Any) -> None:
        before = self._snapshot()
        lens = {rid: [self.state.row_len[s] for s in self.state.requests[rid].slots] for rid in before}
        if self.step(result) is None:
            return
        for rid, growth in items:
            for i, item in enumerate(growth):
                toks = self.tokens[rid][i]
                if toks is not None and len(toks) == lens[rid][i] and isinstance(item, list):
                    toks.extend(item)
                lens[rid][i] += item if isinstance(item, int) else len(item)
        self._fresh_after_append(before)

    @rule(rid=st.sampled_from(IDS), k=st.integers(1, 3))
    def placeholders(self, rid: Any, k: int) -> None:
        """Positions whose ids come later (a step planned before the last one's tokens, draft slots)."""
        req = self.state.requests.get(rid)
        before = self._snapshot()
        if self.step(append_many(self.state, [(rid, [Placeholders(k)] * (len(req.slots) if req else 1))])) is not None:
            event("placeholders")
            self._fresh_after_append(before)  # (the known ids stay a prefix: self.tokens is unchanged)

    @rule(rid=st.sampled_from(IDS), data=st.data())
    def fill_ids(self, rid: Any, data: st.DataObject) -> None:
        """The ids of the next positions that await theirs arrive: the model now knows what the forward computed
        there (it had the ids on the device), so blocks it completes hold that content."""
        req = self.state.requests.get(rid)
        if req is None:
            assert isinstance(fill(self.state, rid, [[1]]), Failure)
            return
        rows = []
        for s in req.slots:
            tail = self.state.row_tail[s]
            gap = self.state.row_len[s] - known_ids(self.state.rows[s], tail) if tail is not None else 0
            rows.append(data.draw(st.lists(st.integers(0, 1), max_size=gap + 1)))  # (one too many is refused)
        if self.step(fill(self.state, rid, rows)) is None:
            return
        event("ids filled in")
        bs = self.cfg.block_size
        for i, (s, ids) in enumerate(zip(req.slots, rows)):
            toks = self.tokens[rid][i]
            if toks is None:
                continue
            toks.extend(ids)
            blocks = request_blocks(self.state, rid)[i]
            for j in range(min(self.state.row_computed[s], len(toks)) // bs):  # computed, and now known
                for g, group_ids in enumerate(blocks):
                    if (
                        group_ids[j]
                        and not self.cfg.groups[g].kind is GroupKind.MAMBA
                        and self.content.get(group_ids[j]) is not None
                    ):
                        self.content[group_ids[j]] = self.expected_content(rid, i, g, j)

    @rule(rid=st.sampled_from(IDS), data=st.data())
    def cut_back(self, rid: Any, data: st.DataObject) -> None:
        """Rejected drafts: each row cut back, never below what it computed or cached (else refused)."""
        req = self.state.requests.get(rid)
        if req is None:
            return
        txn = Txn(self.state)
        lengths = [data.draw(st.integers(max(0, cut_floor(txn, s) - 1), self.state.row_len[s])) for s in req.slots]
        if self.step(truncate(self.state, rid, lengths)) is None:
            return
        event("rows cut back")
        for i, n in enumerate(lengths):
            toks = self.tokens[rid][i]
            if toks is not None:
                del toks[n:]

    @rule(rids=st.lists(st.sampled_from(IDS), min_size=1, max_size=3))
    def decode(self, rids: list[Any]) -> None:
        before = self._snapshot()
        if self.step(append_decode(self.state, rids)) is not None:
            self._fresh_after_append(before)

    @rule(rid=st.sampled_from(IDS), data=st.data())
    def commit(self, rid: Any, data: st.DataObject) -> None:
        req = self.state.requests.get(rid)
        if req is None:
            assert isinstance(commit(self.state, rid, [1]), Failure)
            return
        old = [self.state.row_computed[s] for s in req.slots]
        new = [data.draw(st.integers(c, self.state.row_len[s])) for c, s in zip(old, req.slots)]
        self._commit(rid, new)

    def _commit(self, rid: Any, new: list[int]) -> None:
        req = self.state.requests[rid]
        old = [self.state.row_computed[s] for s in req.slots]
        blocks = request_blocks(self.state, rid)
        effect = self.step(commit(self.state, rid, new))
        if effect is None:
            return
        if effect.freed_blocks:
            event("commit let window blocks go")
        bs = self.cfg.block_size
        for i, (c0, c1) in enumerate(zip(old, new)):
            for g, ids in enumerate(blocks[i]):  # a state absorbs what was computed, if it held what came before
                if self.cfg.groups[g].kind is GroupKind.MAMBA:
                    valid = self.content.get(ids[-1]) == self.state_content(rid, i, g, c0)
                    self.content[ids[-1]] = self.state_content(rid, i, g, c1) if valid else ("opaque", next(_opaque))
            for j in range(c0 // bs, c1 // bs):  # blocks that became full and computed now
                for g, ids in enumerate(blocks[i]):
                    if self.cfg.groups[g].kind is GroupKind.MAMBA:
                        continue
                    if ids[j]:
                        self.content[ids[j]] = self.expected_content(rid, i, g, j)

    @rule(rid=st.sampled_from(IDS), data=st.data(), fails=st.booleans())
    def planned_step(self, rid: Any, data: st.DataObject, fails: bool) -> None:
        """vLLM's caching point: the step's blocks are cached when it is planned (another request may hit them
        then: the same forward writes them); then the step computes them (commit) or fails (release with
        error, which must take them out of the cache: their KV was never written)."""
        req = self.state.requests.get(rid)
        if req is None or self.cfg.caching_point != "schedule":
            return
        old = [self.state.row_computed[s] for s in req.slots]
        through = [data.draw(st.integers(c, self.state.row_len[s])) for c, s in zip(old, req.slots)]
        blocks = request_blocks(self.state, rid)
        if self.step(cache_ahead(self.state, rid, through)) is None:
            return
        bs = self.cfg.block_size
        ahead = []
        for i, (c0, c1) in enumerate(zip(old, through)):
            for j in range(c0 // bs, c1 // bs):
                for g, ids in enumerate(blocks[i]):
                    if (
                        ids[j]
                        and not self.cfg.groups[g].kind is GroupKind.MAMBA
                        and self.state.cache.key_of(ids[j]) is not None
                    ):
                        ahead.append(ids[j])
        if fails:
            event("a planned step failed after caching ahead")
            for b in ahead:
                self.content[b] = ("never written", next(_opaque))  # a later hit on it would read garbage
            self.release(rid, "error")
        else:
            self._commit(rid, through)

    @rule(rid=st.sampled_from(IDS), data=st.data())
    def admit_again(self, rid: Any, data: st.DataObject) -> None:
        self.admit(rid, data, ())

    @rule(rid=st.sampled_from(IDS))
    def finish(self, rid: Any) -> None:
        """Compute everything, then release: what leaves cached blocks in the free queue."""
        req = self.state.requests.get(rid)
        if req is None:
            return
        data = _Everything(self.state, req)
        self.commit(rid, data)  # type: ignore[arg-type]
        self.release(rid, "finished")

    @rule(first=st.sampled_from(IDS), second=st.sampled_from(IDS), data=st.data())
    def reuse(self, first: Any, second: Any, data: st.DataObject) -> None:
        """Admit, compute and finish one request, then admit another on the same prompt base."""
        self.admit(first, data, ())
        self.finish(first)
        self.admit(second, data, ())

    @rule(rid=st.sampled_from(IDS), reason=st.sampled_from(["finished", "cancelled", "error", "preempted"]))
    def release(self, rid: Any, reason: str) -> None:
        self.step(release(self.state, rid, reason))

    @rule()
    def reset_prefix_cache(self) -> None:
        idle = self.state.free_blocks == self.cfg.usable_blocks
        done = self.step(reset_prefix_cache(self.state))
        if self.cfg.reset_prefix_cache == "when_idle" and not idle:
            assert done is None, "a reset while blocks are held, under when_idle"
        else:
            assert done is not None and len(self.state.cache) == 0

    @rule()
    def reset(self) -> None:
        self.step(reset(self.state))
        self.content.clear()

    # -- invariants ------------------------------------------------------------
    @invariant()
    def pool_is_whole_and_cache_is_a_bijection(self) -> None:
        if hasattr(self, "state"):
            assert check_invariants(self.state) == []

    @invariant()
    def window_live_ranges_hold_real_blocks(self) -> None:
        if not hasattr(self, "state"):
            return
        s = self.state
        bs = s.config.block_size
        for rid, req in s.requests.items():
            for i, slot in enumerate(req.slots):
                layout = req.layouts[i]
                c = s.row_computed[slot]
                future = min(c, layout.prefix_len) if layout.prefix_len is not None else c
                for g, ids in enumerate(s.row_blocks[slot]):
                    assert len(ids) == -(-s.row_len[slot] // bs)
                    gs = s.config.groups[g]
                    if gs.kind is GroupKind.MAMBA:  # one state block, at the last position
                        assert ids[-1] and not any(ids[:-1]), f"state group {g}: {ids}"
                        continue
                    # written out here, apart from the code: the first key a query at `future` or later reads
                    if gs.kind is GroupKind.SLIDING_WINDOW:
                        lowest = future - gs.window + 1  # type: ignore[operator]
                    elif gs.kind is GroupKind.CHUNKED_LOCAL:
                        lowest = future // gs.chunk * gs.chunk  # type: ignore[operator]
                    else:
                        lowest = 0
                    for j, b in enumerate(ids):
                        visible = (j + 1) * bs - 1 >= lowest
                        assert (b != 0) == visible, f"group {g} block {j} of {ids}: visible={visible}"

    @invariant()
    def shared_blocks_hold_the_same_prefix(self) -> None:
        if not hasattr(self, "state"):
            return
        where: dict[int, tuple[int, int]] = {}
        for rid in self.state.requests.keys():
            for row in request_blocks(self.state, rid):
                for g, ids in enumerate(row):
                    for j, b in enumerate(ids):
                        if b:
                            assert where.setdefault(b, (g, j)) == (g, j), "one block at two positions or groups"

    @invariant()
    def history_and_generations(self) -> None:
        if hasattr(self, "state"):
            self.max_gen = check_history(self.state, self.history, self.max_gen)


test_caching_state_machine = CachingMachine.TestCase  # examples and steps: the Hypothesis profile (conftest)
test_caching_state_machine.pytestmark = [pytest.mark.slow]
