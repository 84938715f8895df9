"""The host tier's bookkeeping on the host, a block kept: pagedkv's core beside vLLM's own offloading manager.

No reuse (the workload where the tier cannot help, so whatever it costs is lost): ``--prompts`` distinct prompts
of ``--tokens`` tokens each admitted, computed and finished one after another through pagedkv's core
(``admit``, ``commit``, ``release``) in a pool of ``--blocks`` blocks of 16 tokens, once without a host tier and
once with one of ``--host-blocks`` (once the pool is full, every block a prompt pops evicts a cached one, which the
tier keeps: ``BlockOffloaded``, and ``HostBlockRemoved`` for the entry it drops once the tier is full too). The
tier's cost a block is the difference over the blocks it kept. The peer, in the same run where vLLM is
importable: vLLM's ``CPUOffloadingManager`` (its LRU policy, events on, as pagedkv always records its copies)
taking the same number of blocks, a prompt's at a time (``prepare_store`` then ``complete_store``: what vLLM's
offloading connector calls for each stored batch). GC on; the variants alternated ``--repeats`` times, medians.

    python bench/host_tier_core.py                       # pagedkv alone
    PYTHONPATH=. /path/to/vllm-venv/bin/python bench/host_tier_core.py   # beside vLLM's manager
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, commit, initial_state, release
from pagedkv.core.outputs.events import BlockOffloaded

BLOCK = 16


def pagedkv_run(args: argparse.Namespace, host: int) -> tuple[float, int]:
    """Seconds for the whole stream through the core, and the blocks the tier kept."""
    s = initial_state(
        CacheConfig(block_size=BLOCK, num_blocks=args.blocks + 1, enable_prefix_caching=True, host_blocks=host)
    )
    n = args.tokens
    specs = [RequestSpec(f"r{i}", (RowSpec.of_tokens(range(i * n, (i + 1) * n)),)) for i in range(args.prompts)]
    kept = 0
    t = time.perf_counter()
    for spec in specs:
        step = admit(s, spec).unwrap()
        kept += sum(isinstance(e, BlockOffloaded) for e in step.effect.events)
        s = commit(step.state, spec.request_id, [n]).unwrap().state
        s = release(s, spec.request_id, "finished").unwrap().state
    return time.perf_counter() - t, kept


def vllm_run(args: argparse.Namespace, blocks: int) -> float | None:
    """Seconds for vLLM's CPUOffloadingManager to store ``blocks`` distinct blocks, a prompt's at a time."""
    try:
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except ImportError:
        return None
    mgr = CPUOffloadingManager(num_chunks=args.host_blocks, enable_events=True)
    per = args.tokens // BLOCK
    batches = [
        [make_offload_key(i.to_bytes(32, "little"), 0) for i in range(k, min(k + per, blocks))]
        for k in range(0, blocks, per)
    ]
    ctxs: list[Any] = [ReqContext(f"r{i}") for i in range(len(batches))]
    t = time.perf_counter()
    for keys, ctx in zip(batches, ctxs):
        out = mgr.prepare_store(keys, ctx)
        if out is None:
            raise RuntimeError("vLLM's manager refused a store (no chunk evictable)")
        mgr.complete_store(out.keys_to_store, ctx)
        mgr.take_events()  # (its events handed out, as its connector does each step)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=512, help="tokens a prompt (32 blocks)")
    ap.add_argument("--blocks", type=int, default=1024, help="device blocks in the pool")
    ap.add_argument("--host-blocks", type=int, default=4096, help="host tier slots")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    plain, tier, peer = [], [], []
    kept = 0
    for _ in range(args.repeats):
        plain.append(pagedkv_run(args, 0)[0])
        t, kept = pagedkv_run(args, args.host_blocks)
        tier.append(t)
        v = vllm_run(args, kept)
        if v is not None:
            peer.append(v)
    ours = (statistics.median(tier) - statistics.median(plain)) / kept * 1e6
    print(f"{args.prompts} prompts of {args.tokens} tokens, no reuse; a pool of {args.blocks} blocks, a tier of "
          f"{args.host_blocks}; {kept} blocks kept; medians of {args.repeats}, GC on\n")  # fmt: skip
    print("| | whole stream (ms) | the tier's cost a block kept (us) | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| pagedkv's core, no tier | {statistics.median(plain) * 1e3:.1f} | - | - |")
    theirs = statistics.median(peer) / kept * 1e6 if peer else None
    ratio = f"{ours / theirs:.2f}x" if theirs else "-"
    print(f"| pagedkv's core, the tier | {statistics.median(tier) * 1e3:.1f} | {ours:.2f} | {ratio} |")
    if theirs is not None:
        print(
            f"| vLLM's CPUOffloadingManager (LRU, events) | {statistics.median(peer) * 1e3:.1f} | {theirs:.2f} | 1.00x |"
        )
    else:
        print("| vLLM's CPUOffloadingManager | (vLLM not importable here) | - | - |")


if __name__ == "__main__":
    main()
