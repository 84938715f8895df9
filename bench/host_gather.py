"""The host tier's store gather on the GPU (issue 66): shell.host_copy's kernel against the copy it replaced
(``index_select`` of the pages seen block first), each checked equal to it, at a model's page shapes (Llama-8B's by
default: 32 layers, 16-token blocks of 8 KV heads x 128, bf16), over batches of random blocks; GB/s read once.

    python bench/host_gather.py --layers 32 --blocks 4000 --batches 32,128,512
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedkv.shell.host_copy import gather_pages  # noqa: E402


def timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4000, help="blocks in the pool")
    ap.add_argument("--page", default="16,8,128", help="a page's shape: block size, KV heads, head dim")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="32,128,512", help="blocks a store batch reads")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    page = tuple(int(x) for x in args.page.split(","))
    dtype = getattr(torch, args.dtype)
    pages = torch.randn((args.layers, args.blocks, *page), device="cuda").to(dtype)
    print(f"{torch.cuda.get_device_name()}; pages {tuple(pages.shape)} {args.dtype}\n")
    print("| blocks | bytes read | index_select ms | GB/s | gather_pages ms | GB/s | speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.batches.split(",")):
        at = torch.randperm(args.blocks, device="cuda")[:n]
        want = pages.transpose(0, 1).index_select(0, at)
        if not torch.equal(gather_pages(pages, at).view(torch.uint8), want.view(torch.uint8)):
            raise SystemExit(f"gather_pages differs from index_select at {n} blocks")
        gb = want.numel() * want.element_size() / 1e9
        old = timed(lambda: pages.transpose(0, 1).index_select(0, at), args.repeats)
        new = timed(lambda: gather_pages(pages, at), args.repeats)
        print(f"| {n} | {gb:.2f} GB | {old * 1e3:.2f} | {gb / old:.0f} | {new * 1e3:.2f} | {gb / new:.0f} | "
              f"{old / new:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
