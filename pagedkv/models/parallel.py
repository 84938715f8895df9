"""Tensor parallelism applied to a model from outside it (gpt-fast's way): ``shard(model, rank,
world)`` returns this rank's part, and the model code never sees ranks.

Q/K/V and gate/up are split by output rows, the output and down projections by input columns,
their partial sums added across ranks with an all-reduce (the model's ``reduce`` hook). Query
heads are split into contiguous, as even as possible ranges; each rank keeps the KV heads its
query heads read (SmolLM2's 9 heads and 3 KV heads: 3 ranks hold 3 and 1 each; with 2 ranks the
middle KV head is replicated on both), with an explicit head map.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.distributed as dist

from pagedkv.models.llama import Llama, fuse_layers


def head_plan(num_heads: int, num_kv_heads: int, world: int, rank: int) -> tuple[list[int], list[int], tuple[int, ...]]:
    """(query heads, KV heads kept, local KV index of each query head) of ``rank``.

    >>> head_plan(9, 3, 2, 0), head_plan(9, 3, 2, 1)
    (([0, 1, 2, 3, 4], [0, 1], (0, 0, 0, 1, 1)), ([5, 6, 7, 8], [1, 2], (0, 1, 1, 1)))
    """
    sizes = [num_heads // world + (1 if r < num_heads % world else 0) for r in range(world)]
    start = sum(sizes[:rank])
    q = list(range(start, start + sizes[rank]))
    per_kv = num_heads // num_kv_heads
    kv = sorted({h // per_kv for h in q})
    return q, kv, tuple(kv.index(h // per_kv) for h in q)


def _split(n: int, world: int, rank: int) -> slice:
    sizes = [n // world + (1 if r < n % world else 0) for r in range(world)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _all_reduce(partial: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(partial)  # row-parallel output and down projections: sum the shards
    return partial


def shard(model: Llama, rank: int, world: int) -> Llama:
    """This rank's part of ``model`` (its weights narrowed, its pages for its KV heads only).

    The full model is left as it was; embeddings, norms and the LM head are shared, not copied.
    """
    c = model.config
    q_heads, kv_heads, kv_index = head_plan(c.num_heads, c.num_kv_heads, world, rank)
    part = copy.copy(model)
    part.config = replace(c, num_kv_heads=len(kv_heads))  # this rank's pages hold its KV heads
    part.n_heads, part.n_kv_heads, part.kv_index = len(q_heads), len(kv_heads), kv_index
    part.reduce = _all_reduce
    part._places = None  # noqa: SLF001 - its attention specs follow its own head map
    hd = c.head_dim

    def rows(w: torch.Tensor, heads: list[int]) -> torch.Tensor:
        return torch.cat([w[h * hd : (h + 1) * hd] for h in heads])

    ff = _split(c.intermediate_size, world, rank)
    part.layers = []
    for L in model.layers:
        o_cols = torch.cat([L["o"][:, h * hd : (h + 1) * hd] for h in q_heads], dim=1)
        part.layers.append(
            {
                "ln1": L["ln1"],
                "ln2": L["ln2"],
                "q": rows(L["q"], q_heads),
                "k": rows(L["k"], kv_heads),
                "v": rows(L["v"], kv_heads),
                "o": o_cols,
                "gate": L["gate"][ff],
                "up": L["up"][ff],
                "down": L["down"][:, ff],
                **{k: L[k] for k in ("q_norm", "k_norm", "o_bias") if k in L},  # per head or after the sum: whole
                **{
                    f"{k}_bias": rows(L[f"{k}_bias"], q_heads if k == "q" else kv_heads)
                    for k in "qkv"
                    if f"{k}_bias" in L
                },
            }
        )
    fuse_layers(part.layers)
    return part
