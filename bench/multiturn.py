"""The prefix cache's host tier on a multi-turn workload (issue 51), on the real SmolLM2 weights: conversations of
several turns, each turn's prompt its whole history (the chat template over every message so far), all
conversations live at once (each submits its next turn as soon as its last answer is done), a pool that holds
about a quarter of the live histories; with and without the tier: the prefix hit rate, the tier's blocks loaded,
time to first token (p50, p90) and tokens/s; then a workload with no reuse (every prompt new) for what the tier
costs where it cannot help. GC on, as engines run, with its collections a step.

    python bench/multiturn.py                                     # CPU, fp32
    python bench/multiturn.py --device cuda --dtype bfloat16 --conversations 64 --turns 8
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

from pagedkv.models.llama import Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams

TOPICS = ["rivers", "bread", "chess", "glass", "bees", "rain", "maps", "salt", "clocks", "snow", "ships", "tea"]


def serve(
    model: Any, tok: Any, convs: int, turns: int, answer: int, pool: int, gib: float | None, reuse: bool
) -> dict[str, float]:
    """``convs`` conversations of ``turns`` turns served together; the run's figures."""
    eng = Engine(model, tok, kv_cache_memory_bytes=pool, max_num_seqs=convs, kv_offloading_size=gib)
    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True)
    history: list[list[dict[str, str]]] = [[] for _ in range(convs)]
    turn = [0] * convs
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    owner: dict[str, int] = {}

    def submit(c: int) -> None:
        if not reuse:  # (no reuse: every prompt a new conversation of one turn)
            history[c] = []
        topic = TOPICS[c % len(TOPICS)]
        ask = f"Reader {c} asks: tell me something about {topic} ({turn[c]})."
        if not reuse:  # (its own first words: nothing past the template's system prompt is shared)
            ask = f"Question {c}.{turn[c]}: tell me something about {topic}."
        history[c].append({"role": "user", "content": ask})
        rid = f"c{c}-t{turn[c]}"
        owner[rid] = c
        submitted[rid] = time.perf_counter()
        eng.add_request(rid, "", tok.encode(tok.apply_chat_template(history[c])), params)

    def on_token(rid: Any, _tok: int) -> None:
        first.setdefault(rid, time.perf_counter())

    gc0 = sum(g["collections"] for g in gc.get_stats())
    t0 = time.perf_counter()
    for c in range(convs):
        submit(c)
    made = 0
    while eng.has_unfinished():
        for done in eng.step(on_token):
            c = owner[done.request_id]
            made += len(done.token_ids)
            history[c].append({"role": "assistant", "content": tok.decode(done.token_ids)})
            turn[c] += 1
            if turn[c] < turns:
                submit(c)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ttft = sorted(first[r] - submitted[r] for r in first)
    tier = eng.host_pages
    return {
        "hit": eng.state.kv.prefix_hit_rate,
        "loaded": tier.loaded if tier else 0,
        "ttft50": statistics.median(ttft) * 1e3,
        "ttft90": ttft[min(int(0.9 * len(ttft)), len(ttft) - 1)] * 1e3,
        "tps": made / wall,
        "gc": (sum(g["collections"] for g in gc.get_stats()) - gc0) / max(eng.stats.steps, 1),
        "preempted": eng.stats.preemptions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer", type=int, default=16, help="tokens an answer")
    ap.add_argument("--tier-gib", type=float, default=0.5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, meta = Llama.smollm2(device=args.device, dtype=getattr(torch, args.dtype))
    tok = Tokenizer(meta)
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(model.dtype).bits // 8
    # a history's tokens at its last turn: the template's, and each turn's question and answer
    last = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}]))) + args.turns * (
        24 + args.answer
    )
    pool = per_token * args.conversations * last // 4
    print(
        f"SmolLM2-135M-Instruct, {args.device} {args.dtype}, {args.threads} thread(s); {args.conversations} "
        f"conversations x {args.turns} turns, {args.answer}-token answers; a pool of {pool >> 20} MiB (about a "
        f"quarter of the live histories), a host tier of {args.tier_gib} GiB"
    )
    if model.device.type == "cuda":  # (kernels compiled and graphs warmed before anything is timed)
        for gib in (None, args.tier_gib):
            serve(model, tok, 4, 2, 4, pool, gib, True)
    print("\n| workload | tier | prefix hit rate | tier blocks loaded | TTFT p50 (ms) | TTFT p90 (ms) | tok/s | "
          "preempted | GC a step |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for reuse in (True, False):
        for gib in (None, args.tier_gib):
            r = serve(model, tok, args.conversations, args.turns, args.answer, pool, gib, reuse)
            print(
                f"| {'multi-turn' if reuse else 'no reuse'} | {'-' if gib is None else f'{gib} GiB'} | {r['hit']:.1%} | "
                f"{r['loaded']} | {r['ttft50']:.0f} | {r['ttft90']:.0f} | {r['tps']:.1f} | {r['preempted']} | "
                f"{r['gc']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
