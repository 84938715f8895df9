"""The multi-token and decode paths of the triton, flashinfer and flash_attn (FA4) backends vs the torch
reference on the GPU:
prefill, chunked prefill and denoising steps, causal and full segments, GQA, sliding window, shuffled
block tables; bf16 and fp32 (FlashInfer has no fp32: refused, and said so). A backend that cannot run
here (flashinfer not installed) is a line saying why.

    python -m tests.gpu.prefill_cases
"""

from __future__ import annotations

import sys
import time

import torch

from pagedkv.core import CacheConfig, GroupKind, GroupSpec, KVMetadata, Phase, RowMetadata
from pagedkv.core.outputs.metadata import segments_of, slots_of
from pagedkv.shell.attention import LayerAttention, get_backend
from pagedkv.shell.worker import Worker


def case(
    name: str,
    rows: list[tuple[int, tuple[tuple[int, int], ...], int, int]],
    spec: GroupSpec,
    bs: int,
    dtype: torch.dtype,
    heads: int = 12,
    kvh: int = 4,
    d: int = 64,
    backend: str = "triton",
    phase: Phase = Phase.PREFILL,
) -> tuple[str, float, float, float]:
    dev = "cuda"
    g = torch.Generator(device="cpu").manual_seed(0)
    need = sum(-(-L // bs) for L, *_ in rows)
    cfg = CacheConfig(block_size=bs, num_blocks=need + 8, groups=(spec,))
    k_pages = torch.randn(cfg.num_blocks, bs, kvh, d, generator=g).to(dev, dtype)
    v_pages = torch.randn(cfg.num_blocks, bs, kvh, d, generator=g).to(dev, dtype)
    ids = (torch.randperm(cfg.num_blocks - 1, generator=g) + 1).tolist()
    meta_rows = []
    for r, (L, spans, start, seq_len) in enumerate(rows):
        table = tuple(ids.pop() for _ in range(-(-L // bs)))
        meta_rows.append(
            RowMetadata(
                r,
                0,
                (table,),
                seq_len,
                seq_len - start,
                start,
                slots_of(table, bs, start, seq_len - start),
                segments_of(spans, seq_len, start),
            )
        )
    meta = KVMetadata(1, 0, bs, phase, tuple(meta_rows))
    w = Worker(cfg, max_rows=8, max_blocks_per_row=512, max_tokens=8192, device=dev)
    batch = w.install(meta)
    q = torch.randn(sum(r.query_len for r in meta_rows), heads, d, generator=g).to(dev, dtype)
    layer = LayerAttention(0, spec, scale=d**-0.5)
    ref = get_backend("torch").forward(q.float(), k_pages.float(), v_pages.float(), batch, layer)
    tb = get_backend(backend)
    out = tb.forward(q, k_pages, v_pages, batch, layer).float()
    err = ((out - ref).norm() / ref.norm()).item()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        tb.forward(q, k_pages, v_pages, batch, layer)
    torch.cuda.synchronize()
    t_tri = (time.perf_counter() - t0) / 10 * 1e3
    t0 = time.perf_counter()
    get_backend("torch").forward(q, k_pages, v_pages, batch, layer)
    torch.cuda.synchronize()
    t_ref = (time.perf_counter() - t0) * 1e3
    return name + f" {str(dtype)[6:]}", err, t_tri, t_ref


def cases() -> list[tuple[str, list[tuple[int, tuple[tuple[int, int], ...], int, int]], GroupSpec, int]]:
    """(name, rows as (length, spans, first query position, keys' end), group, block size)."""
    full = GroupSpec("full")
    swa = GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=48)
    return [
        ("prefill, 3 rows", [(300, (), 0, 300), (77, (), 0, 77), (129, (), 0, 129)], full, 16),
        ("chunked prefill", [(700, (), 256, 512), (300, (), 100, 300)], full, 16),
        ("prefill with an image span", [(200, ((50, 114),), 0, 200), (150, ((30, 94),), 0, 150)], full, 16),
        ("denoise (target span)", [(300, ((240, 300),), 240, 300), (280, ((220, 280),), 220, 280)], full, 16),
        ("sliding window prefill", [(400, (), 0, 400), (90, (), 0, 90)], swa, 16),
        ("sliding window, image span", [(300, ((100, 220),), 0, 300), (260, ((60, 180),), 0, 260)], swa, 16),
        ("block size 128", [(1000, (), 0, 1000), (513, (), 400, 513)], full, 128),
    ]


def decode_cases() -> list[tuple[str, list[tuple[int, tuple[tuple[int, int], ...], int, int]], GroupSpec, int]]:
    """Decode forwards (one query token a row, at its last position), run with ``phase=Phase.DECODE``."""
    full = GroupSpec("full")
    swa = GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=48)
    lens = (300, 77, 129, 1000, 16, 17)
    return [
        ("decode, 6 rows", [(n, (), n - 1, n) for n in lens], full, 16),
        ("decode, sliding window", [(n, (), n - 1, n) for n in lens], swa, 16),
        ("decode, block size 128", [(n, (), n - 1, n) for n in lens], full, 128),
    ]


TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def main() -> int:
    from pagedkv.shell.errors import BackendUnavailable, ShellError

    ok = True
    print(f"{torch.cuda.get_device_name()}: multi-token paths (one call per segment) vs the torch reference")
    print(f"{'backend':<11} {'case':<36} {'rel err':>9} {'tol':>7} {'ms':>8} {'torch ms':>9}  status")
    for backend in ("triton", "flashinfer", "flash_attn"):
        try:
            get_backend(backend)
        except BackendUnavailable as e:
            print(f"{backend:<11} not run: {e}")
            continue
        for dtype, tol in TOLERANCE.items():
            for name, rows, spec, bs, phase in [(*c, Phase.PREFILL) for c in cases()] + [
                (*c, Phase.DECODE) for c in decode_cases()
            ]:
                try:
                    label, err, t_b, t_ref = case(name, rows, spec, bs, dtype, backend=backend, phase=phase)
                except ShellError as e:  # refused with its reason (fp32 on flashinfer, a span under a window)
                    print(
                        f"{backend:<11} {name + ' ' + str(dtype)[6:]:<36} {'':>9} {'':>7} {'':>8} {'':>9}  refused: {e}"
                    )
                    continue
                good = err < tol
                ok &= good
                print(
                    f"{backend:<11} {label:<36} {err:>9.1e} {tol:>7.0e} {t_b:>8.3f} {t_ref:>9.2f}  "
                    f"{'ok' if good else 'FAIL'}"
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
