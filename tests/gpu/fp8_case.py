"""One decode case over fp8 pages, shared by the Triton and FlashInfer GPU tests: random K/V quantized with
calibration-style scales (largest |K| / 200, |V| / 100), a block table, and the reference: fp32 attention over
the pages' values times their scales."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedkv.shell.pool import quantize


class Fp8Case(NamedTuple):
    q: torch.Tensor  # (B, H, D)
    k8: torch.Tensor  # (blocks, bs, KVH, D) fp8 pages
    v8: torch.Tensor
    ks: float  # K's and V's scale
    vs: float
    table: torch.Tensor  # (B, nb) int32, block 0 the null block
    lens: torch.Tensor  # (B,) int32
    want: torch.Tensor  # (B, H, D) fp32 attention over the dequantized pages


def fp8_case(
    seed: int,
    B: int,
    L: int,
    H: int,
    KVH: int,
    D: int,
    bs: int,
    fp8: torch.dtype,
    q_dtype: torch.dtype,
    device: str = "cuda",
) -> Fp8Case:
    g = torch.Generator(device=device).manual_seed(seed)
    nb = -(-L // bs)
    k = torch.randn(B * nb + 1, bs, KVH, D, device=device, generator=g)
    v = torch.randn(B * nb + 1, bs, KVH, D, device=device, generator=g)
    ks, vs = float(k.abs().max()) / 200, float(v.abs().max()) / 100
    k8, v8 = quantize(k, ks, fp8), quantize(v, vs, fp8)
    table = (torch.arange(B * nb, device=device) + 1).view(B, nb).to(torch.int32)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    q = torch.randn(B, H, D, device=device, generator=g).to(q_dtype)
    kc = (k8.float() * ks)[table.long()].reshape(B, nb * bs, KVH, D)[:, :L].transpose(1, 2)
    vc = (v8.float() * vs)[table.long()].reshape(B, nb * bs, KVH, D)[:, :L].transpose(1, 2)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, :, None], kc, vc, scale=D**-0.5, enable_gqa=True
    )[:, :, 0]
    return Fp8Case(q, k8, v8, ks, vs, table, lens, want)
