"""What the model checker explores: its configuration (``CheckConfig``) and its alphabet, the
events it applies in every state.

Each event has a name, how it acts on a state (None: it does not apply there) and its
line in a trace (contract v1), so that a counterexample replays with ``pagedkv replay``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from returns.result import Result

from pagedkv.core.rules.admission import admit, turn_away
from pagedkv.core.rules.commit import cache_ahead, commit
from pagedkv.core.config import CacheConfig, GroupSpec
from pagedkv.core.rules.decode import decode_step
from pagedkv.core.rules.destination import mark_ready
from pagedkv.core.errors import KVError
from pagedkv.core.rules.growth import Placeholders, append
from pagedkv.core.rules.kinds import GroupKind
from pagedkv.core.rules.placeholders import fill, truncate
from pagedkv.core.rules.release import release, reset_prefix_cache
from pagedkv.core.spec import RequestSpec, RowSpec, check_request_spec
from pagedkv.core.store.state import KVState, Step
from pagedkv.core.store.tails import Awaiting
from pagedkv.core.verify.record import keys_json, row_json


@dataclass(frozen=True, slots=True)
class CheckConfig:
    """The configuration explored and the bounds of the search."""

    block_size: int = 2
    # the default search: 15,353 states, about 20 s on one core (6 blocks, 3 requests: 109,476 states, 2 minutes)
    usable_blocks: int = 5
    requests: int = 4  # request ids "A", "B", ...
    max_rows: int = 2
    window: int | None = 2  # a sliding-window group beside the full one; None: full only
    prefix_caching: bool = True
    max_model_len: int = 8
    max_states: int = 200_000
    max_depth: int | None = None
    destinations: bool = False  # also admit rows whose KV arrives from elsewhere (pending_tokens), and mark it ready
    mamba: bool = False  # a state (Mamba) group after the attention groups
    mamba_align: bool = False  # an align-mode state group (vLLM's mamba_cache_mode="align") after them
    free_queue: str = "tail"  # CacheConfig.free_queue: "vllm" puts freed blocks without a hash at the head
    reset_when_idle: bool = False  # CacheConfig.reset_prefix_cache "when_idle": refused while blocks are held
    cache_at_schedule: bool = False  # CacheConfig.caching_point "schedule", and a cache_ahead event per id
    duplicates: bool = False  # CacheConfig.cache_duplicates: every block that fills with a cached content cached
    long_prompts: bool = False  # also admit a prompt whose hit leaves window positions null (grown to from a chunk)
    ahead: bool = False  # rows that run ahead of their tokens: placeholders, their ids filling in, tail cuts
    hash_lookahead: int = 0  # CacheConfig.hash_lookahead: each block's hash covers the ids after it
    host_blocks: int = 0  # CacheConfig.host_blocks: evicted blocks kept in a host tier, hits there loaded back
    host_store_threshold: int = 0  # CacheConfig.host_store_threshold: the tier keeps contents seen in this many uses
    host_tracker_size: int = 64_000  # CacheConfig.host_tracker_size: the use table's size

    def cache_config(self) -> CacheConfig:
        groups: tuple[GroupSpec, ...] = (GroupSpec("full"),)
        if self.window is not None:
            groups += (GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=self.window),)
        if self.mamba:
            groups += (GroupSpec("mamba", GroupKind.MAMBA),)
        if self.mamba_align:
            groups += (GroupSpec("mamba_align", GroupKind.MAMBA_ALIGN),)
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.usable_blocks + 1,
            groups=groups,
            enable_prefix_caching=self.prefix_caching,
            max_rows_per_request=self.max_rows,
            max_model_len=self.max_model_len,
            free_queue=self.free_queue,
            reset_prefix_cache="when_idle" if self.reset_when_idle else "always",
            caching_point="schedule" if self.cache_at_schedule else "commit",
            cache_duplicates=self.duplicates,
            hash_lookahead=self.hash_lookahead,
            host_blocks=self.host_blocks,
            host_store_threshold=self.host_store_threshold,
            host_tracker_size=self.host_tracker_size,
        )


@dataclass(frozen=True, slots=True)
class Event:
    """One letter of the alphabet: a name, how it acts on a state, and its trace line there."""

    name: str
    apply: Callable[[KVState], Result[Step[Any], KVError] | None]  # None: cannot apply here (skipped)
    to_json: Callable[[KVState], dict[str, Any] | list[dict[str, Any]]]  # its trace line (or lines) there
    spec: RequestSpec | None = None  # an admission's spec: its outcome is judged (admission_violations)


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
    if cfg.long_prompts:  # [1, 1, 1] admitted as a chunk grows to it; a later admission hits two blocks of it
        rows.append(((RowSpec.of_tokens([1, 1, 1, 1, 2]),), ()))
    if cfg.ahead:  # admitted with a slot whose id comes later (draft padding, a lookahead slot)
        rows.append(((RowSpec.of_tokens([1, 1], placeholders=1),), ()))
    if cfg.destinations:  # AR -> DiT: the first tokens' KV arrives into reserved blocks, marked ready later
        rows.append(((RowSpec(4, tokens=(1, 1, 2, 2), pending_tokens=3),), ()))
    rows = [r for r in rows if len(r[0]) <= cfg.max_rows]
    ids = [chr(ord("A") + i) for i in range(cfg.requests)]
    events: list[Event] = []
    for rid in ids:
        for k, (spec_rows, extra) in enumerate(rows):
            spec = RequestSpec(rid, spec_rows, extra)
            events.append(Event(f"admit {rid} #{k}", _admit(spec), _const(_admit_json(spec)), spec))
            if cfg.free_queue == "vllm-omni" and cfg.window is None and not (cfg.mamba or cfg.mamba_align):
                # vLLM-Omni's refusal of a request that does not fit now (its rows tried and given back)
                turned = _const({**_admit_json(spec), "op": "turn_away"})
                events.append(Event(f"turn_away {rid} #{k}", _turn_away(spec), turned))
        for tok in (1, 2, None):  # None: a count, the token id unknown
            events.append(Event(f"append {rid} {tok}", _append(rid, tok), _append_json(rid, tok)))
        events.append(Event(f"commit {rid} all", _commit(rid, None), _commit_json(rid, None)))
        for tok in (1, None):  # the same states as commit-all then append, reached through decode_step
            events.append(Event(f"decode {rid} {tok}", _decode(rid, tok), _decode_json(rid, tok)))
        events.append(Event(f"commit {rid} +1", _commit(rid, 1), _commit_json(rid, 1)))
        if cfg.destinations:
            events.append(Event(f"ready {rid}", _ready(rid), _ready_json(rid)))
        if cfg.ahead:
            events += _ahead_events(rid)
        if cfg.cache_at_schedule:  # vLLM's caching point: the whole row planned, then a failed step
            events.append(Event(f"cache_ahead {rid}", _ahead(rid), _ahead_json(rid)))
            events.append(
                Event(
                    f"release {rid} error",
                    _release(rid, "error"),
                    _const({"op": "release", "request": rid, "reason": "error"}),
                )
            )
        events.append(
            Event(f"release {rid}", _release(rid), _const({"op": "release", "request": rid, "reason": "finished"}))
        )
    if cfg.prefix_caching:
        events.append(Event("reset_prefix_cache", reset_prefix_cache, _const({"op": "reset_prefix_cache"})))
    return events


def _ahead_events(rid: str) -> list[Event]:
    """A placeholder a row, one id filling in (two kinds), and a cut back to what is computed."""
    out = [
        Event(
            f"placeholder {rid}",
            lambda s: append(s, rid, [Placeholders(1)] * _nrows(s, rid)) if rid in s.requests else None,
            lambda s: {"op": "append", "request": rid, "placeholders": [1] * _nrows(s, rid)},
        )
    ]
    for tok in (1, 2):
        out.append(Event(f"fill {rid} {tok}", _fill(rid, tok), _fill_json(rid, tok)))
    out.append(
        Event(
            f"truncate {rid}", _cut(rid), lambda s: {"op": "truncate", "request": rid, "lengths": _cut_lengths(s, rid)}
        )
    )
    return out


def _fills(s: KVState, rid: str, tok: int) -> list[list[int]]:
    """One id for each row that awaits ids, none for the others."""
    return [[tok] if type(s.row_tail[x]) is Awaiting else [] for x in s.requests[rid].slots]


def _fill_json(rid: str, tok: int) -> Callable[[KVState], dict[str, Any]]:
    return lambda s: {"op": "fill", "request": rid, "tokens": _fills(s, rid, tok)}


def _fill(rid: str, tok: int) -> Callable[[KVState], Any]:
    def apply(s: KVState) -> Any:
        if rid not in s.requests or not any(_fills(s, rid, tok)):
            return None
        return fill(s, rid, _fills(s, rid, tok))

    return apply


def _cut_lengths(s: KVState, rid: str) -> list[int]:
    """Each row cut to what it computed: the lowest a caller may ask (refused where blocks are cached ahead)."""
    return [s.row_computed[x] for x in s.requests[rid].slots]


def _cut(rid: str) -> Callable[[KVState], Any]:
    def apply(s: KVState) -> Any:
        if rid not in s.requests:
            return None
        lengths = _cut_lengths(s, rid)
        if lengths == [s.row_len[x] for x in s.requests[rid].slots]:
            return None  # nothing to cut
        return truncate(s, rid, lengths)

    return apply


def _admit(spec: RequestSpec) -> Callable[[KVState], Any]:
    # admitting an id that is present is refused (DUPLICATE_REQUEST): skip it without the work. The spec's form is
    # checked once, here, as a scheduler checks a request when it arrives (admit's ``checked``)
    if check_request_spec(spec) is not None:
        raise ValueError(f"the alphabet's admission {spec} is malformed")
    return lambda s: None if spec.request_id in s.requests else admit(s, spec, checked=True)


def _turn_away(spec: RequestSpec) -> Callable[[KVState], Any]:
    return lambda s: None if spec.request_id in s.requests else turn_away(s, spec)


def _const(obj: dict[str, Any]) -> Callable[[KVState], dict[str, Any]]:
    return lambda s: obj


def _admit_json(spec: RequestSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"op": "admit", "request": spec.request_id, "rows": [row_json(r) for r in spec.rows]}
    out.update(keys_json(spec))
    if spec.max_hit is not None:
        out["max_hit"] = spec.max_hit
    return out


def _arriving(s: KVState, rid: str) -> int:
    req = s.requests.get(rid)
    return 0 if req is None else s.rows[req.slots[0]].pending[0]


def _ahead(rid: str) -> Callable[[KVState], Any]:
    def apply(s: KVState) -> Any:
        req = s.requests.get(rid)
        return None if req is None else cache_ahead(s, rid, [s.row_len[x] for x in req.slots])

    return apply


def _ahead_json(rid: str) -> Callable[[KVState], dict[str, Any]]:
    return lambda s: {"op": "cache_ahead", "request": rid, "through": [s.row_len[x] for x in s.requests[rid].slots]}


def _ready(rid: str) -> Callable[[KVState], Any]:
    """All of row 0's arriving KV is in (only where some is still pending)."""

    def apply(s: KVState) -> Any:
        req = s.requests.get(rid)
        if req is None or not s.rows[req.slots[0]].pending[1]:
            return None
        return mark_ready(s, rid, 0, 0, _arriving(s, rid))

    return apply


def _ready_json(rid: str) -> Callable[[KVState], dict[str, Any]]:
    return lambda s: {"op": "mark_ready", "request": rid, "row": 0, "start": 0, "end": _arriving(s, rid)}


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


def _release(rid: str, reason: str = "finished") -> Callable[[KVState], Any]:
    return lambda s: release(s, rid, reason) if rid in s.requests else None
