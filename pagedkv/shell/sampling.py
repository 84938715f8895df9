"""Sampling one token from a row's logits, and the stop rules of a request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None  # per request: the same seed, the same tokens
    stop: tuple[str, ...] = ()


def generator_for(request_id: object, params: SamplingParams) -> torch.Generator:
    """The request's own generator: its seed, or one drawn from its id (the same id, the same draws)."""
    seed = params.seed if params.seed is not None else hash(str(request_id)) & 0xFFFFFFFF
    return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Greedy at temperature 0; else temperature, top-k, top-p, drawn with the request's generator."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_k > 0:
        kth = torch.topk(probs, min(params.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p * sorted_p.sum()
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[idx[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to the first of the request's stop strings that it holds (each checked in order)."""
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return text
