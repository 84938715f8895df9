"""Paged decode attention on the GPU: the Triton split-KV kernel vs FlashInfer's paged decode (the same
shuffled block tables), dense SDPA, gather+SDPA and the HBM floor; checked against a float32 reference.
Ours and FlashInfer are timed as eager calls (``do_bench``: launch cost included) and replayed from a
CUDA graph holding 20 back-to-back calls (the launch cost the engine's graphs hide). FlashInfer's column
is nan where it is not installed or has no kernel (float32).

    python bench/gpu_attention.py

Then a decode batch of mixed lengths (``mixed_lengths``): programs a row swept.
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
    ref = F.scaled_dot_product_attention(
        q.float()[:, :, None], kc.float().transpose(1, 2), vc.float().transpose(1, 2), scale=scale, enable_gqa=True
    )[:, :, 0]
    out = paged_decode(q, k_pages, v_pages, table, lens, scale)  # its own tile and programs a row (auto_programs)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    t_ours = bench(lambda: paged_decode(q, k_pages, v_pages, table, lens, scale))
    kd, vd = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()  # dense caches (B, KVH, L, D)
    t_dense = bench(lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale, enable_gqa=True))
    t_gather = bench(
        lambda: F.scaled_dot_product_attention(
            q[:, :, None],
            k_pages[table.long()].reshape(B, L, KVH, D).transpose(1, 2),
            v_pages[table.long()].reshape(B, L, KVH, D).transpose(1, 2),
            scale=scale,
            enable_gqa=True,
        )
    )
    t_flex = flex_paged(q, k_pages, v_pages, table, B, L, KVH, D, scale)
    ours = lambda: paged_decode(q, k_pages, v_pages, table, lens, scale)  # noqa: E731
    g_ours = in_graph(ours)
    fi = flashinfer_times(q, k_pages, v_pages, table, ref, B, L, bs, H, KVH, D, scale)
    kv_bytes = 2 * B * L * KVH * D * k_pages.element_size()
    floor = kv_bytes / floor_bw * 1e3
    return {
        "B": B,
        "L": L,
        "bs": bs,
        "dtype": str(dtype)[6:],
        "err": err,
        "ours": t_ours,
        "dense": t_dense,
        "gather": t_gather,
        "flex": t_flex,
        "floor": floor,
        "share": floor / t_ours,
        "g_ours": g_ours,
        **fi,
    }


def in_graph(fn: object, reps: int = 20) -> float:
    """ms a call, replayed from a CUDA graph of ``reps`` back-to-back calls."""
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()  # type: ignore[operator]
    return bench(g.replay) / reps


def flashinfer_times(q, k_pages, v_pages, table, ref, B, L, bs, H, KVH, D, scale, kv_scales=None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper on the same pages and tables: eager, in a CUDA graph
    (its use_cuda_graph wrapper), with and without tensor cores; nan where it cannot run. fp8 pages: their
    ``kv_scales`` (k_scale, v_scale) passed to ``run``."""
    nan = float("nan")
    out = {"fi": nan, "fi_tc": nan, "g_fi": nan, "fi_err": nan}
    try:
        import flashinfer
    except ImportError as e:
        print(f"(FlashInfer columns unavailable: {e})")
        return out
    if q.dtype not in (torch.float16, torch.bfloat16):
        return out  # FlashInfer has no float32 kernels
    nb = L // bs
    indptr = torch.arange(B + 1, dtype=torch.int32) * nb
    indices = table.reshape(-1).to(torch.int32).cpu()
    last = torch.full((B,), bs, dtype=torch.int32)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    kw = {"q_data_type": q.dtype, "kv_data_type": k_pages.dtype, "sm_scale": scale}
    sc = {} if kv_scales is None else {"k_scale": kv_scales[0], "v_scale": kv_scales[1]}
    best = None
    for tc, name in ((False, "fi"), (True, "fi_tc")):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, H, KVH, D, bs, **kw)
        res = w.run(q, (k_pages, v_pages), **sc)
        out[name] = bench(lambda: w.run(q, (k_pages, v_pages), **sc))
        err = ((res.float() - ref).norm() / ref.norm()).item()
        if best is None or out[name] < out[best[0]]:
            best = (name, tc, err)
    assert best is not None
    out["fi_err"] = best[2]
    i32 = torch.int32
    gw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=best[1],
        paged_kv_indptr_buffer=torch.empty(B + 1, dtype=i32, device="cuda"),
        paged_kv_indices_buffer=torch.empty(B * nb, dtype=i32, device="cuda"),
        paged_kv_last_page_len_buffer=torch.empty(B, dtype=i32, device="cuda"),
    )
    gw.plan(indptr, indices, last, H, KVH, D, bs, **kw)
    out["g_fi"] = in_graph(lambda: gw.run(q, (k_pages, v_pages), **sc))
    return out


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


