"""Sampling: a token for every sampled row of a step, on the logits' device, in one pass.

Greedy rows take the argmax. A sampled row scales by its temperature, keeps its top-k and its
top-p nucleus, and draws by the exponential race: the token with the largest ``p / E``, where
``E`` is an exponential variate that a counter-based hash gives for (the request's seed, how many
tokens it has drawn, the token id). The noise depends on nothing else, so a seeded request draws
the same tokens batched or alone, on any batch order, and no generator object is kept: the whole
batch is sampled with a few tensor operations and one device-to-host copy (``sample_batch``).
``sample`` is the same rule for one row, written plainly; tests hold the two equal.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.core.errors import shown
from pagedkv.shell.transfer import to_device

_M32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None  # per request: the same seed, the same tokens
    stop: tuple[str, ...] = ()


def params_problem(params: object) -> str | None:
    """What is wrong with ``params`` for the engine (a field it cannot sample with), or None.

    >>> params_problem(SamplingParams(seed=2**70))
    'seed must be an integer in [0, 2**63) or None, got 1180591620717411303424'
    """
    if not isinstance(params, SamplingParams):
        return f"sampling parameters must be SamplingParams, got {type(params).__name__}"
    p = params
    checks = (
        ("max_tokens", type(p.max_tokens) is int and 1 <= p.max_tokens < 1 << 63, "an integer in [1, 2**63)"),
        ("temperature", isinstance(p.temperature, (int, float)) and not isinstance(p.temperature, bool)
         and math.isfinite(p.temperature) and p.temperature >= 0, "a finite number >= 0"),
        ("top_k", type(p.top_k) is int and 0 <= p.top_k < 1 << 31, "an integer in [0, 2**31)"),
        ("top_p", isinstance(p.top_p, (int, float)) and not isinstance(p.top_p, bool) and 0 < p.top_p <= 1,
         "a number in (0, 1]"),
        ("seed", p.seed is None or (type(p.seed) is int and 0 <= p.seed < 1 << 63), "an integer in [0, 2**63) or None"),
        ("stop", isinstance(p.stop, tuple) and all(type(x) is str and x for x in p.stop), "a tuple of non-empty strings"),
    )  # fmt: skip
    for name, ok, what in checks:
        if not ok:
            return f"{name} must be {what}, got {shown(getattr(p, name)):.60}"
    return None


def request_seed(request_id: object, params: SamplingParams) -> int:
    """The request's seed: its own, or one drawn from its id (the same id, the same draws, in any process).

    >>> request_seed("a", SamplingParams(seed=7)), request_seed("a", SamplingParams()) == request_seed("a", SamplingParams())
    (7, True)
    """
    return params.seed if params.seed is not None else zlib.crc32(str(request_id).encode())


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) in int64 arithmetic; multipliers stay below
    2**31, so no product of 32-bit values overflows."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x5BD1E995) & _M32
    x = ((x ^ (x >> 13)) * 0x27D4EB2F) & _M32
    return x ^ (x >> 16)


def race_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) float32 exponential variates, a function of (seed, counter, token id) only.

    >>> e = race_noise(torch.tensor([1, 1]), torch.tensor([0, 0]), 5)
    >>> bool(torch.equal(e[0], e[1])) and bool((e > 0).all())
    True
    """
    key = _mix(_mix(seeds.to(torch.int64) & _M32) ^ (counters.to(torch.int64) & _M32))
    ids = _mix(torch.arange(vocab, dtype=torch.int64, device=seeds.device) * 0x9E3779B1)
    bits = _mix(key[:, None] ^ ids[None, :]) >> 8  # 24 uniform bits
    return -torch.log((bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24)))


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, counter: int) -> int:
    """One row's token: greedy at temperature 0; else temperature, top-k, top-p, and the race drawn
    with the noise of (seed, counter)."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_k > 0:
        kth = torch.topk(probs, min(params.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p * sorted_p.sum()
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[idx[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    dev = logits.device
    noise = race_noise(torch.tensor([seed], device=dev), torch.tensor([counter], device=dev), probs.numel())[0]
    return int(torch.argmax(probs / noise))


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                 counters: Sequence[int]) -> torch.Tensor:  # fmt: skip
    """Every row's token at once, on ``logits``' device: (rows,) int64, row ``i`` as
    ``sample(logits[i], params[i], seeds[i], counters[i])`` gives it. No host sync."""
    out = torch.argmax(logits, dim=-1)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if not drawn:
        return out
    dev = logits.device
    ps = [params[i] for i in drawn]
    rows = to_device(drawn, torch.int64, dev)
    temps = to_device([p.temperature for p in ps], torch.float32, dev)
    probs = torch.softmax(logits[rows].float() / temps[:, None], dim=-1)
    noise = race_noise(to_device([seeds[i] for i in drawn], torch.int64, dev),
                       to_device([counters[i] for i in drawn], torch.int64, dev), probs.shape[1])  # fmt: skip
    if any(p.top_k > 0 or p.top_p < 1.0 for p in ps):
        vocab = probs.shape[1]
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        k = to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps], torch.int64, dev)
        kth = sorted_p.gather(1, (k - 1)[:, None])
        sorted_p = torch.where(sorted_p >= kth, sorted_p, torch.zeros_like(sorted_p))  # ties with the k-th stay
        top_p = to_device([p.top_p for p in ps], torch.float32, dev)[:, None]
        keep = (torch.cumsum(sorted_p, 1) - sorted_p < top_p * sorted_p.sum(1, keepdim=True)) | (top_p >= 1.0)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        best = torch.argmax(sorted_p / noise.gather(1, order), dim=1)
        chosen = order.gather(1, best[:, None])[:, 0]
    else:
        chosen = torch.argmax(probs / noise, dim=1)
    return out.index_copy(0, rows, chosen)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to the first of the request's stop strings that it holds (each checked in order)."""
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return text
