"""Batch invariance on the CPU (issue 50, ``shell.invariant``): each piece keeps a row's bits whatever the batch
(products at every row count, split attention whatever other rows share the call), and the engine gives a request
the tokens and the logprob bits it gets alone in every company of issue 50's table (tests/invariance_rig.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedkv.core.config import InvalidConfig
from pagedkv.shell.attention.torch_ref import SPLIT_KEYS, split_attention
from pagedkv.shell.engine_args import EngineArgs
from pagedkv.shell.invariant import PRODUCT_ROWS, ProbedProduct, agreeing_rows, row_norm, row_product
from pagedkv.shell.sampling import SamplingParams
from tests.invariance_rig import chat_prompts, table

# SmolLM2's products (in, out): q/k/v, o, gate/up, down, the LM head
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
COUNTS = [1, 2, 3, 5, 7, 9, 11, 13, 16, 17, 31, 64, 100, 257]


@pytest.mark.parametrize("k, n", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_a_product_keeps_a_rows_bits_at_every_row_count(k: int, n: int) -> None:
    """The CPU's rows rule (``PRODUCT_ROWS``): rows 0.. of a product of m rows are the bits of the same rows in a
    product of 300, for every m, from any offset."""
    gen = torch.Generator().manual_seed(k * n)
    w, x = torch.randn(n, k, generator=gen) / k**0.5, torch.randn(300, k, generator=gen)
    product = row_product(*PRODUCT_ROWS["cpu"])
    whole = product(x, w)
    for m in COUNTS:
        for at in (0, 3):
            assert torch.equal(product(x[at : at + m], w), whole[at : at + m]), (m, at)
    bias = torch.randn(n, generator=gen)
    assert torch.equal(product(x[:3], w, bias), product(x, w, bias)[:3])


def test_the_probe_measures_the_range_a_gemm_keeps_a_rows_bits_in() -> None:
    """``agreeing_rows`` (CUDA's rule: a weight's range measured at its first product) finds on this CPU what
    ``PRODUCT_ROWS`` says of it: from 16 rows every count agrees, and a lone row takes another kernel than two
    (MKL's 1-3 rows: bench/rows.py); ``ProbedProduct`` keeps a range a shape and serves rows in it bit for bit."""
    gen = torch.Generator().manual_seed(3)
    for k, n in SHAPES[:4]:
        w = torch.randn(n, k, generator=gen) / k**0.5
        assert agreeing_rows(w, None, 16, 100) == (16, 100), (k, n)
        assert agreeing_rows(w, torch.randn(n, generator=gen), 16, 40) == (16, 40), (k, n)
        assert agreeing_rows(w, None, 1, 40) == (1, 1), (k, n)
    product = ProbedProduct(16, 64)
    w, x = torch.randn(960, 576, generator=gen) / 24, torch.randn(300, 576, generator=gen)
    whole = product(x, w)
    for m in COUNTS:
        assert torch.equal(product(x[3 : 3 + m], w), whole[3 : 3 + m]), m
    assert product.ranges == {((960, 576), torch.float32, False): (16, 64)}


def test_row_chunks_pad_and_cut() -> None:
    """Fewer rows than the least are padded (their results dropped); more than the most cut into chunks: the rows
    come back in order, each as its chunk computed it."""
    seen: list[int] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.shape[0])
        return t * 2

    x = torch.arange(10.0)[:, None]
    assert torch.equal(row_norm(4)(fn, x), x * 2) and seen == [4, 4, 4]  # (10 rows: 4, 4, then 2 padded to 4)
    seen.clear()
    assert torch.equal(row_product(8, 16)(x, torch.ones(1, 1)), x) and row_norm(None)(fn, x).shape == x.shape


def test_split_attention_keeps_a_rows_bits_whatever_the_batch() -> None:
    """A row's result alone and beside rows of other lengths (more splits: the batch's longest row) is the same,
    bit for bit, and is attention (against a plain softmax, to float32 tolerance)."""
    gen = torch.Generator().manual_seed(5)
    lens = [1, 7, 255, 256, 257, 600, 1030]
    n, kvh, g, d, keys = len(lens), 3, 3, 64, 1280
    q = torch.randn(n, kvh, g, d, generator=gen)
    k, v = torch.randn(n, kvh, keys, d, generator=gen), torch.randn(n, kvh, keys, d, generator=gen)
    seen = (torch.arange(keys)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    together = split_attention(q, k, v, seen, 0.125)
    for r, length in enumerate(lens):
        width = -(-length // SPLIT_KEYS) * SPLIT_KEYS  # alone: only its own splits
        alone = split_attention(
            q[r : r + 1], k[r : r + 1, :, :width], v[r : r + 1, :, :width], seen[r : r + 1, ..., :width], 0.125
        )
        assert torch.equal(alone, together[r : r + 1]), length
        scores = (q[r] @ k[r, :, :length].transpose(-1, -2)) * 0.125
        torch.testing.assert_close(together[r], torch.softmax(scores, -1) @ v[r, :, :length], rtol=1e-5, atol=1e-5)
    capped = split_attention(q, k, v, seen, 0.125, softcap=5.0)
    assert not torch.equal(capped, together) and capped.isfinite().all()


def test_batch_invariant_refuses_what_it_cannot_keep(smollm2: tuple[Any, dict[str, Any]]) -> None:
    """Another attention backend than the device's invariant one, or a model whose forward does not take the
    backend's products: ``InvalidConfig``, before anything is built."""
    model, _ = smollm2
    with pytest.raises(InvalidConfig, match="through the torch backend on a cpu device"):
        EngineArgs(batch_invariant=True, backend="flash_attn").attention(model)

    class Other:
        device = torch.device("cpu")

    with pytest.raises(InvalidConfig, match="Llama-family decoder"):
        EngineArgs(batch_invariant=True).attention(Other())
    assert EngineArgs(batch_invariant=True).attention(model).name == "invariant/torch"
    from pagedkv.shell.attention.registry import get_backend

    with pytest.raises(InvalidConfig, match="'flashinfer' has no batch-invariant attention"):
        get_backend("flashinfer", invariant=True)
    assert get_backend("torch", invariant=True).invariant and not get_backend("torch").invariant


@pytest.mark.slow
def test_a_requests_tokens_are_its_own_in_every_company(
    smollm2: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 50's table on the CPU with ``batch_invariant``: 8 chat prompts x 12 greedy tokens, each with its
    logprob; every company (a full batch, batch 7, overlap, drafts alone and batched, a pool that preempts, prompts
    chunked) gives every request the token ids and the logprob bits it got alone. Steps that take in a prompt while
    others decode run one forward, the decode rows riding in the prompt's (``ride_along``): the same bits."""
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.runner import ModelRunner

    real, rode = ModelRunner._forward, []

    def forward(self: ModelRunner, *a: Any) -> Any:
        rode.append(len(a) > 5 and a[5] is not None)  # (its lead: the decode rows riding)
        return real(self, *a)

    monkeypatch.setattr(ModelRunner, "_forward", forward)

    model, meta = smollm2
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    prompts = chat_prompts(tok, 8)
    c = model.config
    pool = 100 * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # (100 tokens of pages: the batch needs ~400)
    lines = table(
        model,
        tok,
        prompts,
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
        pool,
        batch_invariant=True,
    )
    assert [line["identical"] for line in lines] == [8] * len(lines), lines
    assert any(line["preempted"] for line in lines)  # (the preempting pool did preempt)
    assert sum(rode) > 10, sum(rode)  # (decode rows rode in prompts' forwards)
