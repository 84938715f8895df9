"""vLLM's gpu_memory_utilization on a CUDA device (issue 46): the engine's pages take what the fraction leaves
once the weights and a forward of the largest step are counted, and the engine serves within it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.cuda

from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams  # noqa: E402


@pytest.mark.parametrize("fraction", [0.05, 0.2])
def test_the_pages_take_what_the_fraction_leaves(fraction: float) -> None:
    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    base = torch.cuda.memory_allocated(dev)  # (whatever the process held before: not this engine's)
    model = random_llama(replace(SMOLLM2_SHAPES, num_layers=4), dtype=torch.bfloat16, device=dev)
    eng = Engine(model, IdTokenizer(), gpu_memory_utilization=fraction, max_num_batched_tokens=4096, cuda_graphs=False)
    pages = eng.rank.sizing.total_bytes
    torch.cuda.reset_peak_memory_stats(dev)
    done = eng.generate(
        [("", list(range(1, 200 + 7 * i)), SamplingParams(temperature=0.0, max_tokens=16)) for i in range(8)]
    )
    peak = torch.cuda.max_memory_allocated(dev) - base
    assert all(len(c.token_ids) == 16 for c in done)
    assert pages > 0.5 * (fraction * total - (torch.cuda.memory_allocated(dev) - base - pages))  # most of what is left
    assert peak <= fraction * total * 1.02, (peak, fraction * total)  # the engine stays within its fraction
