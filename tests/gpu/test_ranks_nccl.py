"""Two GPUs through NCCL: the tensor-parallel engine's tokens equal one GPU's (bench/gpu_ranks.py
times it)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.cuda

from pagedkv.app.ranks import run_ranks
from pagedkv.shell.sampling import SamplingParams


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_two_gpus_give_one_gpus_tokens() -> None:
    rng = random.Random(0)
    reqs = [
        (f"p{i}", [rng.randrange(49152) for _ in range(48)], SamplingParams(temperature=0.0, max_tokens=8))
        for i in range(4)
    ]
    out = {}
    for world in (1, 2):
        results = run_ranks(world, reqs, backend="nccl", weights="random", timeout_s=300, kv_cache_memory_bytes=1 << 30)
        assert all("error" not in r for r in results), [r.get("error") for r in results]
        out[world] = results[0]["completions"]
    assert out[1] == out[2]
