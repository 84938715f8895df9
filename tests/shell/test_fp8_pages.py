"""fp8 KV pages (issue 36) on the CPU: writes quantize by each layer's scales and the torch backend reads exactly
the dequantized values; the pool holds four times fp32's tokens (twice bf16's) in the same bytes; scales come from
the checkpoint or a calibration forward; backends without an fp8 path, and Mamba states, refuse it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state, publish
from pagedkv.core.config import GroupSpec, InvalidConfig
from pagedkv.models.gguf import LlamaConfig
from pagedkv.models.llama import IdTokenizer, random_llama
from pagedkv.shell.attention import LayerAttention, get_backend
from pagedkv.shell.engine import Engine, EngineArgs
from pagedkv.shell.pool import PagePool, StateShape, quantize

TINY = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position=256,
)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_torch_backend_reads_exactly_the_dequantized_values(fp8: torch.dtype) -> None:
    cfg = CacheConfig(block_size=4, num_blocks=9, max_model_len=32)
    s = admit(initial_state(cfg), RequestSpec("a", (RowSpec(19),))).unwrap().state
    batch_pool = PagePool(cfg, num_layers=1, kv_heads=2, head_dim=8, dtype=fp8)
    plain = PagePool(cfg, num_layers=1, kv_heads=2, head_dim=8)
    g = torch.Generator().manual_seed(0)
    k, v, q = (
        torch.randn(19, 2, 8, generator=g) * 3,
        torch.randn(19, 2, 8, generator=g),
        torch.randn(19, 4, 8, generator=g),
    )
    scales = (float(k.abs().max()) / 200, float(v.abs().max()) / 100)
    from pagedkv.shell.worker import Worker

    worker = Worker(cfg, max_rows=2, max_blocks_per_row=8, max_tokens=32)
    batch = worker.install(publish(s, ["a"], "prefill").unwrap().effect)
    batch_pool.write(0, k, v, batch.slot_mapping, scales)
    plain.write(
        0,
        quantize(k, scales[0], fp8).float() * scales[0],
        quantize(v, scales[1], fp8).float() * scales[1],
        batch.slot_mapping,
    )  # the values the fp8 pages stand for, in fp32 pages
    attn = LayerAttention(0, GroupSpec("full"), scale=8**-0.5, kv_scales=scales)
    be = get_backend("torch")
    got = be.forward(q, batch_pool.k[0], batch_pool.v[0], batch, attn)
    want = be.forward(q, plain.k[0], plain.v[0], batch, replace(attn, kv_scales=(1.0, 1.0)))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    dropped = be.forward(q, batch_pool.k[0], batch_pool.v[0], batch, replace(attn, kv_scales=(1.0, 1.0)))
    assert not torch.allclose(dropped, want, atol=1e-2)  # the scales matter: dropping them is caught
    deq = batch_pool.k[0].view(-1, 2, 8)[batch.slot_mapping].float() * scales[0]
    assert ((deq - k).abs() <= k.abs() * (0.07 if fp8 == torch.float8_e4m3fn else 0.13) + scales[0] * 0.02).all()


def test_the_pool_holds_four_times_fp32_tokens_and_states_refuse_fp8() -> None:
    model = random_llama(TINY)
    sizes = {
        dt: Engine(model, IdTokenizer(), kv_cache_memory_bytes=4 << 20, kv_cache_dtype=dt).sizing
        for dt in ("auto", "fp8", "fp8_e5m2")
    }
    assert (
        sizes["fp8"].tokens >= 4 * sizes["auto"].tokens - 16 and sizes["fp8"].page_bytes * 4 == sizes["auto"].page_bytes
    )
    assert sizes["fp8_e5m2"] == sizes["fp8"]
    with pytest.raises(InvalidConfig, match="Mamba states"):
        PagePool(
            CacheConfig(block_size=16, num_blocks=4),
            num_layers=1,
            kv_heads=2,
            head_dim=32,
            dtype=torch.float8_e4m3fn,
            state=StateShape((8, 3), (2, 4, 4)),
        )
    with pytest.raises(InvalidConfig, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="fp4")


def test_scales_are_calibrated_or_taken_from_the_checkpoint_and_a_backend_without_fp8_refuses() -> None:
    model = random_llama(TINY)
    eng = Engine(model, IdTokenizer(), kv_cache_memory_bytes=4 << 20, kv_cache_dtype="fp8")
    scales = [p.kv_scales for p in eng.layout.of(model.layer_names)]
    assert len(scales) == 3 and all(k > 1e-5 and v > 1e-5 for k, v in scales) and len(set(scales)) == 3
    model.kv_scales = {name: (0.5, 0.25) for name in model.layer_names}  # as hf.checkpoint_kv_scales reads them
    eng = Engine(model, IdTokenizer(), kv_cache_memory_bytes=4 << 20, kv_cache_dtype="fp8")
    assert [p.kv_scales for p in eng.layout.of(model.layer_names)] == [(0.5, 0.25)] * 3

    class NoFp8:  # what rank_for reads of a backend: its name and whether it reads fp8 pages
        name, fp8_pages, kv_write = "flash_attn", False, None

    with pytest.raises(InvalidConfig, match="flash_attn backend has no fp8 path"):
        EngineArgs(kv_cache_dtype="fp8").rank_for(model, NoFp8())  # type: ignore[arg-type]


def test_fp8_pages_keep_the_logits_close_on_a_random_model() -> None:
    """A measure, not a promise of equal tokens: the logits over fp8 pages stay within a few percent of their range."""
    model = random_llama(TINY)
    prompt = list(range(3, 60))
    out = {}
    for dt in ("auto", "fp8_e4m3"):
        eng = Engine(model, IdTokenizer(), kv_cache_memory_bytes=4 << 20, kv_cache_dtype=dt)
        kv = admit(eng.state.kv, RequestSpec("x", (RowSpec.of_tokens(prompt),))).unwrap().state
        batch = eng.worker.install(publish(kv, ["x"], "prefill").unwrap().effect)
        out[dt] = model.forward(torch.tensor(prompt), batch, eng.pool, eng.backend, eng.layout)[0]
    a, b = out["auto"], out["fp8_e4m3"]
    assert 0 < ((a - b).abs().max() / (a.max() - a.min())).item() < 0.05


def test_the_command_line_serves_fp8_pages_and_refuses_what_it_cannot(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.app.cli import main

    assert main(["generate", "--kv-cache-dtype", "fp4", "hi"]) == 2
    assert "invalid choice: 'fp4'" in capsys.readouterr().err
    assert main(["denoise", "--requests", "2", "--steps", "2", "--kv-cache-dtype", "fp8_e5m2"]) == 0
    assert "2 of 2 requests denoised" in capsys.readouterr().out
    assert main(["denoise", "--kv-cache-dtype", "int8"]) == 2


def test_the_connector_refuses_fp8_pages_before_anything_moves() -> None:
    from pagedkv.shell.connector import copy_missing
    from pagedkv.shell.errors import ShellError

    cfg = CacheConfig(block_size=4, num_blocks=9, max_model_len=32)
    src = PagePool(cfg, num_layers=1, kv_heads=2, head_dim=8, dtype=torch.float8_e4m3fn)
    dst = PagePool(cfg, num_layers=1, kv_heads=2, head_dim=8, dtype=torch.float8_e4m3fn)
    before = dst.k[0].view(torch.uint8).clone()
    with pytest.raises(ShellError, match="scales do not travel"):
        copy_missing(src, dst, initial_state(cfg), "a", ())
    assert torch.equal(dst.k[0].view(torch.uint8), before)
