"""Several ranks on the CPU (gloo): metadata distribution per step vs the step itself, and which way of
distributing a snapshot is cheaper: the pickled KVMetadata (broadcast_object_list) or fixed-size
int32 tensors (block tables and lengths, sized once).

    python bench/ranks.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, commit_many, initial_state, publish
from pagedkv.shell.distributed import init

ROWS, MAX_BLOCKS = 16, 64


def _snapshot() -> object:
    s = initial_state(CacheConfig(block_size=16, num_blocks=2049))
    for i in range(ROWS):
        s = admit(s, RequestSpec(i, (RowSpec(300 + 20 * i),))).unwrap().state
    s = commit_many(s, [(i, [299 + 20 * i]) for i in range(ROWS)]).unwrap().state
    return publish(s, list(range(ROWS)), "decode").unwrap().effect


def _ways(rank: int, world: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    init(rank, world, path)
    meta = _snapshot()
    buf = torch.zeros(ROWS, MAX_BLOCKS + 3, dtype=torch.int32)  # block table row + seq_len, start, query_len
    if rank == 0:
        for r, row in enumerate(meta.rows):  # type: ignore[attr-defined]
            buf[r, : len(row.block_ids[0])] = torch.tensor(row.block_ids[0])
            buf[r, MAX_BLOCKS:] = torch.tensor([row.seq_len, row.kv_start_pos, row.query_len])
    obj, ten = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        box = [meta if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        obj.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        ten.append(time.perf_counter() - t0)
    if rank == 0:
        torch.save((statistics.median(obj), statistics.median(ten)), out)
    dist.destroy_process_group()


def main() -> None:
    from pagedkv.models.llama import Llama
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.sampling import SamplingParams
    from pagedkv.app.ranks import run_ranks

    _, meta = Llama.smollm2()
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    qs = ["What is the capital of France?", "Name three primary colors.", "Why is the sky blue?", "Count to five."]
    reqs = [
        (t, tok.encode(t), SamplingParams(temperature=0.0, max_tokens=16))
        for t in (tok.apply_chat_template([{"role": "user", "content": q}]) for q in qs)
    ]
    print(f"SmolLM2, {len(qs)} requests x 16 tokens, gloo on this CPU (2 cores: ranks share them)")
    print(f"{'ranks':>6} {'steps':>6} {'ms/step':>9} {'broadcast ms/step':>18} {'share':>6}")
    for world in (1, 2, 3):
        r = run_ranks(world, reqs, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)[0]
        ms, bms = r["seconds"] / r["steps"] * 1e3, r["broadcast_seconds"] / r["steps"] * 1e3
        print(f"{world:>6} {r['steps']:>6} {ms:>9.1f} {bms:>18.2f} {bms / ms:>6.1%}")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ways.pt")
        mp.spawn(_ways, args=(2, os.path.join(d, "store"), out), nprocs=2, join=True)
        obj, ten = torch.load(out)
    print(
        f"distributing one {ROWS}-row decode snapshot to 2 ranks: pickled KVMetadata {obj * 1e3:.3f} ms, "
        f"fixed-size int32 tensors {ten * 1e3:.3f} ms (ratio {obj / ten:.1f})"
    )


if __name__ == "__main__":
    main()
