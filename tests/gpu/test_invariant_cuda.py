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


# Llama-8B's products (in, out) where an H100's cuBLAS changes a row's bits with the row count inside 8-512 rows
# (the output projection past 16 rows, the down projection past 64: bench/gpu_rows.py --shape llama-8b), and one
# where it keeps them (q/k/v)
BIG_SHAPES = [(4096, 4096), (14336, 4096), (4096, 6144)]


@pytest.mark.parametrize("k, n", BIG_SHAPES, ids=[f"{k}x{n}" for k, n in BIG_SHAPES])
def test_a_probed_product_keeps_a_rows_bits_at_real_sizes(k: int, n: int) -> None:
    """``ProbedProduct`` (a batch-invariant engine's products on CUDA) measures each weight's range and keeps every
    row's bits at every row count, from any offset, where the plain product does not."""
    from pagedkv.shell.invariant import PROBED_ROWS, ProbedProduct, plain_product

    gen = torch.Generator(device="cuda").manual_seed(k + n)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    x = torch.randn(1100, k, device="cuda", generator=gen).bfloat16()
    product = ProbedProduct(*PROBED_ROWS)
    whole = product(x, w)
    for m in (1, 7, 8, 9, 16, 17, 24, 40, 64, 65, 128, 300, 512, 513, 1000):
        for at in (0, 5):
            assert torch.equal(product(x[at : at + m], w), whole[at : at + m]), (m, at, product.ranges)
    plain = [torch.equal(plain_product(x[:m], w)[:8], plain_product(x[:8], w)) for m in (8, 24, 128, 512)]
    print(f"{k}x{n}: probed range {product.ranges}, the plain product's rows kept at 8/24/128/512 rows: {plain}")
