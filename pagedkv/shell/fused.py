"""A decoder layer's elementwise work fused into Triton kernels (CUDA): what a forward launches besides its matrix
products and attention, one kernel where eager torch launches several.

- ``rms_norm``: RMSNorm, optionally after the residual add it follows (``x + y`` rounded to the model's dtype, the
  sum handed back as the new residual): one kernel for what eager torch does in nine;
- ``rope_write``: the rotary embedding of a forward's queries and keys, read from the one QKV product, the queries
  written out, the keys and values written to their page slots (the slot mapping's write): one kernel for ~17;
- ``silu_mul``: the gated activation ``silu(gate) * up`` of the one gate-and-up product: one kernel for three.

Each computes what the torch code it replaces computes (``models.llama``'s ``_rms``, ``_rope`` and the pool's write):
the same operations in float32 on the same rounded inputs, each result rounded where torch rounds it; only the order
of a norm's sum and the device's exp and rsqrt may differ in float32's last place. Elementwise and a row at a time,
so a row's bits never depend on the batch (batch-invariant mode keeps its own norms: ``shell.invariant``).

``serves(t)`` says whether the kernels serve a tensor (CUDA and triton; ``ENABLED`` off turns them off, for A/B
runs); the kernels also run in Triton's interpreter on the CPU where both ``TRITON_INTERPRET=1`` and
``PAGEDKV_FUSED=interpret`` are set, as the tests check them.
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("PAGEDKV_FUSED", "1") != "0"  # (bench/gpu_real.py's variant "unfused" turns it off)
# on the CPU only where asked for by name, in Triton's interpreter (the tests'): TRITON_INTERPRET alone, which other
# code sets for kernels of its own, never moves a CPU forward into the interpreter
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("PAGEDKV_FUSED") == "interpret"

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None


def serves(t: torch.Tensor) -> bool:
    """Do the fused kernels serve ``t``'s device? (Import this module only where they may: it loads Triton.)"""
    return ENABLED and triton is not None and (t.is_cuda or INTERPRETED)


if triton is not None:

    @triton.jit
    def _rms_kernel(X, R, W, OUT, ROUT, stride_x, stride_r, stride_o, stride_ro, N, eps,
                    HAS_R: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(X + row * stride_x + cols, mask=m, other=0.0)
        if HAS_R:  # the residual add first, rounded to the model's dtype as torch's add rounds it
            r = tl.load(R + row * stride_r + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(OUT.dtype.element_ty)
            tl.store(ROUT + row * stride_ro + cols, x, mask=m)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / N
        n = (xf * (1.0 / tl.sqrt(var + eps))).to(OUT.dtype.element_ty)
        w = tl.load(W + cols, mask=m, other=0.0)
        tl.store(OUT + row * stride_o + cols, (n.to(tl.float32) * w.to(tl.float32)).to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_write_kernel(QKV, COS, SIN, Q, KC, VC, SLOTS, stride_qkv, stride_cos, stride_kb,
                           H: tl.constexpr, KVH: tl.constexpr, HP: tl.constexpr, KP: tl.constexpr,
                           D: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF)
        c = tl.load(COS + t * stride_cos + d)[None, :]  # (the tables' two halves are equal)
        s = tl.load(SIN + t * stride_cos + d)[None, :]
        row = QKV + t * stride_qkv
        hq = tl.arange(0, HP)[:, None]
        mq = hq < H
        q1 = tl.load(row + hq * D + d[None, :], mask=mq, other=0.0)
        q2 = tl.load(row + hq * D + HALF + d[None, :], mask=mq, other=0.0)
        out = Q + t * (H * D) + hq * D + d[None, :]
        f1, f2 = q1.to(tl.float32), q2.to(tl.float32)
        tl.store(out, (f1 * c + -f2 * s).to(Q.dtype.element_ty), mask=mq)
        tl.store(out + HALF, (f2 * c + f1 * s).to(Q.dtype.element_ty), mask=mq)
        slot = tl.load(SLOTS + t).to(tl.int64)
        at = (slot // BS) * stride_kb + (slot % BS) * (KVH * D)  # (as triton_decode's kv_write addresses a slot)
        hk = tl.arange(0, KP)[:, None]
        mk = hk < KVH
        k1 = tl.load(row + (H + hk) * D + d[None, :], mask=mk, other=0.0).to(tl.float32)
        k2 = tl.load(row + (H + hk) * D + HALF + d[None, :], mask=mk, other=0.0).to(tl.float32)
        kout = KC + at + hk * D + d[None, :]
        tl.store(kout, (k1 * c + -k2 * s).to(KC.dtype.element_ty), mask=mk)
        tl.store(kout + HALF, (k2 * c + k1 * s).to(KC.dtype.element_ty), mask=mk)
        vin = row + (H + KVH + hk) * D + d[None, :]
        vout = VC + at + hk * D + d[None, :]
        tl.store(vout, tl.load(vin, mask=mk, other=0.0), mask=mk)
        tl.store(vout + HALF, tl.load(vin + HALF, mask=mk, other=0.0), mask=mk)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        g = tl.load(GU + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_gu + N + cols, mask=m, other=0.0)
        a = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty)  # silu, rounded as F.silu's result is
        tl.store(OUT + row * stride_o + cols, (a.to(tl.float32) * u.to(tl.float32)).to(OUT.dtype.element_ty), mask=m)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms(residual + x) * weight`` row by row, and the sum (the new residual; ``x`` itself without one): the model's
    ``_rms`` after its ``x = x + y``. ``x`` and ``residual``: (rows, hidden), the last dimension contiguous."""
    rows, n = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    if rows:
        r = residual if residual is not None else x
        _rms_kernel[(rows,)](x, r, weight, out, total, x.stride(0), r.stride(0), out.stride(0), total.stride(0), n,
                             eps, HAS_R=residual is not None, BLOCK=triton.next_power_of_2(n))  # fmt: skip
    return out, total


def rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """The queries, (tokens, heads, head_dim), rotated; each token's keys rotated and written with its values to page
    slot ``slots[t]`` (pages ``(blocks, block_size, kv_heads, head_dim)`` of ``qkv``'s dtype). ``qkv``: the one
    product, (tokens, (heads + 2 kv_heads) head_dim), rows contiguous; ``cos``, ``sin``: (tokens, 1, head_dim)
    float32 (``Llama._rope_tables``)."""
    t = qkv.shape[0]
    d = k_pages.shape[-1]
    q = torch.empty((t, heads, d), dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_write_kernel[(t,)](qkv, cos, sin, q, k_pages, v_pages, slots, qkv.stride(0), cos.stride(0),
                                 k_pages.stride(0), H=heads, KVH=kv_heads, HP=triton.next_power_of_2(heads),
                                 KP=triton.next_power_of_2(kv_heads), D=d, HALF=d // 2,
                                 BS=k_pages.shape[1])  # fmt: skip
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the one gate-and-up product (rows, 2 x intermediate): (rows, intermediate)."""
    rows, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out
