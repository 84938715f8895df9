"""The caching state machine's batch rules (``tests/core/test_state_machine_caching.py``): each decode
fast path (``append_decode``, ``decode_step``, ``commit_decode``, ``release_many``) against its
general form, one request after another, on the machine's state and content oracle."""

from __future__ import annotations

from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import rule
from returns.result import Failure, Success

from pagedkv.core import (
    KVState,
    append_decode,
    append_many,
    commit,
    commit_decode,
    commit_many,
    decode_step,
    digest,
    release,
    release_many,
)

IDS = ["a", "b", "c", "d", "e"]


class DecodeRules:
    """Rules a ``CachingMachine`` mixes in: it supplies ``state``, ``step``, ``_append``, ``append``
    and ``_commit``."""

    state: KVState
    step: Any
    _append: Any
    append: Any
    _commit: Any

    def _running(self, data: st.DataObject) -> list[Any]:
        """Mostly admitted requests that can grow (a decode batch), now and then anything."""
        growing = sorted(
            rid for rid, req in self.state.requests.items() if not any(l.is_diffusion for l in req.layouts)
        )
        if growing and data.draw(st.integers(0, 9)):
            return data.draw(st.lists(st.sampled_from(growing), min_size=1, max_size=4))
        return data.draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=3))

    @rule(data=st.data())
    def decode_with_ids(self, data: st.DataObject) -> None:
        """append_decode with the sampled ids: the same state as append_many with one id a row."""
        rids = self._running(data)
        toks = [data.draw(st.integers(0, 1)) for _ in rids]
        items = [(r, [[t]] * _rows(self.state, r)) for r, t in zip(rids, toks)]
        fast, general = append_decode(self.state, rids, toks), append_many(self.state, items)
        event(f"append_decode with ids {'ok' if isinstance(fast, Success) else fast.failure().code.value}")
        _same(fast, general)
        self._append(items, fast)

    @rule(data=st.data(), ids=st.booleans())
    def decode_step(self, data: st.DataObject, ids: bool) -> None:
        """One decode step: each row committed through its length, then each grown by the sampled token;
        the same as a commit per request, one after another, then an append per request."""
        rids = self._running(data)
        toks = [data.draw(st.integers(0, 1)) for _ in rids] if ids else None
        fast = decode_step(self.state, rids, toks)
        event(f"decode_step {'ok' if isinstance(fast, Success) else fast.failure().code.value}")
        chain: Any = Success((self.state, ()))
        for rid in rids:  # the commits
            chain = chain.bind(
                lambda se, r=rid: commit(se[0], r, _lengths(se[0], r)).map(
                    lambda c, ev=se[1]: (c.state, ev + c.effect.events)
                )
            )
        for k, rid in enumerate(rids):  # then the appends
            chain = chain.bind(
                lambda se, r=rid, k=k: append_many(se[0], [(r, _one_each(se[0], r, toks, k))]).map(
                    lambda a, ev=se[1]: (a.state, ev + a.effect.events)
                )
            )
        if isinstance(fast, Failure) or isinstance(chain, Failure):
            assert isinstance(fast, Failure) and isinstance(chain, Failure), (fast, chain)
            assert fast.failure().code == chain.failure().code and fast.failure().message == chain.failure().message
            self.step(fast)
            return
        assert digest(fast.unwrap().state) == digest(chain.unwrap()[0])
        assert fast.unwrap().effect.events == chain.unwrap()[1]
        # drive the content oracle through the same commits and appends, then keep the fast state
        for rid in rids:
            self._commit(rid, _lengths(self.state, rid))
        for k, rid in enumerate(rids):
            self.append([(rid, _one_each(self.state, rid, toks, k))])
        assert digest(self.state) == digest(fast.unwrap().state)
        self.state = fast.unwrap().state

    @rule(data=st.data())
    def commit_decode(self, data: st.DataObject) -> None:
        rids = self._running(data)
        items = [
            (r, [self.state.row_len[x] for x in self.state.requests[r].slots] if r in self.state.requests else [1])
            for r in rids
        ]
        fast, general = commit_decode(self.state, rids), commit_many(self.state, items)
        _same(fast, general)
        if isinstance(fast, Success):
            for rid, computed in items:
                self._commit(rid, computed)
            assert digest(self.state) == digest(fast.unwrap().state)
            self.state = fast.unwrap().state

    @rule(rids=st.lists(st.sampled_from(IDS), min_size=1, max_size=3, unique=True))
    def release_several(self, rids: list[Any]) -> None:
        fast = release_many(self.state, rids, "finished")
        chain: Any = Success(self.state)
        for rid in rids:
            chain = chain.bind(lambda s, r=rid: release(s, r, "finished").map(lambda x: x.state))
        _same(fast, chain.map(lambda s: type("S", (), {"state": s})()))
        self.step(fast)


def _lengths(state: KVState, rid: Any) -> list[int]:
    """Each row's length (a commit through it); an unknown id: a count the commit refuses for the id."""
    req = state.requests.get(rid)
    return [state.row_len[x] for x in req.slots] if req is not None else [1]


def _one_each(state: KVState, rid: Any, toks: list[int] | None, k: int) -> list[Any]:
    """One token for every row of ``rid``: ``toks[k]``, or a count."""
    return [[toks[k]] if toks is not None else 1] * _rows(state, rid)


def _rows(state: KVState, rid: Any) -> int:
    req = state.requests.get(rid)
    return len(req.slots) if req is not None else 1


def _same(fast: Any, general: Any) -> None:
    """A batch fast path and its general form agree: both refused alike, or the same state."""
    if isinstance(fast, Failure) or isinstance(general, Failure):
        assert isinstance(fast, Failure) and isinstance(general, Failure), (fast, general)
        assert (fast.failure().code, fast.failure().message) == (general.failure().code, general.failure().message)
    else:
        assert digest(fast.unwrap().state) == digest(general.unwrap().state)
