"""Paged decode attention on the GPU: the Triton split-KV kernel vs dense SDPA, gather+SDPA and the
HBM floor; checked against a float32 reference on random non-contiguous block tables.

    python bench/gpu_attention.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from pagedkv.shell.backends.triton_decode import paged_decode


def bench(fn: object) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))  # type: ignore[arg-type]


def case(B: int, L: int, H: int, KVH: int, D: int, bs: int, dtype: torch.dtype, floor_bw: float) -> dict[str, object]:
    dev = "cuda"
    nb = L // bs
    num_blocks = B * nb + 1
    k_pages = torch.randn(num_blocks, bs, KVH, D, device=dev, dtype=dtype)
    v_pages = torch.randn(num_blocks, bs, KVH, D, device=dev, dtype=dtype)
    table = (torch.randperm(num_blocks - 1, device=dev)[: B * nb] + 1).view(B, nb).to(torch.int32)  # shuffled pages
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    q = torch.randn(B, H, D, device=dev, dtype=dtype)
    scale = D**-0.5
    # reference: gather pages to contiguous, float32 math
    kc = k_pages[table.long()].reshape(B, L, KVH, D)
    vc = v_pages[table.long()].reshape(B, L, KVH, D)
    ref = F.scaled_dot_product_attention(q.float()[:, :, None], kc.float().transpose(1, 2), vc.float().transpose(1, 2),
                                         scale=scale, enable_gqa=True)[:, :, 0]  # fmt: skip
    out = paged_decode(q, k_pages, v_pages, table, lens, scale, splits=max(1, min(32, 1024 // (B * KVH) or 1)))
    err = ((out.float() - ref).norm() / ref.norm()).item()
    splits = max(1, min(32, (132 * 8) // (B * KVH)))
    t_ours = bench(lambda: paged_decode(q, k_pages, v_pages, table, lens, scale, splits=splits))
    kd, vd = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()  # dense caches (B, KVH, L, D)
    t_dense = bench(lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale, enable_gqa=True))
    t_gather = bench(lambda: F.scaled_dot_product_attention(
        q[:, :, None], k_pages[table.long()].reshape(B, L, KVH, D).transpose(1, 2),
        v_pages[table.long()].reshape(B, L, KVH, D).transpose(1, 2), scale=scale, enable_gqa=True))  # fmt: skip
    kv_bytes = 2 * B * L * KVH * D * k_pages.element_size()
    floor = kv_bytes / floor_bw * 1e3
    return {"B": B, "L": L, "bs": bs, "dtype": str(dtype)[6:], "err": err, "ours": t_ours, "dense": t_dense,
            "gather": t_gather, "floor": floor, "share": floor / t_ours}  # fmt: skip


def main() -> None:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    bw = 2 * x.numel() / (t / 1e3)  # bytes read + written per second
    del x, y
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s (the floor's rate)")  # fmt: skip
    print(f"{'seqs':>5} {'ctx':>6} {'bs':>4} {'dtype':>9} {'rel err':>9} {'ours ms':>8} {'dense':>7} {'gather':>7} "
          f"{'floor':>7} {'of floor':>9}")  # fmt: skip
    rows = [case(64, 4096, 32, 8, 128, 16, torch.bfloat16, bw), case(64, 4096, 32, 8, 128, 128, torch.bfloat16, bw)]
    for B, L in ((1, 512), (8, 4096), (256, 2048), (8, 32768)):
        rows.append(case(B, L, 32, 8, 128, 16, torch.bfloat16, bw))
    rows.append(case(8, 4096, 32, 8, 128, 16, torch.float32, bw))
    for r in rows:
        print(f"{r['B']:>5} {r['L']:>6} {r['bs']:>4} {r['dtype']:>9} {r['err']:>9.1e} {r['ours']:>8.3f} "
              f"{r['dense']:>7.3f} {r['gather']:>7.3f} {r['floor']:>7.3f} {r['share']:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
