"""Paged decode attention on the GPU: the Triton split-KV kernel vs dense SDPA, gather+SDPA and the
HBM floor; checked against a float32 reference on random non-contiguous block tables.

    python bench/gpu_attention.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from pagedkv.shell.attention.triton_decode import paged_decode


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
    t_flex = flex_paged(q, k_pages, v_pages, table, B, L, KVH, D, scale)
    kv_bytes = 2 * B * L * KVH * D * k_pages.element_size()
    floor = kv_bytes / floor_bw * 1e3
    return {"B": B, "L": L, "bs": bs, "dtype": str(dtype)[6:], "err": err, "ours": t_ours, "dense": t_dense,
            "gather": t_gather, "flex": t_flex, "floor": floor, "share": floor / t_ours}  # fmt: skip


def flex_paged(q, k_pages, v_pages, table, B, L, KVH, D, scale) -> float:  # type: ignore[no-untyped-def]
    """FlexAttention over the same pages: a logical-to-physical index in the mask/score functions (the
    pattern of PyTorch's PagedAttention helper), compiled; nan when it does not run here."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        bs = k_pages.shape[1]
        kp = k_pages.view(-1, KVH, D).transpose(0, 1)[None]  # (1, KVH, slots, D): one physical "sequence"
        vp = v_pages.view(-1, KVH, D).transpose(0, 1)[None]
        qq = q.reshape(1, B, -1, D).transpose(1, 2).reshape(1, -1, B, D)  # (1, H, B, D): row b is query b
        phys_seq = torch.zeros(kp.shape[2], dtype=torch.int32, device=q.device) - 1
        slots = (table.long()[:, :, None] * bs + torch.arange(bs, device=q.device)).view(B, -1)[:, :L]
        phys_seq[slots.reshape(-1)] = torch.arange(B, device=q.device, dtype=torch.int32).repeat_interleave(L)

        def mask(b, h, qi, kv):  # type: ignore[no-untyped-def]
            return phys_seq[kv] == qi

        bm = create_block_mask(mask, 1, None, B, kp.shape[2], device=q.device, BLOCK_SIZE=128)
        fn = torch.compile(flex_attention)
        run = lambda: fn(qq, kp, vp, block_mask=bm, scale=scale, enable_gqa=True)  # noqa: E731
        run()
        return bench(run)
    except Exception as e:  # noqa: BLE001 - a column we only report
        print(f"(FlexAttention column unavailable: {type(e).__name__}: {str(e)[:120]})")
        return float("nan")


def main() -> None:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    bw = 2 * x.numel() / (t / 1e3)  # bytes read + written per second
    del x, y
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s (the floor's rate)")  # fmt: skip
    print(f"{'seqs':>5} {'ctx':>6} {'bs':>4} {'dtype':>9} {'rel err':>9} {'ours ms':>8} {'dense':>7} {'gather':>7} "
          f"{'flex':>7} {'floor':>7} {'of floor':>9}")  # fmt: skip
    rows = [case(64, 4096, 32, 8, 128, 16, torch.bfloat16, bw), case(64, 4096, 32, 8, 128, 128, torch.bfloat16, bw)]
    for B, L in ((1, 512), (8, 4096), (256, 2048), (8, 32768)):
        rows.append(case(B, L, 32, 8, 128, 16, torch.bfloat16, bw))
    rows.append(case(8, 4096, 32, 8, 128, 16, torch.float32, bw))
    for r in rows:
        print(f"{r['B']:>5} {r['L']:>6} {r['bs']:>4} {r['dtype']:>9} {r['err']:>9.1e} {r['ours']:>8.3f} "
              f"{r['dense']:>7.3f} {r['gather']:>7.3f} {r['flex']:>7.3f} {r['floor']:>7.3f} {r['share']:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
