"""The fused elementwise kernels (``shell.fused``) on the GPU in bfloat16: each against the torch code it replaces
(the residual add and the values' copy exact; a norm, a rotation and the gated activation within a bfloat16 unit in
the last place, nearly all of them exact), and an engine's greedy tokens with them as without them (float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.cuda

pytest.importorskip("triton", reason="the fused kernels are Triton's")

from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama  # noqa: E402
from pagedkv.shell import fused  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams  # noqa: E402


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bfloat16 unit in the last place everywhere, equal almost everywhere."""
    ulp = want.float().abs().clamp_min(1e-30) * 2.0**-7
    assert bool(((got.float() - want.float()).abs() <= ulp).all())
    assert (got == want).float().mean().item() > 0.99


def test_each_kernel_in_bf16_is_the_torch_code_it_replaces() -> None:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x, y, w = (
        torch.randn(300, 2048, device=dev).to(dt),
        torch.randn(300, 2048, device=dev).to(dt),
        torch.randn(2048, device=dev).to(dt),
    )

    def rms(t: torch.Tensor) -> torch.Tensor:
        tf = t.float()
        return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(t.dtype) * w

    out, total = fused.rms_norm(y, w, 1e-5, residual=x)
    assert torch.equal(total, x + y)
    close(out, rms(x + y))
    gu = torch.randn(300, 2 * 8192, device=dev).to(dt)
    g, u = gu.chunk(2, -1)
    close(fused.silu_mul(gu), F.silu(g) * u)
    T, H, KV, D, BS = 300, 32, 8, 64, 16
    qkv = torch.randn(T, (H + 2 * KV) * D, device=dev).to(dt)
    pos = torch.randint(0, 4000, (T,), device=dev)
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    fr = pos[:, None].float() * inv[None, :]
    emb = torch.cat((fr, fr), -1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        return (t.float() * cos + torch.cat((-t[..., half:], t[..., :half]), -1).float() * sin).to(t.dtype)

    q, k, v = torch.split(qkv, [H * D, KV * D, KV * D], -1)
    kp, vp = torch.zeros(40, BS, KV, D, device=dev, dtype=dt), torch.zeros(40, BS, KV, D, device=dev, dtype=dt)
    slots = torch.randperm(40 * BS, device=dev)[:T]
    got = fused.rope_write(qkv, cos, sin, kp, vp, slots, H, KV)
    close(got, rope(q.reshape(-1, H, D)))
    close(kp.view(-1, KV, D)[slots], rope(k.reshape(-1, KV, D)))
    assert torch.equal(vp.view(-1, KV, D)[slots], v.reshape(-1, KV, D))


def test_an_engine_gives_the_same_greedy_tokens_with_the_kernels_as_without(monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_llama(SMOLLM2_SHAPES, device="cuda")  # (float32: random weights' near ties stay apart)
    prompts = [
        (f"p{i}", [(7 * i + j) % 49152 for j in range(40 + 37 * i)], SamplingParams(temperature=0.0, max_tokens=16))
        for i in range(6)
    ]
    runs = []
    for on in (True, False):
        monkeypatch.setattr(fused, "ENABLED", on)
        eng = Engine(model, IdTokenizer(), kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
        runs.append([c.token_ids for c in eng.generate(prompts)])
    assert runs[0] == runs[1]
