"""The model checker: every state reachable from the empty pool of a small
configuration, breadth first, with every invariant checked in every state.

States are deduplicated by a canonical key that renames block ids in order of
appearance (the free queue's order, then requests by id): two states that
differ only by which physical ids they use behave the same, so they are one
state. Monotone counters (generation, epoch, prefix metrics) are left out of
the key, which keeps the space finite; the generation rule is checked on every
transition instead. Breadth first means the first violation found has a
shortest event sequence; it comes back as a replayable trace (contract v1).

Pure like the rest of the core: the CLI (``pagedkv check``) times and prints.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from returns.result import Failure, Result

from pagedkv.core.config import CacheConfig, GroupKind, GroupSpec
from pagedkv.core.errors import KVError
from pagedkv.core.invariants import check_invariants
from pagedkv.core.spec import RequestSpec, RowSpec
from pagedkv.core.state import KVState, Step, free_queue, initial_state
from pagedkv.core.transitions import (
    Admitted, Appended, Committed, Decoded, Released, admit, append, commit, decode_step, release, reset_prefix_cache,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class CheckConfig:
    """The configuration explored and the bounds of the search."""

    block_size: int = 2
    usable_blocks: int = 6
    requests: int = 3  # request ids "A", "B", ...
    max_rows: int = 2
    window: int | None = 2  # a sliding-window group beside the full one; None: full only
    prefix_caching: bool = True
    max_model_len: int = 8
    max_states: int = 200_000
    max_depth: int | None = None

    def cache_config(self) -> CacheConfig:
        groups: tuple[GroupSpec, ...] = (GroupSpec("full"),)
        if self.window is not None:
            groups += (GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=self.window),)
        return CacheConfig(block_size=self.block_size, num_blocks=self.usable_blocks + 1, groups=groups,
                           enable_prefix_caching=self.prefix_caching, max_rows_per_request=self.max_rows,
                           max_model_len=self.max_model_len)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Event:
    """One letter of the alphabet: a name, how it acts on a state, and its trace line there."""

    name: str
    apply: Callable[[KVState], Result[Step[Any], KVError] | None]  # None: cannot apply here (skipped)
    to_json: Callable[[KVState], dict[str, Any] | list[dict[str, Any]]]  # its trace line (or lines) there


def default_alphabet(cfg: CheckConfig) -> list[Event]:
    """Admit each id with a few specs (shared prefixes, CFG rows, a diffusion row), append a
    token of two kinds, commit all or one more token, a decode step (commit all, then append:
    the batch transition engines run every step), release, and reset the prefix cache."""
    rows = [
        ((RowSpec.of_tokens([1, 1, 1]),), ()),
        ((RowSpec.of_tokens([1, 1, 2]),), ()),
        ((RowSpec.of_tokens([1, 1, 1]),), ("salt",)),  # same tokens, other content: must not hit
        ((RowSpec(2),), ()),  # no token ids: never hits
        ((RowSpec.of_tokens([1, 1]), RowSpec.of_tokens([1, 2])), ()),  # CFG-like rows
        ((RowSpec.of_tokens([1, 1, 2, 2], prefix_len=2, target_len=2),), ()),  # a diffusion row
    ]
    rows = [r for r in rows if len(r[0]) <= cfg.max_rows]
    ids = [chr(ord("A") + i) for i in range(cfg.requests)]
    events: list[Event] = []
    for rid in ids:
        for k, (spec_rows, extra) in enumerate(rows):
            spec = RequestSpec(rid, spec_rows, extra)
            events.append(Event(f"admit {rid} #{k}", _admit(spec), _const(_admit_json(spec))))
        for tok in (1, 2, None):  # None: a count, the token id unknown
            events.append(Event(f"append {rid} {tok}", _append(rid, tok), _append_json(rid, tok)))
        events.append(Event(f"commit {rid} all", _commit(rid, None), _commit_json(rid, None)))
        for tok in (1, None):  # the same states as commit-all then append, reached by the decode fast paths
            events.append(Event(f"decode {rid} {tok}", _decode(rid, tok), _decode_json(rid, tok)))
        events.append(Event(f"commit {rid} +1", _commit(rid, 1), _commit_json(rid, 1)))
        events.append(Event(f"release {rid}", _release(rid), _const({"op": "release", "request": rid,
                                                                     "reason": "finished"})))  # fmt: skip
    if cfg.prefix_caching:
        events.append(Event("reset_prefix_cache", reset_prefix_cache, _const({"op": "reset_prefix_cache"})))
    return events


def _admit(spec: RequestSpec) -> Callable[[KVState], Any]:
    # admitting an id that is present is refused (DUPLICATE_REQUEST): skip it without the work
    return lambda s: None if spec.request_id in s.requests else admit(s, spec)


def _const(obj: dict[str, Any]) -> Callable[[KVState], dict[str, Any]]:
    return lambda s: obj


def _admit_json(spec: RequestSpec) -> dict[str, Any]:
    rows = []
    for r in spec.rows:
        row: dict[str, Any] = {"tokens": list(r.tokens)} if r.tokens is not None else {"num_tokens": r.num_tokens}
        if r.prefix_len is not None:
            row.update(prefix_len=r.prefix_len, target_len=r.target_len)
        rows.append(row)
    out: dict[str, Any] = {"op": "admit", "request": spec.request_id, "rows": rows}
    if spec.extra_keys:
        out["extra_keys"] = list(spec.extra_keys)
    return out


def _nrows(s: KVState, rid: str) -> int:
    req = s.requests.get(rid)
    return len(req.slots) if req is not None else 1


def _append(rid: str, tok: int | None) -> Callable[[KVState], Any]:
    grow = [1] if tok is None else [[tok]]
    return lambda s: append(s, rid, grow * _nrows(s, rid)) if rid in s.requests else None


def _append_json(rid: str, tok: int | None) -> Callable[[KVState], dict[str, Any]]:
    if tok is None:
        return lambda s: {"op": "append", "request": rid, "num_tokens": [1] * _nrows(s, rid)}
    return lambda s: {"op": "append", "request": rid, "tokens": [[tok]] * _nrows(s, rid)}


def _targets(s: KVState, rid: str, step: int | None) -> list[int]:
    req = s.requests.get(rid)
    if req is None:
        return [0]
    return [s.row_len[x] if step is None else min(s.row_computed[x] + step, s.row_len[x]) for x in req.slots]


def _commit(rid: str, step: int | None) -> Callable[[KVState], Any]:
    return lambda s: commit(s, rid, _targets(s, rid, step)) if rid in s.requests else None


def _commit_json(rid: str, step: int | None) -> Callable[[KVState], dict[str, Any]]:
    return lambda s: {"op": "commit", "request": rid, "computed": _targets(s, rid, step)}


def _decode(rid: str, tok: int | None) -> Callable[[KVState], Any]:
    tokens = None if tok is None else [tok]
    return lambda s: decode_step(s, [rid], tokens) if rid in s.requests else None


def _decode_json(rid: str, tok: int | None) -> Callable[[KVState], list[dict[str, Any]]]:
    """A decode step in trace contract v1: the commit of every row, then the append it equals."""
    return lambda s: [_commit_json(rid, None)(s), _append_json(rid, tok)(s)]


def _release(rid: str) -> Callable[[KVState], Any]:
    return lambda s: release(s, rid, "finished") if rid in s.requests else None


def canonical_key(s: KVState) -> tuple[Any, ...]:
    """The state up to a renaming of block ids and its monotone counters."""
    free = free_queue(s)
    rename = dict(zip(free, range(1, len(free) + 1)))  # block ids in order of appearance: the free queue,
    rename[0] = 0  # then each request's (by id)
    requests = []
    row_len, computed, records, tails = list(s.row_len), list(s.row_computed), list(s.rows), list(s.row_tail)
    epoch = s.cache_epoch
    for rid in sorted(s.requests.keys(), key=_id_key):
        req = s.requests[rid]
        rows = []
        for slot, layout in zip(req.slots, req.layouts):
            record = records[slot]
            groups = []
            for ids in record.blocks:
                for b in ids:
                    if b not in rename:
                        rename[b] = len(rename)
                groups.append(tuple(map(rename.__getitem__, ids)))
            tail = tails[slot]
            known = None if record.ids is None else record.ids + tail if tail else record.ids  # the ids, packed
            rows.append((row_len[slot], computed[slot], layout, tuple(groups), known, record.hashes, record.pending))
        requests.append((rid, req.extra_keys, req.cache_epoch == epoch, tuple(rows)))
    n = s.config.num_blocks
    if len(rename) < n:  # a broken state may hold ids nobody lists; keep them apart
        for b in range(1, n):
            if b not in rename:
                rename[b] = len(rename)
    cache = s.cache
    refcount = list(s.refcount)
    return (
        tuple(map(cache.key_of, free)) if len(cache) else (),  # which free blocks still hold a hash, in order
        tuple(requests),
        tuple(sorted((k, rename[b]) for k, b in cache.items())) if len(cache) else (),
        tuple(map(refcount.__getitem__, rename)),  # in renamed order: a dict keeps insertion order
    )


def _id_key(r: Any) -> tuple[str, Any]:
    return (type(r).__name__, r)


def _takes_generation(effect: object) -> bool | None:
    """Must this transition take a generation (True), must it not (False), or either (None)?"""
    if isinstance(effect, (Admitted, Released)):
        return True
    if isinstance(effect, (Appended, Decoded)):
        return bool(effect.allocations)
    if isinstance(effect, Committed):
        return None  # takes one exactly when a window let blocks go; the window invariant covers the layout
    return False


@dataclass(slots=True)
class CheckResult:
    states: int = 0
    depth: int = 0
    transitions: int = 0
    exhaustive: bool = False
    violation: list[str] = field(default_factory=list)  # what broke, empty when nothing did
    trace: list[str] = field(default_factory=list)  # the shortest trace to it (JSON lines, header first)


def check(
    cfg: CheckConfig = CheckConfig(),
    *,
    alphabet: list[Event] | None = None,
    invariants: Callable[[KVState], list[str]] = check_invariants,
) -> CheckResult:
    """Explore breadth first; stop at the first violation, the state bound or the depth bound.

    >>> r = check(CheckConfig(usable_blocks=2, requests=1, window=None))
    >>> (r.states, r.exhaustive, r.violation)
    (219, True, [])
    """
    events = alphabet if alphabet is not None else default_alphabet(cfg)
    start = initial_state(cfg.cache_config())
    parents: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any] | None] = {canonical_key(start): None}
    result = CheckResult(states=1)
    broken = invariants(start)
    if broken:
        result.violation, result.trace = broken, _trace(cfg, parents, canonical_key(start))
        return result
    frontier = [(start, canonical_key(start))]
    while frontier:
        if cfg.max_depth is not None and result.depth >= cfg.max_depth:
            return result
        nxt: list[tuple[KVState, tuple[Any, ...]]] = []
        for state, key in frontier:
            for ev in events:
                outcome = ev.apply(state)
                if outcome is None:
                    continue
                result.transitions += 1
                if isinstance(outcome, Failure):
                    continue  # a refusal returns no state: the caller keeps the old one
                step = outcome.unwrap()
                new = step.state
                k2 = canonical_key(new)
                if k2 in parents:
                    continue
                parents[k2] = (key, ev.to_json(state))
                result.states += 1
                broken = invariants(new)
                must = _takes_generation(step.effect)
                if must is True and new.generation <= state.generation:
                    broken = broken + [f"{ev.name} changed a block layout without a new generation"]
                elif must is False and new.generation != state.generation:
                    broken = broken + [f"{ev.name} took a generation without a layout change"]
                if broken:
                    result.depth += 1
                    result.violation, result.trace = broken, _trace(cfg, parents, k2)
                    return result
                nxt.append((new, k2))
                if result.states >= cfg.max_states:
                    result.depth += 1
                    return result
        frontier = nxt
        if frontier:
            result.depth += 1
    result.exhaustive = True
    return result


def _trace(cfg: CheckConfig, parents: dict[Any, Any], key: tuple[Any, ...]) -> list[str]:
    events: list[dict[str, Any]] = []
    link = parents[key]
    while link is not None:
        key, ev = link
        events.extend(reversed(ev) if isinstance(ev, list) else (ev,))  # (reversed below, with the rest)
        link = parents[key]
    c = cfg.cache_config()
    groups = [{"name": g.name, "kind": g.kind.value, **({"window": g.window} if g.window else {})} for g in c.groups]
    header = {"pagedkv_trace": 1, "config": {
        "block_size": c.block_size, "num_blocks": c.num_blocks, "groups": groups,
        "enable_prefix_caching": c.enable_prefix_caching, "max_rows_per_request": c.max_rows_per_request,
        "max_model_len": c.max_model_len}}  # fmt: skip
    return [json.dumps(header)] + [json.dumps(e) for e in reversed(events)]

