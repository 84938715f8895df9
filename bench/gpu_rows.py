"""Does a row's result depend on the rows beside it? For each product of a SmolLM2 forward (bf16, its real
shapes: q/k/v, o, gate/up, down, the LM head), the same 8 rows computed inside batches of 8 to 512 rows
against those rows alone, bitwise; and the Triton decode attention's rows inside batches of 1 to 512
against the same rows in a batch of 8, eager and graph-replayed. A verify step runs a request's positions
as token rows beside its drafts: where a product's rows follow the batch, a verified token can differ from
the token decoding would have made (issue 48); issue 50 needs every row to be 'same'.

    python bench/gpu_rows.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.shell.attention.triton_decode import paged_decode

SIZES = (8, 16, 24, 32, 40, 64, 128, 256, 512)
PRODUCTS = {  # (in, out) of SmolLM2-135M's matrices (hidden 576, 9 query / 3 KV heads of 64, MLP 1,536)
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}


def products() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| product | " + " | ".join(f"{m} rows" for m in SIZES) + " |")
    print("|---|" + "---:|" * len(SIZES))
    for name, (k, n) in PRODUCTS.items():
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
        x = torch.randn(max(SIZES), k, device="cuda", generator=gen).bfloat16()
        alone = F.linear(x[:8], w)
        cells = []
        for m in SIZES:
            got = F.linear(x[:m], w)[:8]
            diff = (got.float() - alone.float()).abs().max().item()
            cells.append("same" if torch.equal(got, alone) else f"{diff:.1e}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def attention() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    KVH, G, D, bs, width = 3, 3, 64, 16, 512  # SmolLM2's heads; tables 512 blocks wide (8,192 keys)
    n = max(SIZES)
    lens = torch.randint(1, 3000, (n,), device="cuda", generator=gen).to(torch.int32)
    blocks = n * 200 + 1
    k = torch.randn(blocks, bs, KVH, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(blocks, bs, KVH, D, device="cuda", generator=gen).bfloat16()
    table = torch.randint(1, blocks, (n, width), device="cuda", generator=gen).to(torch.int32)
    q = torch.randn(n, KVH * G, D, device="cuda", generator=gen).bfloat16()
    alone = paged_decode(q[:8], k, v, table[:8], lens[:8])
    eager, graphed = [], []
    for m in (1, *SIZES):
        rows = min(m, 8)
        got = paged_decode(q[:m], k, v, table[:m], lens[:m])[:rows]
        eager.append("same" if torch.equal(got, alone[:rows]) else "differs")
        g = torch.cuda.CUDAGraph()
        paged_decode(q[:m], k, v, table[:m], lens[:m])  # (compiled outside the capture)
        with torch.cuda.graph(g):
            out = paged_decode(q[:m], k, v, table[:m], lens[:m])
        g.replay()
        graphed.append("same" if torch.equal(out[:rows], alone[:rows]) else "differs")
    print("\n| decode attention | " + " | ".join(f"{m} rows" for m in (1, *SIZES)) + " |")
    print("|---|" + "---:|" * (len(SIZES) + 1))
    print("| eager | " + " | ".join(eager) + " |")
    print("| graph replay | " + " | ".join(graphed) + " |", flush=True)


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; a row of 8 inside batches of M rows, bf16\n")
    products()
    attention()
