"""Sampling on the logits' device: the batch sampler equals the one-row sampler row for row, the race
draws from the filtered distribution, and a seeded request draws the same tokens batched or alone."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams, race_noise, sample, sample_batch

PARAMS = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
                   top_k=st.sampled_from([0, 1, 3, 40]), top_p=st.sampled_from([1.0, 0.95, 0.5, 0.05]))  # fmt: skip


@given(st.lists(st.tuples(PARAMS, st.integers(0, 2**40), st.integers(0, 5000)), min_size=1, max_size=6),
       st.integers(0, 2**31), st.sampled_from([7, 97, 1000]))  # fmt: skip
def test_the_batch_sampler_equals_the_one_row_sampler(rows: list, data_seed: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(rows), vocab, generator=g) * 3
    params, seeds, counters = zip(*rows)
    batch = sample_batch(logits, params, seeds, counters)
    assert batch.dtype == torch.int64 and batch.shape == (len(rows),)
    assert batch.tolist() == [sample(logits[i], *rows[i]) for i in range(len(rows))]


def test_the_race_draws_the_filtered_distribution() -> None:
    """10,000 draws (counters 0..9999) from logits whose top-3 nucleus is known: each kept token at its
    renormalised probability within 3 standard errors, the rest never."""
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    p = SamplingParams(temperature=1.0, top_k=3)
    n = 10_000
    draws = sample_batch(logits.expand(n, -1), [p] * n, [11] * n, range(n)).tolist()
    want = torch.tensor([0.4, 0.25, 0.15]) / 0.8
    for tok in range(6):
        got = draws.count(tok) / n
        if tok >= 3:
            assert got == 0, (tok, got)
        else:
            se = (want[tok] * (1 - want[tok]) / n) ** 0.5
            assert abs(got - want[tok]) < 3 * se, (tok, got, float(want[tok]))


def test_the_noise_depends_on_seed_counter_and_token_only() -> None:
    a = race_noise(torch.tensor([3, 3, 4]), torch.tensor([9, 10, 9]), 50)
    b = race_noise(torch.tensor([3]), torch.tensor([9]), 50)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert race_noise(torch.tensor([3]), torch.tensor([9]), 80)[0, :50].equal(b[0])  # the vocab size plays no part


def test_a_seeded_request_draws_the_same_tokens_batched_or_alone() -> None:
    from dataclasses import replace

    from pagedkv.models.llama import LlamaConfig

    cfg = replace(SMOLLM2_SHAPES, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2)  # fmt: skip
    assert isinstance(cfg, LlamaConfig)
    model = random_llama(cfg)
    mine = ("mine", list(range(1, 20)), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=42))
    others = [(f"o{i}", [(3 * i + j) % 512 for j in range(5 + 7 * i)],
               SamplingParams(max_tokens=9, temperature=1.2, top_k=50, seed=i)) for i in range(5)]  # fmt: skip
    alone = Engine(model, IdTokenizer(), kv_cache_memory_bytes=4 << 20).generate([mine])[0].token_ids
    batched = Engine(model, IdTokenizer(), kv_cache_memory_bytes=4 << 20).generate([*others[:3], mine, *others[3:]])
    assert batched[3].token_ids == alone and len(alone) == 12
    again = Engine(model, IdTokenizer(), kv_cache_memory_bytes=4 << 20, max_num_seqs=2).generate([mine, *others])
    assert again[0].token_ids == alone  # and through other batches and steps
