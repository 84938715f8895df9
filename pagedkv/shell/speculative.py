"""Speculative decoding by n-gram prompt lookup, under vLLM's names (``speculative_config``).

Each step the engine proposes drafts for its decoding requests (``NgramProposer``: the tokens that followed
the latest earlier occurrence of the request's last n tokens, n from ``prompt_lookup_max`` down to
``prompt_lookup_min``), the scheduler plans them (``StepPlan.verify``), one forward computes every draft's
position, and ``accepted`` keeps the drafts the target's own samples agree with.

Verification samples each position exactly as decoding without drafts would (the same rule, seed and
counter: ``shell.sampling``) and accepts a draft while the sample equals it; the first sample that differs,
or the one after the last draft, is the request's next token. Greedy output is therefore token for token
the output without speculation, and so is seeded sampled output. Drafts here are deterministic (a point
mass q on the draft), and for such drafts this is the standard rejection rule: a draft d is accepted with
probability p(d) = min(1, p(d) / q(d)), and on rejection the token is drawn from the residual
max(0, p - q), renormalised (p without d), which is the target's own sample given that it is not d. The
distribution of every token is the target's.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.core.config import InvalidConfig
from pagedkv.core.store.state import request_blocks, request_generation

METHODS = ("ngram",)
MAX_DRAFTS = 64  # num_speculative_tokens at most: a verify row's query is 1 + drafts tokens


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` for n-gram prompt lookup (its fields, names and meanings)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    @staticmethod
    def of(raw: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a mapping (or its JSON text, as ``--speculative-config`` gives it): ``InvalidConfig`` on an
        unknown method or key or a value out of range, naming it.

        >>> SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens
        3
        >>> SpeculativeConfig.of({"method": "eagle"})
        Traceback (most recent call last):
        ...
        pagedkv.core.config.InvalidConfig: speculative_config method 'eagle' is not served: pagedkv's engine proposes drafts by n-gram prompt lookup ("ngram"); a draft model (eagle, medusa, mtp, draft_model) is not implemented
        """
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InvalidConfig(f"speculative_config is not JSON: {e}") from None
        if not isinstance(raw, Mapping):
            raise InvalidConfig(f"speculative_config must be a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(SpeculativeConfig.__dataclass_fields__))
        if unknown:
            raise InvalidConfig(
                f"speculative_config has unknown keys {unknown} (known: method, num_speculative_tokens,"
                " prompt_lookup_max, prompt_lookup_min)"
            )
        method = raw.get("method", "ngram")
        if method not in METHODS:
            raise InvalidConfig(
                f"speculative_config method {method!r} is not served: pagedkv's engine proposes drafts "
                'by n-gram prompt lookup ("ngram"); a draft model (eagle, medusa, mtp, draft_model) is '
                "not implemented"
            )
        k = raw.get("num_speculative_tokens", 4)
        hi = raw.get("prompt_lookup_max", 4)
        lo = raw.get("prompt_lookup_min", min(2, hi) if type(hi) is int else 2)
        for name, v, ok in (
            ("num_speculative_tokens", k, type(k) is int and 1 <= k <= MAX_DRAFTS),
            ("prompt_lookup_max", hi, type(hi) is int and hi >= 1),
            ("prompt_lookup_min", lo, type(lo) is int and 1 <= lo),
        ):
            if not ok:
                bound = f"an integer in [1, {MAX_DRAFTS}]" if name == "num_speculative_tokens" else "a positive integer"
                raise InvalidConfig(f"speculative_config {name} must be {bound}, got {v!r}")
        if lo > hi:
            raise InvalidConfig(f"speculative_config prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        return SpeculativeConfig(method, k, hi, lo)


class NgramProposer:
    """Drafts by prompt lookup, per request over its prompt and output (kept as packed 32-bit ids, extended
    as tokens come, so a proposal is a few ``bytes.rfind`` at C speed, never a scan in Python)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._ids: dict[Any, tuple[array[int], int]] = {}  # request -> (its ids, how many of its output they hold)

    def propose(self, rid: Any, prompt: Sequence[int], output: Sequence[int], most: int) -> tuple[int, ...]:
        """Up to ``most`` (and ``num_speculative_tokens``) drafts for the request whose ids are ``prompt`` +
        ``output``: what followed the latest earlier occurrence of its last n ids, the longest n first."""
        most = min(most, self.config.num_speculative_tokens)
        if most <= 0:
            return ()
        held = self._ids.get(rid)
        if held is None or held[1] > len(output):  # (a new request, or one served again from its start)
            ids = array("I", prompt)
            ids.extend(output)
        else:
            ids = held[0]
            ids.extend(output[held[1] :])
        self._ids[rid] = (ids, len(output))
        return lookup(ids, self.config.prompt_lookup_min, self.config.prompt_lookup_max, most)

    def keep(self, rids: Sequence[Any]) -> None:
        """Forget the ids of every request but ``rids`` (those that ended or wait)."""
        if len(self._ids) > len(rids):
            for rid in self._ids.keys() - set(rids):
                del self._ids[rid]


def lookup(ids: array[int], lo: int, hi: int, most: int) -> tuple[int, ...]:
    """The ``most`` ids after the latest earlier occurrence of the last n of ``ids`` (n from ``hi`` down to
    ``lo``; the suffix itself is not an occurrence), or () where none occurs.

    >>> lookup(array("I", [1, 2, 3, 4, 9, 1, 2, 3]), 2, 3, 2)
    (4, 9)
    >>> lookup(array("I", [5, 6, 7]), 1, 2, 3)
    ()
    """
    n_ids = len(ids)
    size = ids.itemsize
    data = ids.tobytes()
    for n in range(min(hi, n_ids - 1), lo - 1, -1):
        pattern = data[(n_ids - n) * size :]
        limit = (n_ids - 1) * size  # an occurrence ends before the last id: one id at least follows it
        while True:
            at = data.rfind(pattern, 0, limit)
            if at < 0:
                break
            if at % size == 0:  # (byte matches that straddle two ids are not occurrences)
                start = at // size + n
                return tuple(ids[start : start + most])
            limit = at + len(pattern) - 1  # the next one starts before this one
    return ()


def accepted(drafts: Sequence[int], samples: Sequence[int]) -> list[int]:
    """A verifying request's tokens: each draft while the target's sample at its position equals it, then the
    first sample that differs (or the sample after the last draft). ``samples`` has ``len(drafts) + 1`` ids.

    >>> accepted([4, 5, 6], [4, 5, 7, 8]), accepted([4], [4, 9]), accepted([4], [3, 9])
    ([4, 5, 7], [4, 9], [3])
    """
    out = []
    for d, s in zip(drafts, samples):
        out.append(s)
        if s != d:
            return out
    out.append(samples[len(drafts)])
    return out


class Speculation:
    """An engine's speculative decoding: the drafts it proposes before each plan, and the bookkeeping of a
    verify forward (which logits each row needs, which sample counters, which tokens it keeps)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config)

    def drafts(
        self, running: Sequence[Any], prefilling: frozenset[Any], requests: Mapping[Any, Any]
    ) -> dict[Any, tuple[int, ...]]:
        """Drafts for each decoding request (``requests``: the engine's ``Live`` records), at most what its
        ``max_tokens`` leaves after the token a verify always yields."""
        out: dict[Any, tuple[int, ...]] = {}
        for rid in running:
            if rid in prefilling:
                continue
            c = requests[rid].completion
            draft = self.proposer.propose(
                rid, c.prompt_token_ids, c.token_ids, requests[rid].params.max_tokens - len(c.token_ids) - 1
            )
            if draft:
                out[rid] = draft
        self.proposer.keep(running)
        return out

    @staticmethod
    def logits_rows(
        rows: Sequence[Any], verify: Mapping[Any, tuple[int, ...]], base: int
    ) -> tuple[list[int], dict[Any, int]]:
        """A varlen forward's rows (``RowMetadata``): the query tokens whose logits it returns (each row's
        last; every position of a row verifying drafts) and, per request, the first logits row it lands on
        (after ``base`` rows of earlier forwards; a verifying request's follow it)."""
        at: list[int] = []
        where: dict[Any, int] = {}
        offset = 0
        for row in rows:
            q = row.seq_len - row.kv_start_pos
            where[row.request_id] = base + len(at)
            at.extend(range(offset if row.request_id in verify else offset + q - 1, offset + q))
            offset += q
        return at, where

    @staticmethod
    def positions(
        samples: Sequence[Any],
        verify: Mapping[Any, tuple[int, ...]],
        where: Mapping[Any, int],
        requests: Mapping[Any, Any],
    ) -> tuple[list[int], list[Any], list[int]]:
        """Each sampled position's logits row (from each request's first, ``where``), request (its ``Live``) and
        counter (the tokens its request had drawn before it): a verify row's positions draw as the decodes
        without drafts would have, one after another."""
        pick: list[int] = []
        live: list[Any] = []
        counters: list[int] = []
        for rid in samples:
            q = 1 + len(verify.get(rid, ()))
            n = len(requests[rid].completion.token_ids)
            pick.extend(range(where[rid], where[rid] + q))
            live.extend([requests[rid]] * q)
            counters.extend(range(n, n + q))
        return pick, live, counters

    @staticmethod
    def tokens(samples: Sequence[Any], ids: Sequence[int], verify: Mapping[Any, tuple[int, ...]]) -> dict[Any, Any]:
        """What each sampled request takes: its token, or (verifying) the drafts accepted and the next token."""
        if not verify:
            return dict(zip(samples, ids))
        out: dict[Any, Any] = {}
        i = 0
        for rid in samples:
            draft = verify.get(rid)
            if draft is None:
                out[rid] = ids[i]
                i += 1
            else:
                out[rid] = accepted(draft, ids[i : i + len(draft) + 1])
                i += len(draft) + 1
        return out

    @staticmethod
    def cut(worker: Any, kv: Any, verify: Sequence[tuple[Any, tuple[int, ...]]]) -> None:
        """After the output: the rows the core cut back (rejected drafts' blocks gone) cut in the worker too."""
        for rid, _ in verify:
            if rid in kv.requests:
                worker.cut(rid, request_blocks(kv, rid)[0], request_generation(kv, rid))
