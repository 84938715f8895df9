"""Issue 50's table: each prompt served alone, then the same prompts served in the company of others (a full batch,
a small one, overlapped scheduling, n-gram drafts alone and batched, a pool so small that requests are preempted
and recomputed, prompts chunked): how many requests get exactly the tokens (and, with ``logprobs``, the logprob
bits) they got alone, and where the first divergence is. ``bench/invariance.py`` prints it on a device;
tests/shell/test_invariant.py asserts it on the CPU."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams

TOPICS = [
    "the moon", "paper", "rivers", "bread", "chess", "glass", "bees", "rain", "maps", "salt", "clocks", "snow",
    "ships", "tea", "bridges", "wool", "volcanoes", "ink", "owls", "copper", "deserts", "music", "soap", "trains",
]  # fmt: skip
ASKS = ["Tell me one fact about {}.", "Write a short sentence about {}."]
DRAFTS = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def chat_prompts(tok: Any, n: int) -> list[list[int]]:
    """``n`` chat prompts (a question or an ask about a topic), as the model's chat template lays them out."""
    texts = [ASKS[i // len(TOPICS) % len(ASKS)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


@dataclass(frozen=True)
class Company:
    """How the prompts are served together: a name for the table and the engine's arguments."""

    name: str
    batch: int  # prompts handed to the engine at once (the rest after them)
    engine: dict[str, Any]


def companies(n: int, preempting_pool: int) -> list[Company]:
    """The table's rows: ``n`` prompts; ``preempting_pool`` the KV bytes of a pool that preempts at batch ``n``."""
    return [
        Company(f"batch {n}", n, {"max_num_seqs": n}),
        Company("batch 7", n, {"max_num_seqs": 7}),
        Company(f"batch {n}, overlap", n, {"max_num_seqs": n, "async_scheduling": True}),
        Company("batch 1, n-gram drafts (4)", 1, {"max_num_seqs": 1, "speculative_config": DRAFTS}),
        Company(f"batch {n}, n-gram drafts (4)", n, {"max_num_seqs": n, "speculative_config": DRAFTS}),
        Company(f"batch {n}, a pool that preempts", n, {"max_num_seqs": n, "kv_cache_memory_bytes": preempting_pool}),
        Company(f"batch {n}, prompts chunked (16 tokens a step)", n, {"max_num_seqs": n, "max_num_batched_tokens": 16}),
    ]


def serve(
    model: Any, tok: Any, prompts: list[list[int]], batch: int, params: SamplingParams, **engine: Any
) -> tuple[list[tuple[Any, ...]], dict[str, float]]:
    """Each prompt's (token ids, logprobs), served ``batch`` at a time on one engine, and the run's figures
    (seconds, steps, preemptions, CPython's collections a step: GC on, as engines run)."""
    eng = Engine(model, tok, **{"kv_cache_memory_bytes": 64 << 20, **engine})
    gc0 = sum(g["collections"] for g in gc.get_stats())
    t0 = time.perf_counter()
    out = []
    for k in range(0, len(prompts), batch):
        out += eng.generate([("", p, params) for p in prompts[k : k + batch]])
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    got = [(tuple(c.token_ids), repr(c.logprobs)) for c in out]
    seconds = time.perf_counter() - t0
    collections = sum(g["collections"] for g in gc.get_stats()) - gc0
    steps = eng.stats.steps
    return got, {"seconds": seconds, "steps": steps, "preempted": eng.stats.preemptions, "gc": collections / steps}


def first_divergence(alone: tuple[Any, ...], together: tuple[Any, ...]) -> int | None:
    """The first token index where the two runs' token ids differ, or None."""
    a, b = alone[0], together[0]
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def table(
    model: Any, tok: Any, prompts: list[list[int]], params: SamplingParams, preempting_pool: int, **engine: Any
) -> list[dict[str, Any]]:
    """One line a company: requests whose token ids are the ones they got alone (``tokens``), those whose logprobs'
    bits are too (``identical``), the first divergences of token ids, the run's figures."""
    alone, _ = serve(model, tok, prompts, 1, params, max_num_seqs=1, **engine)
    lines = []
    for company in companies(len(prompts), preempting_pool):
        got, figures = serve(model, tok, prompts, company.batch, params, **{**engine, **company.engine})
        firsts = [first_divergence(a, g) for a, g in zip(alone, got)]
        diverged = [f for f in firsts if f is not None]
        lines.append(
            {
                "served as": company.name,
                "tokens": len(prompts) - len(diverged),
                "identical": sum(a == g for a, g in zip(alone, got)),
                "first": min(diverged) if diverged else None,
                "median first": statistics.median(diverged) if diverged else None,
                **figures,
            }
        )
    return lines


def step_seconds(model: Any, tok: Any, batch: int, prompt_len: int, tokens: int, **engine: Any) -> dict[str, float]:
    """Median seconds of a decode step at ``batch`` rows and of a step that carries prompt tokens (prefill-heavy:
    ``batch`` prompts of ``prompt_len`` tokens arriving together), GC on, the device synchronised each step."""
    eng = Engine(
        model,
        tok,
        **{"kv_cache_memory_bytes": 64 << 20, "max_num_seqs": batch, "max_num_batched_tokens": 2048, **engine},
        time_steps=True,
    )
    prompts = [[1 + (i * 7 + j) % 500 for j in range(prompt_len)] for i in range(batch)]
    eng.generate([("", p, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)) for p in prompts])
    times = eng.step_times or []
    decode = [s for rows, prefill, s in times if prefill == 0 and rows == batch]
    prefill = [s for _, prefill, s in times if prefill > 0]
    return {
        "decode": statistics.median(decode) if decode else float("nan"),
        "prefill": statistics.median(prefill) if prefill else float("nan"),
    }
