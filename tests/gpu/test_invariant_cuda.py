"""Batch invariance on CUDA (issue 50): issue 50's table on the real SmolLM2 weights, 48 chat prompts x 64 greedy
tokens with their logprobs, CUDA graphs on: with ``batch_invariant`` every company (a full batch, batch 7, overlap,
drafts alone and batched, a pool that preempts, prompts chunked) gives every request the tokens and the logprob
bits it got alone, in bf16 and in fp16. (The default path's column and the costs: ``bench/invariance.py``.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

from pagedkv.models.llama import Llama  # noqa: E402
from pagedkv.models.tokenizer import Tokenizer  # noqa: E402
from pagedkv.shell.sampling import SamplingParams  # noqa: E402
from tests.invariance_rig import chat_prompts, table  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_request_is_identical_to_alone_in_every_company(dtype: torch.dtype) -> None:
    model, meta = Llama.smollm2(device="cuda", dtype=dtype)
    tok = Tokenizer(meta)
    prompts = chat_prompts(tok, 48)
    c = model.config
    pool = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * 48 * 100 // 3  # (a third of what 48 x ~100 need)
    lines = table(model, tok, prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0), pool,
                  batch_invariant=True)  # fmt: skip
    assert [line["identical"] for line in lines] == [48] * len(lines), lines
    assert any(line["preempted"] for line in lines)