def copy_bandwidth() -> float:
    """Bytes a second a 2 GiB device copy reads and writes: the HBM floor's rate."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (bench(lambda: y.copy_(x)) / 1e3)


def main() -> None:
    bw = copy_bandwidth()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; copy bandwidth "
        f"{bw / 1e12:.2f} TB/s (the floor's rate)"
    )
    print(
        "| seqs | ctx | page | dtype | rel err ours / FI | ours ms | FlashInfer ms (no TC / TC) | ours graph ms "
        "| FI graph ms | dense SDPA ms | gather+SDPA | flex | HBM floor ms | ours of floor | FI of floor "
        "| ours / FI eager | ours / FI graph |"
    )
    print("|---:|---:|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [case(64, 4096, 32, 8, 128, 16, torch.bfloat16, bw), case(64, 4096, 32, 8, 128, 128, torch.bfloat16, bw)]
    for B, L in ((1, 512), (8, 4096), (256, 2048), (8, 32768)):
        rows.append(case(B, L, 32, 8, 128, 16, torch.bfloat16, bw))
    rows.append(case(8, 4096, 32, 8, 128, 16, torch.float32, bw))
    for r in rows:
        fi = min(r["fi"], r["fi_tc"]) if r["fi"] == r["fi"] else float("nan")  # type: ignore[operator]
        print(
            f"| {r['B']} | {r['L']} | {r['bs']} | {r['dtype']} | {r['err']:.1e} / {r['fi_err']:.1e} | "
            f"{r['ours']:.3f} | {r['fi']:.3f} / {r['fi_tc']:.3f} | {r['g_ours']:.3f} | {r['g_fi']:.3f} | "
            f"{r['dense']:.3f} | {r['gather']:.3f} | {r['flex']:.3f} | {r['floor']:.3f} | {r['share']:.2f} | "
            f"{r['floor'] / fi:.2f} | {r['ours'] / fi:.2f} | {r['g_ours'] / r['g_fi']:.2f} |",
            flush=True,
        )  # type: ignore[operator]


def mixed_lengths(bw: float, rows: int = 256) -> None:
    """A decode batch as an offline run has it: ``rows`` rows of mixed lengths (ShareGPT-like prompts, median 150
    tokens, up to ~1,100, each some way into its 128 new tokens) at Llama-8B's heads, shuffled pages, programs a
    row swept (``auto_programs``' choice marked): a long row's splits on one program wait while short rows' programs
    are done. Bits compared against one program a row (the programs change no result)."""
    import random

    from pagedkv.shell.attention.triton_decode import auto_programs

    rng = random.Random(1)
    lens = [min(1024, max(13, round(rng.lognormvariate(5.0, 0.8)))) + rng.randrange(1, 128) for _ in range(rows)]
    H, KVH, D, bs, dev = 32, 8, 128, 16, "cuda"
    need = [-(-n // bs) for n in lens]
    k = torch.randn(sum(need) + 1, bs, KVH, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    perm = (torch.randperm(sum(need)) + 1).tolist()
    table = torch.zeros(rows, 2048 // bs, dtype=torch.int32)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = torch.tensor(perm[at : at + n], dtype=torch.int32)
        at += n
    table, seq = table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(rows, H, D, device=dev, dtype=torch.bfloat16)
    floor = sum(lens) * KVH * D * 2 * k.element_size() / bw * 1e3
    one = paged_decode(q, k, v, table, seq, D**-0.5, programs=1)
    auto = auto_programs(rows, KVH, q.device)
    print(f"\n{rows} rows of {min(lens)}-{max(lens)} keys (mean {sum(lens) / rows:.0f}), Llama-8B heads, bf16; "
          f"KV floor {floor * 1e3:.1f} us")  # fmt: skip
    print("| programs a row | us (graph) | of floor | bits as one program's |\n|---:|---:|---:|---|")
    for programs in sorted({1, 2, 4, 8, auto}):
        got = paged_decode(q, k, v, table, seq, D**-0.5, programs=programs)
        ms = in_graph(lambda p=programs: paged_decode(q, k, v, table, seq, D**-0.5, programs=p))
        mark = " (auto)" if programs == auto else ""
        print(f"| {programs}{mark} | {ms * 1e3:.1f} | {floor / ms:.2f} | {torch.equal(got, one)} |", flush=True)


if __name__ == "__main__":
    main()
    mixed_lengths(copy_bandwidth())
