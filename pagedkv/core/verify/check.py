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

from returns.result import Failure

from pagedkv.core.verify.invariants import admission_violations, check_invariants, copy_violations
from pagedkv.core.store.state import KVState, free_queue, initial_state
from pagedkv.core.store.tails import packed_known
from pagedkv.core.outputs.effects import takes_generation
from pagedkv.core.verify.alphabet import CheckConfig, Event, default_alphabet
from pagedkv.core.verify.record import end_event, policy_keys


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
            known = None if record.ids is None else packed_known(record.ids, tail)
            rows.append((row_len[slot], computed[slot], layout, tuple(groups), known, record.hashes, record.pending))
        requests.append((rid, req.extra_keys, req.keys.first, req.keys.content, req.cache_epoch == epoch, tuple(rows)))
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
        _host_key(s),
    )


def _host_key(s: KVState) -> tuple[Any, ...]:
    """The host tier up to a renaming of slots and ticks: its entries in LRU order (the order decides which goes
    next), how many slots are still unused, and its use table's counts in LRU order."""
    tier = s.host
    if not len(tier) and not tier.uses:
        return ()
    order = sorted(tier.entries.items(), key=lambda kv: kv[1][1])
    uses = tuple((h, n) for h, (n, _) in sorted(tier.uses.items(), key=lambda kv: kv[1][1]))  # (in LRU order)
    return tuple(k for k, _ in order), s.config.host_blocks - tier.next_slot + len(tier.spare), uses


def _id_key(r: Any) -> tuple[str, Any]:
    return (type(r).__name__, r)


PROGRESS_EVERY = 1024


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
    progress: Callable[[CheckResult], None] | None = None,
) -> CheckResult:
    """Explore breadth first; stop at the first violation, the state bound or the depth bound.
    ``progress`` sees the result so far every ``PROGRESS_EVERY`` new states and at each new depth.

    >>> r = check(CheckConfig(usable_blocks=2, requests=1, window=None))
    >>> (r.states, r.exhaustive, r.violation)
    (219, True, [])
    """
    events = alphabet if alphabet is not None else default_alphabet(cfg)
    start = initial_state(cfg.cache_config())
    parents: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any] | None] = {canonical_key(start): None}
    result = CheckResult(states=1, violation=invariants(start))
    if result.violation:
        result.trace = _trace(cfg, parents, canonical_key(start))
        return result
    frontier = [(start, canonical_key(start))]
    while frontier:
        if cfg.max_depth is not None and result.depth >= cfg.max_depth:
            return result
        nxt: list[tuple[KVState, tuple[Any, ...]]] = []
        for state, key in frontier:
            if _expand(cfg, state, key, events, invariants, parents, result, nxt, progress):
                return result
        frontier = nxt
        if frontier:
            result.depth += 1
            if progress is not None:
                progress(result)
    result.exhaustive = True
    return result


def _expand(
    cfg: CheckConfig,
    state: KVState,
    key: tuple[Any, ...],
    events: list[Event],
    invariants: Callable[[KVState], list[str]],
    parents: dict[Any, Any],
    result: CheckResult,
    nxt: list[tuple[KVState, tuple[Any, ...]]],
    progress: Callable[[CheckResult], None] | None,
) -> bool:
    """Every event applied to ``state``: new states into ``nxt`` (and ``parents``), each checked; True when the
    search stops here (a violation, the state bound)."""
    for ev in events:
        outcome = ev.apply(state)
        if outcome is None:
            continue
        result.transitions += 1
        if isinstance(outcome, Failure):  # a refusal returns no state: the caller keeps the old one
            wrong = _judged(ev, state, outcome)  # unless it should not have been refused
            if wrong:
                result.depth += 1
                result.violation = wrong
                result.trace = _trace(cfg, parents, key, ev.to_json(state))
                return True
            continue
        step = outcome.unwrap()
        new = step.state
        k2 = canonical_key(new)
        if k2 in parents:
            continue
        parents[k2] = (key, ev.to_json(state))
        result.states += 1
        broken = invariants(new) + _judged(ev, state, outcome) + _generation_rule(ev, state, step)
        broken += copy_violations(state, step.effect, new)
        if broken:
            result.depth += 1
            result.violation, result.trace = broken, _trace(cfg, parents, k2)
            return True
        nxt.append((new, k2))
        if progress is not None and result.states % PROGRESS_EVERY == 0:
            progress(result)
        if result.states >= cfg.max_states:
            result.depth += 1
            return True
    return False


def _generation_rule(ev: Event, state: KVState, step: Any) -> list[str]:
    """A transition takes a new generation exactly when it changes a block layout (``takes_generation``)."""
    must, new = takes_generation(step.effect), step.state
    if must is True and new.generation <= state.generation:
        return [f"{ev.name} changed a block layout without a new generation"]
    if must is False and new.generation != state.generation:
        return [f"{ev.name} took a generation without a layout change"]
    return []


def _judged(ev: Event, state: KVState, outcome: Any) -> list[str]:
    """An admission's outcome against the admission count (``admission_violations``); other events: []."""
    if ev.spec is None:
        return []
    if isinstance(outcome, Failure):  # (an event's spec is the alphabet's: checked when it was built)
        return admission_violations(state, ev.spec, None, outcome.failure().code.value, checked=True)
    return admission_violations(state, ev.spec, outcome.unwrap().state, None, checked=True)


def _trace(cfg: CheckConfig, parents: dict[Any, Any], key: tuple[Any, ...], last: Any = None) -> list[str]:
    """The trace that reaches ``key`` (then ``last``, a refused event), its header and its end record."""
    events: list[Any] = [] if last is None else [last]
    link = parents[key]
    while link is not None:
        key, ev = link
        events.extend(reversed(ev) if isinstance(ev, list) else (ev,))  # (reversed below, with the rest)
        link = parents[key]
    c = cfg.cache_config()
    groups = [{"name": g.name, "kind": g.kind.value, **({"window": g.window} if g.window else {})} for g in c.groups]
    header = {
        "pagedkv_trace": 1,
        "config": {
            "block_size": c.block_size,
            "num_blocks": c.num_blocks,
            "groups": groups,
            "enable_prefix_caching": c.enable_prefix_caching,
            "max_rows_per_request": c.max_rows_per_request,
            "max_model_len": c.max_model_len,
            **policy_keys(c),
            "end_record": True,
        },
    }
    return [json.dumps(header)] + [json.dumps(e) for e in reversed(events)] + [json.dumps(end_event(len(events)))]
