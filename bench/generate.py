"""Tokens per second of pagedkv against transformers' own generate, same weights, same prompt ids, this CPU.

SmolLM2-135M-Instruct in fp32 (the README's model), greedy, no early stop on either side (pagedkv with
``ignore_eos``, transformers with ``min_new_tokens``): every request makes exactly the tokens it asks for,
and the script checks that it did. Both sides are warmed up first, then timed in alternating runs (pagedkv,
transformers, pagedkv, ...); the table gives the median of each and their ratio.

Workloads:

- ``batch1``: one chat prompt, ``--new`` tokens.
- ``batch16``: 16 chat prompts at once (transformers gets them left-padded in one ``generate`` call).
- ``mixed``: ``--mixed`` requests with prompts of 16-320 tokens and outputs of 8-128 (a fixed pseudo-random draw),
  16 at a time. pagedkv serves them with continuous batching (``max_num_seqs`` 16: a finished request's row
  is taken by the next at once); transformers, with a static batch, takes them 16 at a time in the same order,
  each batch left-padded and run to its longest output. Tokens/s counts the tokens the requests asked for.

    python bench/generate.py                      # all three workloads, 3 timed runs each
    python bench/generate.py --workloads mixed --runs 5
    python bench/generate.py --async-scheduling   # pagedkv's engine overlapped (on a CPU nothing to overlap: its cost)
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from pagedkv.models.gguf import SMOLLM2_FILE, smollm2_path
from pagedkv.models.llama import Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Translate 'good morning' into French.",
    "What is a paged KV cache?",
]
FILLER = (
    "A paged key-value cache splits each sequence's attention state into fixed-size blocks, so that memory is "
    "taken as a sequence grows and given back the moment it ends, and blocks with the same leading tokens can be "
    "shared between requests. The scheduler decides which requests run each step and how many tokens each one "
    "computes, within a budget of rows and tokens. "
)

Workload = list[tuple[list[int], int]]  # (prompt ids, new tokens) per request, in arrival order


def chat(tok: Tokenizer, n: int, new: int) -> Workload:
    texts = [
        tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}])
        for i in range(n)
    ]
    return [(tok.encode(t), new) for t in texts]


def mixed(tok: Tokenizer, n: int) -> Workload:
    rng = random.Random(0)
    filler = tok.encode(FILLER * 8)
    out = []
    for i in range(n):
        head = tok.encode(
            tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}])
        )
        length = rng.randint(16, 320)
        ids = (filler[rng.randrange(64) :] + head)[-length:] if length > len(head) else head
        out.append((ids, rng.randint(8, 128)))
    return out


GC_RUNS = [0, 0, 0]  # CPython's collections by generation during pagedkv's runs (the GC on, as engines run)
STEPS = [0]  # pagedkv's engine steps over those runs


def _count_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        GC_RUNS[info["generation"]] += 1


def run_pagedkv(model: Llama, tok: Tokenizer, work: Workload, rows: int, ahead: bool = False) -> int:
    eng = Engine(model, tok, kv_cache_memory_bytes=256 << 20, max_num_seqs=rows, async_scheduling=ahead)
    params = [SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True) for _, new in work]
    gc.callbacks.append(_count_gc)
    try:
        done = eng.generate([(tok.decode(ids), ids, p) for (ids, _), p in zip(work, params)])
    finally:
        gc.callbacks.remove(_count_gc)
    STEPS[0] += eng.stats.steps
    made = [len(c.token_ids) for c in done]
    if made != [new for _, new in work]:
        raise SystemExit(f"pagedkv made {made}, not the tokens asked for")
    return sum(made)


def run_transformers(hf: object, pad: int, work: Workload, rows: int) -> int:
    made = 0
    for k in range(0, len(work), rows):
        part = work[k : k + rows]
        width = max(len(ids) for ids, _ in part)
        longest = max(new for _, new in part)
        batch = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in part])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in part])
        with torch.no_grad():
            out = hf.generate(  # type: ignore[attr-defined]
                batch,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
        if out.shape[1] - width != longest:
            raise SystemExit(f"transformers made {out.shape[1] - width} tokens a row, not {longest}")
        made += sum(new for _, new in part)  # what the requests asked for (the rest is padding's)
    return made


def timed(fn: Callable[[], int]) -> float:
    t0 = time.perf_counter()
    tokens = fn()
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=32, help="new tokens a request in batch1 and batch16")
    ap.add_argument("--mixed", type=int, default=48, help="requests in the mixed workload")
    ap.add_argument("--runs", type=int, default=3, help="timed runs a side (alternating), after one warm-up each")
    ap.add_argument("--workloads", nargs="+", default=["batch1", "batch16", "mixed"])
    ap.add_argument(
        "--async-scheduling", action="store_true", help="pagedkv's engine overlapped (its ids read a step late)"
    )
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    model, meta = Llama.smollm2()
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path()), gguf_file=SMOLLM2_FILE, dtype=torch.float32
    ).eval()
    pad = tok.eos_token_id
    rows = []
    for name in args.workloads:
        if name == "batch1":
            work, width = chat(tok, 1, args.new), 1
        elif name == "batch16":
            work, width = chat(tok, 16, args.new), 16
        elif name == "mixed":
            work, width = mixed(tok, args.mixed), 16
        else:
            raise SystemExit(f"unknown workload {name!r} (batch1, batch16, mixed)")
        ours_fn = lambda: run_pagedkv(model, tok, work, width, args.async_scheduling)  # noqa: E731
        theirs_fn = lambda: run_transformers(hf, pad, work, width)  # noqa: E731
        ours_fn(), theirs_fn()  # warm-up
        ours, theirs = [], []
        GC_RUNS[:], STEPS[0] = [0, 0, 0], 0
        for _ in range(args.runs):
            ours.append(timed(ours_fn))
            theirs.append(timed(theirs_fn))
        rows.append((name, len(work), sum(n for _, n in work), statistics.median(ours), statistics.median(theirs)))
        print(f"  {name}: pagedkv {[round(x, 1) for x in ours]}, transformers {[round(x, 1) for x in theirs]}")
        per = [round(g / max(STEPS[0], 1), 3) for g in GC_RUNS]
        print(f"  {name}: pagedkv's GC collections a step (gen 0 / 1 / 2, {STEPS[0]} steps): {per}")
    print(
        f"greedy, no early stop, fp32, CPU ({torch.get_num_threads()} threads), pagedkv "
        f"{'overlapped' if args.async_scheduling else 'waiting'}; baseline: transformers "
        f"{__import__('transformers').__version__} generate, same run; median of {args.runs} alternating runs"
    )
    print(
        f"{'workload':>9} {'requests':>9} {'tokens':>7} {'pagedkv tok/s':>14} {'transformers tok/s':>19} {'ratio':>6}"
    )
    for name, n, tokens, ours_tps, theirs_tps in rows:
        print(f"{name:>9} {n:>9} {tokens:>7} {ours_tps:>14.1f} {theirs_tps:>19.1f} {ours_tps / theirs_tps:>6.2f}")


if __name__ == "__main__":
    main()
