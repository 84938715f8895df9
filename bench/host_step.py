"""The engine's host work a decode step on this CPU: the real engine, scheduler and worker at B rows, the model's
forward stubbed (zero logits), with overlapped scheduling and without, each tree in its own process, alternated.

On a GPU a decode step whose host work outlasts its graph replay is the host's (bench/gpu_serve.py --overlap: the
ids' readback never waits); this measures that host work where no GPU is: a step is (a run of 64 new tokens - a run
of 1) / 63, medians of 5, 128-token prompts, one request a row, GC on (the start-up heap frozen, as an engine
process has it: app, vLLM). A tiny random Llama stands behind the stub
(the tokenizer and vocabulary SmolLM2's), so the numbers are the engine's, not a model's. Beside it, the core's
``on_tokens`` alone (the overlapped step's ids read a step late) at the same rows awaiting their ids: a pure call
timed on one state, the best of 15 x 50 calls (steady where the machine is not).

    python bench/host_step.py --rows 256 --trees main=.,old=.devold/1dbe227 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(HERE)  # (appended: a child's PYTHONPATH tree stays the pagedkv imported)
from children import child_result, result, tree_env  # noqa: E402


def child(rows: int) -> dict[str, float]:
    """This process's tree (PYTHONPATH): host ms a decode step, waiting and overlapped."""
    from dataclasses import replace

    import torch

    from gpu_serve import served

    from pagedkv.models.llama import SMOLLM2_SHAPES, Llama, random_llama
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.engine_args import freeze_startup
    from pagedkv.shell.sampling import SamplingParams

    torch.set_num_threads(1)
    _, meta = Llama.smollm2(device="cpu")
    tok = Tokenizer(meta)
    shape = replace(SMOLLM2_SHAPES, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)
    model = random_llama(shape)
    zeros = torch.zeros(4 * rows + 8192, 1024)

    def forward(tokens: Any, batch: Any, pool: Any, backend: Any, layout: Any, at: Any = None) -> torch.Tensor:
        return zeros[: len(at) if at is not None else batch.num_rows]

    model.forward = forward  # type: ignore[method-assign,assignment]
    out = {}
    for ahead in (False, True):  # (the same prompts in both)
        ids, eng = served(model, tok, random.Random(0), rows, kv_bytes=1 << 30, async_scheduling=ahead)

        def run(n: int) -> float:
            t0 = time.perf_counter()
            eng.generate([("", i, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for i in ids])  # noqa: B023
            return time.perf_counter() - t0

        run(4)
        freeze_startup()  # as an engine process does (vLLM's engine core too); undone before the engine goes
        out["overlapped" if ahead else "waiting"] = statistics.median((run(64) - run(1)) / 63 * 1e3 for _ in range(5))
        gc.unfreeze()
    out["on_tokens"] = on_tokens_ms(rows)
    return out


def on_tokens_ms(rows: int) -> float:
    """``on_tokens`` of ``rows`` decoding requests whose rows grew by a placeholder: ms a call, best of 15 x 50."""
    import timeit

    from pagedkv.core import CacheConfig
    from pagedkv.core.scheduler import (
        SchedulerConfig,
        SeqRequest,
        new_scheduler,
        on_output,
        on_tokens,
        schedule,
        submit,
    )

    s = new_scheduler(
        CacheConfig(block_size=16, num_blocks=rows * 20 + 1, enable_prefix_caching=True),
        SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=rows * 130),
    )
    for i in range(rows):
        s = submit(s, SeqRequest(f"r{i}", tuple(range(1 + i, 129 + i)), max_tokens=1000)).unwrap()
    s, plan = schedule(s).unwrap()  # (every prompt in one step)
    s, _ = on_output(s, dict.fromkeys(plan.samples, 5)).unwrap()
    pending: dict[Any, int] = {}
    for k in range(5):  # decode steps ahead of their ids
        s, plan = schedule(s).unwrap()
        if pending:
            s, _ = on_tokens(s, pending).unwrap()
        s, _ = on_output(s, dict.fromkeys(plan.samples)).unwrap()
        pending = dict.fromkeys(plan.samples, 7 + k)
    s, _ = schedule(s).unwrap()  # (the rows grown by a placeholder, awaiting ``pending``)
    return min(timeit.repeat(lambda: on_tokens(s, pending).unwrap(), number=50, repeat=15)) / 50 * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--trees", default="main=.", help="name=PATH,... (each tree run with PYTHONPATH=PATH)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result(child(args.rows))
        return
    trees = [t.split("=", 1) for t in args.trees.split(",")]
    got: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for r in range(args.repeats):
        for name, path in trees[r % len(trees) :] + trees[: r % len(trees)]:
            cmd = [sys.executable, os.path.join(HERE, "host_step.py"), "--child", "--rows", str(args.rows)]
            one = child_result(cmd, tree_env(path, only=True), name)
            if one is None:
                sys.exit(1)
            got[name].append(one)
    base = trees[0][0]
    print(f"host ms a decode step, {args.rows} rows, forward stubbed, medians of {args.repeats} processes a tree")
    print(f"| tree | waiting | overlapped | overlapped vs {base} | each overlapped run | on_tokens alone (ms) |")
    print("|---|---:|---:|---:|---|---:|")
    ref = statistics.median(x["overlapped"] for x in got[base])
    for name, _ in trees:
        w = statistics.median(x["waiting"] for x in got[name])
        o = statistics.median(x["overlapped"] for x in got[name])
        runs = ", ".join(f"{x['overlapped']:.2f}" for x in got[name])
        alone = min(x["on_tokens"] for x in got[name])
        print(f"| {name} | {w:.2f} | {o:.2f} | {o / ref:.2f}x | {runs} | {alone:.3f} |")


if __name__ == "__main__":
    main()
