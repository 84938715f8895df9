"""Latent (MLA) pages: paged equals dense for prefill, chunked prefill and decode (absorbed too)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.core import (
    CacheConfig,
    GroupKind,
    GroupSpec,
    RequestSpec,
    RowSpec,
    admit,
    append,
    commit,
    initial_state,
    publish,
)
from pagedkv.models.mla import MLAModel
from pagedkv.shell.latent import LatentPagePool
from pagedkv.shell.worker import Worker

TOKENS = [3, 9, 27, 1, 44, 5, 12, 60, 7, 33, 21, 2, 50, 8]
CFG = CacheConfig(block_size=4, num_blocks=24, groups=(GroupSpec("mla", GroupKind.MLA),), enable_prefix_caching=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def setup() -> tuple[MLAModel, LatentPagePool, Worker]:
    m = MLAModel()
    # a fragmented pool: other requests hold blocks between ours
    return (
        m,
        LatentPagePool(CFG, num_layers=m.config.layers, latent_dim=m.config.latent_dim),
        Worker(CFG, max_rows=4, max_blocks_per_row=8, max_tokens=32),
    )


@pytest.mark.parametrize("absorbed_decode", [True, False])
def test_paged_equals_dense_for_prefill_chunks_and_decode(absorbed_decode: bool) -> None:
    m, pool, worker = setup()
    s = admit(initial_state(CFG), RequestSpec("x", (RowSpec(3),))).unwrap().state  # block 1 taken first
    s = admit(s, RequestSpec("a", (RowSpec.of_tokens(TOKENS[:10]),))).unwrap().state
    done = 0
    for chunk in (4, 6):  # chunked prefill: keys end where the chunk ends
        meta = publish(s, ["a"], "prefill", query_limits={"a": chunk}).unwrap().effect
        out = m.paged(torch.tensor(TOKENS[done : done + chunk]), worker.install(meta), pool, absorbed=False)
        done += chunk
        assert rel(out, m.dense(TOKENS[:done])[done - chunk :]) < 1e-5
        s = commit(s, "a", [done]).unwrap().state
    for t in TOKENS[10:]:
        s = append(s, "a", [[t]]).unwrap().state
        n = s.row_len[s.requests["a"].slots[0]]
        meta = publish(s, ["a"], "decode").unwrap().effect
        out = m.paged(torch.tensor([t]), worker.install(meta), pool, absorbed=absorbed_decode)
        assert rel(out, m.dense(TOKENS[:n])[-1:]) < 1e-5
        s = commit(s, "a", [n]).unwrap().state


def test_absorbed_and_unabsorbed_attention_agree_on_the_same_pages() -> None:
    from pagedkv.shell.latent import mla_attention

    m, pool, worker = setup()
    s = admit(initial_state(CFG), RequestSpec("a", (RowSpec.of_tokens(TOKENS),))).unwrap().state
    batch = worker.install(publish(s, ["a"], "prefill").unwrap().effect)
    m.paged(torch.tensor(TOKENS), batch, pool, absorbed=False)  # fills the pages
    c = m.config
    g = torch.Generator().manual_seed(3)
    qn, qp = (
        torch.randn(len(TOKENS), c.heads, c.qk_nope_dim, generator=g),
        torch.randn(len(TOKENS), c.heads, c.qk_rope_dim, generator=g),
    )
    L = m.layers[0]
    a = mla_attention(qn, qp, pool, 0, batch, L["uk"], L["uv"], m.scale, absorbed=True)
    b = mla_attention(qn, qp, pool, 0, batch, L["uk"], L["uv"], m.scale, absorbed=False)
    assert rel(a, b) < 1e-5


def test_latent_pages_cost_latent_over_two_kv_heads_head_dim() -> None:
    m = MLAModel()
    c = m.config
    latent = LatentPagePool(CFG, num_layers=c.layers, latent_dim=c.latent_dim)
    from pagedkv.shell.pool import PagePool

    plain = PagePool(CFG, num_layers=c.layers, kv_heads=c.heads, head_dim=c.qk_nope_dim)
    assert latent.bytes / plain.bytes == pytest.approx(c.latent_dim / (2 * c.heads * c.qk_nope_dim))


def test_an_mla_group_allocates_and_hits_like_full_attention() -> None:
    s = admit(initial_state(CFG), RequestSpec("a", (RowSpec.of_tokens(TOKENS),))).unwrap().state
    s = commit(s, "a", [len(TOKENS)]).unwrap().state
    step = admit(s, RequestSpec("b", (RowSpec.of_tokens(TOKENS),))).unwrap()
    assert step.effect.cached_tokens == (12,)  # 14 tokens: a hit stops a block short of the last token


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_latent_pages_stay_close_to_dense_and_their_scales_matter(fp8: torch.dtype) -> None:
    """fp8 latent pages, a scale a layer (the largest |latent| a dense forward writes, over 200, as the K scale of
    ``shell.kv_scales``): absorbed decode within a few percent of dense (measured), the two attentions agree on the same
    fp8 pages, and reading them without the scales is caught."""
    from pagedkv.shell.kv_scales import K_SCALE_CONSTANT

    m, fp32, worker = setup()
    s = admit(initial_state(CFG), RequestSpec("a", (RowSpec.of_tokens(TOKENS),))).unwrap().state
    batch = worker.install(publish(s, ["a"], "prefill").unwrap().effect)
    seen: list[float] = []
    original = fp32.write
    fp32.write = lambda i, lat, slots: (seen.append(float(lat.abs().max())), original(i, lat, slots))[1]  # type: ignore[method-assign, func-returns-value]
    m.paged(torch.tensor(TOKENS), batch, fp32, absorbed=False)
    scales = [x / K_SCALE_CONSTANT for x in seen]
    pool = LatentPagePool(CFG, num_layers=m.config.layers, latent_dim=m.config.latent_dim, dtype=fp8, scales=scales)
    want = m.dense(TOKENS)
    got = m.paged(torch.tensor(TOKENS), batch, pool, absorbed=False)
    assert 0 < rel(got, want) < (0.05 if fp8 == torch.float8_e4m3fn else 0.15)
    assert rel(m.paged(torch.tensor(TOKENS), batch, pool, absorbed=True), got) < 1e-4  # the same dequantized pages
    pool.latents = lambda layer, ids: pool.pages[layer].index_select(0, ids).reshape(-1, pool.latent_dim).float()  # type: ignore[method-assign]  # (planted: the pages read without their scales)
    assert rel(m.paged(torch.tensor(TOKENS), batch, pool, absorbed=False), want) > 0.2
