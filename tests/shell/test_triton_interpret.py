"""The Triton kernels on the CPU, under Triton's interpreter (``TRITON_INTERPRET=1``, set before the kernels are
defined: a process of its own): what the ``triton`` backend's riding decode rows rely on (``attention.base
.decode_lead``). The varlen kernel from ``first_row`` computes the rows after it as the whole call does; the decode
kernel gives one-token rows what dense attention over their pages gives, as the varlen kernel does; both write
into one output (the backend's: the decode rows first) exactly what each returns alone; programs a row
are a power of two (each compiles when the graphs are captured). The GPU suite checks the same kernels on a card
(tests/gpu/test_triton.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton's interpreter comes with triton")

CHECK = r"""
import json, torch
import pagedkv.shell.attention.triton_decode as td
td._multiprocessors = lambda index: 132  # (an H100's multiprocessors: auto_programs' shapes alone)
torch.manual_seed(0)
H, KVH, D, BS, NB = 8, 2, 32, 16, 64
k_pages, v_pages = torch.randn(NB, BS, KVH, D), torch.randn(NB, BS, KVH, D)
qlens, kvlens = [1, 1, 1, 20, 7], [40, 5, 100, 20, 50]  # three decode rows leading two prompts' chunks
perm = torch.randperm(NB - 1) + 1
table = torch.stack([perm[r * 8 : (r + 1) * 8] for r in range(len(qlens))]).to(torch.int32)
cu = torch.tensor([0, *torch.cumsum(torch.tensor(qlens), 0).tolist()], dtype=torch.int32)
kv = torch.tensor(kvlens, dtype=torch.int32)
q = torch.randn(sum(qlens), H, D)
args = (q, k_pages, v_pages, table, cu, kv, max(qlens))
whole = td.paged_varlen(*args, causal=True, scale=0.2)
rest = td.paged_varlen(*args, causal=True, scale=0.2, first_row=3)
dec = td.paged_decode(q[:3], k_pages, v_pages, table[:3], kv[:3], 0.2)
dense = []
for r in range(3):  # one query at the row's last position: every key of the row
    keys = torch.arange(kvlens[r])
    blocks = table[r][keys // BS].long()
    k, v = k_pages[blocks, keys % BS], v_pages[blocks, keys % BS]  # (keys, KVH, D)
    kh, vh = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    w = torch.softmax(torch.einsum("hd,khd->hk", q[r], kh) * 0.2, -1)
    dense.append(torch.einsum("hk,khd->hd", w, vh))
dense = torch.stack(dense)
shared = torch.full_like(q, float("nan"))  # (the backend's one output: the decode rows first, the rest after them)
td.paged_decode(q[:3], k_pages, v_pages, table[:3], kv[:3], 0.2, out=shared[:3])
td.paged_varlen(*args, causal=True, scale=0.2, first_row=3, out=shared)
try:
    td.paged_varlen(*args, causal=True, scale=0.2, out=torch.empty(q.shape, dtype=torch.float64))
    refused = False
except ValueError:
    refused = True
print(json.dumps({
    "shared": max((shared[3:] - whole[3:]).abs().max().item(), (shared[:3] - dec).abs().max().item()),
    "refused": refused,
    "rest": (whole[3:] - rest[3:]).abs().max().item(),
    "decode_dense": (dec - dense).abs().max().item(),
    "varlen_dense": (whole[:3] - dense).abs().max().item(),
    "programs": [td.auto_programs(b, 8, torch.device("cpu")) for b in (1, 3, 5, 9, 33, 64, 256)],
}))
"""


def test_riding_rows_kernels_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rest"] == 0.0  # (the same program for each row after first_row: the same values)
    assert got["shared"] == 0.0 and got["refused"]  # (written into one output: each kernel's own values, in place)
    assert got["decode_dense"] < 1e-4 and got["varlen_dense"] < 1e-4, got
    assert got["programs"] == [64, 32, 16, 8, 4, 4, 4]
