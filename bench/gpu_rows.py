"""Does a row's result depend on the rows beside it? For each product of a SmolLM2 forward (bf16, its real
shapes: q/k/v, o, gate/up, down, the LM head), the same 8 rows computed inside batches of 8 to 512 rows
against those rows alone, bitwise; and the Triton decode attention's rows inside batches of 1 to 512
against the same rows in a batch of 8, eager and graph-replayed. A verify step runs a request's positions
as token rows beside its drafts: where a product's rows follow the batch, a verified token can differ from
the token decoding would have made (issue 48); issue 50 needs every row to be 'same'.

    python bench/gpu_rows.py [--shape llama-8b]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pagedkv.shell.attention.triton_decode import paged_decode

SIZES = (8, 16, 24, 32, 40, 64, 128, 256, 512)
SHAPES = {  # (in, out) of each product
    "smollm2": {  # SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, MLP 1,536
        "qkv": (576, 960),
        "o": (576, 576),
        "gate_up": (576, 3072),
        "down": (1536, 576),
        "lm_head": (576, 49152),
    },
    "llama-8b": {  # Llama-3.1-8B: hidden 4,096, 32 query / 8 KV heads of 128, MLP 14,336
        "qkv": (4096, 6144),
        "o": (4096, 4096),
        "gate_up": (4096, 28672),
        "down": (14336, 4096),
        "lm_head": (4096, 128256),
    },
}


def products(shape: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| product | " + " | ".join(f"{m} rows" for m in SIZES) + " |")
    print("|---|" + "---:|" * len(SIZES))
    for name, (k, n) in SHAPES[shape].items():
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
        x = torch.randn(max(SIZES), k, device="cuda", generator=gen).bfloat16()
        alone = F.linear(x[:8], w)
        cells = []
        for m in SIZES:
            got = F.linear(x[:m], w)[:8]
            diff = (got.float() - alone.float()).abs().max().item()
            cells.append("same" if torch.equal(got, alone) else f"{diff:.1e}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


HEADS = {"smollm2": (3, 3, 64), "llama-8b": (8, 4, 128)}  # KV heads, queries a KV head, head size


def attention(shape: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    (KVH, G, D), bs, width = HEADS[shape], 16, 512  # tables 512 blocks wide (8,192 keys)
    n = max(SIZES)
    lens = torch.randint(1, 3000, (n,), device="cuda", generator=gen).to(torch.int32)
    blocks = n * (200 if D == 64 else 50) + 1
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="the products' shapes")
    shape = parser.parse_args().shape
    print(f"{shape}'s products; ", end="")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; a row of 8 inside batches of M rows, bf16\n")
    products(shape)
    attention(shape)
