"""The shell on a CUDA device, in one call: pool sizing by memory fraction (a profiled forward),
installs into device buffers, and the torch reference attention over device pages against a
float64 dense reference on the CPU, in fp32 and bf16. Prints a table; exits 1 on a failed check.

    python -m tests.gpu.shell_checks
"""

from __future__ import annotations

import sys
import time

import torch

from pagedkv.core import RequestSpec, RowSpec, admit, commit_many, initial_state, publish
from pagedkv.core.outputs.metadata import slots_of
from pagedkv.shell.attention import LayerAttention, get_backend
from pagedkv.shell.rank import attention_layers, build_rank, plan_rank, size_pool


def check_sizing() -> tuple[str, str, bool]:
    """Sizing by a memory fraction: half the device minus what a profile forward allocates."""
    dev = torch.device("cuda")

    def profile() -> None:
        x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
        (x @ x.T).sum().item()

    smollm2 = plan_rank(
        attention_layers(30, kv_heads=3, head_dim=64, dtype=torch.bfloat16), block_size=16, dtype=torch.bfloat16
    )
    s = size_pool(smollm2, device=dev, memory_fraction=0.5, profile=profile)
    peak = torch.cuda.max_memory_allocated(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    good = 0 < s.total_bytes <= total // 2 - peak + s.page_bytes
    return (
        "size_pool (fraction 0.5)",
        f"{s.num_blocks} blocks, {s.total_bytes / 2**30:.1f} GiB, peak {peak / 2**20:.0f} MiB",
        good,
    )


def check_pages(dtype: torch.dtype, tol: float) -> tuple[str, str, bool]:
    """A core-built prefill forward installed on the device, the torch backend over device pages,
    against a float64 dense reference on the CPU."""
    dev = torch.device("cuda")
    bs, kvh, heads, d = 16, 4, 16, 64
    plan = plan_rank(attention_layers(1, kv_heads=kvh, head_dim=d, dtype=dtype), block_size=bs, dtype=dtype)
    cfg = plan.cache_config(257, max_model_len=32 * bs)
    st = initial_state(cfg)
    lens = [37, 300, 129, 16]
    for i, n in enumerate(lens):
        st = admit(st, RequestSpec(i, (RowSpec(n),))).unwrap().state
    st = commit_many(st, [(i, [n - 5]) for i, n in enumerate(lens)]).unwrap().state  # 5 tokens each left to prefill
    meta = publish(st, list(range(len(lens))), "prefill").unwrap().effect
    g = torch.Generator().manual_seed(0)
    rank = build_rank(plan, cfg, max_rows=8, max_tokens=64, device=dev)
    pool = rank.pool
    t0 = time.perf_counter()
    batch = rank.worker.install(meta)
    torch.cuda.synchronize()
    install_ms = (time.perf_counter() - t0) * 1e3
    ks, vs, qs = [], [], []
    for r in meta.rows:
        k, v = torch.randn(r.seq_len, kvh, d, generator=g), torch.randn(r.seq_len, kvh, d, generator=g)
        pool.write(0, k.to(dev), v.to(dev), torch.tensor(slots_of(r.block_ids[0], bs, 0, r.seq_len), device=dev))
        ks.append(k.to(dtype).double())
        vs.append(v.to(dtype).double())
        qs.append(torch.randn(r.query_len, heads, d, generator=g))
    layer = LayerAttention(0, cfg.groups[0], scale=d**-0.5)
    out = get_backend("torch").forward(torch.cat(qs).to(dev, dtype), pool.k[0], pool.v[0], batch, layer).double().cpu()
    refs = []
    for r, k, v, qr in zip(meta.rows, ks, vs, qs):
        qd = qr.to(dtype).double()
        for i, pos in enumerate(range(r.kv_start_pos, r.seq_len)):
            kk = k[: pos + 1].repeat_interleave(heads // kvh, 1)
            vv = v[: pos + 1].repeat_interleave(heads // kvh, 1)
            w = torch.softmax(torch.einsum("hd,khd->hk", qd[i], kk) * layer.scale, -1)
            refs.append(torch.einsum("hk,khd->hd", w, vv))
    ref = torch.stack(refs)
    err = ((out - ref).norm() / ref.norm()).item()
    good = err < tol and bool(torch.isfinite(out).all())
    return (
        f"torch backend over pages, {str(dtype)[6:]}",
        f"rel err {err:.2e} (< {tol}), install {install_ms:.2f} ms",
        good,
    )


def main() -> int:
    assert torch.cuda.is_available(), "needs a CUDA device"
    rows = [check_sizing(), check_pages(torch.float32, 1e-4), check_pages(torch.bfloat16, 1e-2)]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'check':<34} {'result':<58} status")
    for a, b, good in rows:
        print(f"{a:<34} {b:<58} {'ok' if good else 'FAIL'}")
    return 0 if all(good for *_, good in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
