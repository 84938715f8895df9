"""The prefix cache's host tier on a multi-turn workload (issue 51), on the real SmolLM2 weights: conversations of
several turns, each turn's prompt its whole history (the chat template over every message so far), all
conversations live at once (each submits its next turn as soon as its last answer is done), a pool that holds
about a quarter of the live histories; with and without the tier: the prefix hit rate, the tier's blocks loaded,
time to first token (p50, p90) and tokens/s; then a workload with no reuse (every prompt new) for what the tier
costs where it cannot help. GC on, as engines run, with its collections a step.

    python bench/multiturn.py                                     # CPU, fp32
    python bench/multiturn.py --device cuda --dtype bfloat16 --conversations 64 --turns 8
    python bench/multiturn.py --device cuda --shape llama-8b --conversations 32 --turns 6    # histories of 2-6k tokens
    python bench/multiturn.py --workloads preemption --pool-fraction 10 --answer 256 --system 64 --question 16
                                                                  # preempted requests restored, or recomputed
    python bench/multiturn.py --workloads no-reuse --repeats 3    # the tier's cost alone, runs alternated
    python bench/multiturn.py --store-threshold 2                 # and a tier that keeps contents seen twice

``--shape``: a random model of real shapes (bench/llama_shapes.py, transformers' init on the device), each
conversation a ``--system``-token opening of its own, then per turn a ``--question`` of new ids after the answer.
The table says whether the tier's answers are the ones the run without it gave (``--invariant``: batch-invariant
kernels, so a block loaded back or a recompute gives the bits of a run alone). ``--workloads preemption``: every
prompt new (no reuse), answers long against the prompts, so the running requests outgrow the pool and are
preempted; a preempted request's computed blocks stay cached, and those evicted while it waits go to the tier, so
its resume loads them back instead of computing them again. A reference run first, its pool holding every history
(nothing preempted); then the small pool without the tier (recomputed) and with it (restored), alternated: their
answers against the reference's (``--invariant`` for bit-equality), tokens/s, preemptions, blocks loaded.
``--store-threshold N``: a third side, a tier that keeps only contents seen in N uses (a request computing one, a
hit; vLLM's offloading store_threshold): where nothing is reused, nothing is stored.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_shapes import SHAPES, build

from pagedkv.models.llama import IdTokenizer, Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams

TOPICS = ["rivers", "bread", "chess", "glass", "bees", "rain", "maps", "salt", "clocks", "snow", "ships", "tea"]


class Chats:
    """The conversations' prompts as token ids: on SmolLM2 the chat template over every message so far; on a random
    model of real shapes (``--shape``) a ``system``-token opening of its own, then each turn's answer and a
    ``question`` of new ids."""

    def __init__(self, tok: Any, convs: int, system: int, question: int, vocab: int) -> None:
        self.tok, self.system, self.question, self.vocab = tok, system, question, vocab
        self.messages: list[list[dict[str, str]]] = [[] for _ in range(convs)]
        self.ids: list[list[int]] = [[] for _ in range(convs)]

    def _random(self, seed: int, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    def ask(self, c: int, turn: int, reuse: bool) -> list[int]:
        """Conversation ``c``'s prompt for ``turn`` (``reuse`` False: a new conversation of one turn)."""
        if self.tok is None:
            if not reuse or not self.ids[c]:
                self.ids[c] = self._random(1_000_000 + 1000 * c + (0 if reuse else turn), self.system)
            self.ids[c] += self._random(1000 * c + turn, self.question)
            return list(self.ids[c])
        if not reuse:  # (its own first words: nothing past the template's system prompt is shared)
            self.messages[c] = []
        topic = TOPICS[c % len(TOPICS)]
        ask = f"Reader {c} asks: tell me something about {topic} ({turn})."
        if not reuse:
            ask = f"Question {c}.{turn}: tell me something about {topic}."
        self.messages[c].append({"role": "user", "content": ask})
        return self.tok.encode(self.tok.apply_chat_template(self.messages[c]))  # type: ignore[no-any-return]

    def answered(self, c: int, ids: list[int]) -> None:
        if self.tok is None:
            self.ids[c] += ids
        else:
            self.messages[c].append({"role": "assistant", "content": self.tok.decode(ids)})


def serve(
    model: Any,
    tok: Any,
    convs: int,
    turns: int,
    answer: int,
    pool: int,
    gib: float | None,
    reuse: bool,
    args: argparse.Namespace,
    threshold: int = 0,
) -> dict[str, Any]:
    """``convs`` conversations of ``turns`` turns served together; the run's figures and answers. ``threshold``: the
    tier keeps only contents seen in that many uses (``kv_offloading_store_threshold``)."""
    eng = Engine(model, tok or IdTokenizer(), kv_cache_memory_bytes=pool, max_num_seqs=convs, kv_offloading_size=gib,
                 kv_offloading_store_threshold=threshold, batch_invariant=args.invariant,
                 async_scheduling=args.overlap)  # fmt: skip
    if eng.host_pages is not None and args.in_flight_gib is not None:  # (HostPages' bound on the stores in flight)
        eng.host_pages.max_in_flight_bytes = int(args.in_flight_gib * 2**30)
    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True)
    chats = Chats(tok, convs, args.system, args.question, model.config.vocab_size)
    turn = [0] * convs
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    owner: dict[str, int] = {}
    answers: dict[str, list[int]] = {}

    def submit(c: int) -> None:
        rid = f"c{c}-t{turn[c]}"
        owner[rid] = c
        prompt = chats.ask(c, turn[c], reuse)
        submitted[rid] = time.perf_counter()
        eng.add_request(rid, "", prompt, params)

    def on_token(rid: Any, _tok: int) -> None:
        first.setdefault(rid, time.perf_counter())

    gc0 = sum(g["collections"] for g in gc.get_stats())
    t0 = time.perf_counter()
    for c in range(convs):
        submit(c)
    made = 0
    while eng.has_unfinished():
        for done in eng.step(on_token):
            c = owner[str(done.request_id)]
            made += len(done.token_ids)
            answers[str(done.request_id)] = list(done.token_ids)
            chats.answered(c, list(done.token_ids))
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
        "stored": tier.stored if tier else 0,
        "ttft50": statistics.median(ttft) * 1e3 if ttft else float("nan"),  # (none: every prompt over the pool)
        "ttft90": ttft[min(int(0.9 * len(ttft)), len(ttft) - 1)] * 1e3 if ttft else float("nan"),
        "tps": made / wall,
        "gc": (sum(g["collections"] for g in gc.get_stats()) - gc0) / max(eng.stats.steps, 1),
        "preempted": eng.stats.preemptions,
        "answers": answers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a random model of these shapes instead of SmolLM2")
    ap.add_argument("--system", type=int, default=2048, help="--shape: a conversation's opening, in tokens")
    ap.add_argument("--question", type=int, default=256, help="--shape: each turn's new tokens")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer", type=int, default=16, help="tokens an answer")
    ap.add_argument("--tier-gib", type=float, default=0.5)
    ap.add_argument("--in-flight-gib", type=float, help="the tier's bound on stores in flight (default 1 GiB)")
    ap.add_argument("--store-threshold", type=int, default=0, help="the tier keeps a content seen in N uses (N >= 2)")
    ap.add_argument("--pool-fraction", type=float, default=4.0, help="the pool holds 1/N of the live histories")
    ap.add_argument("--invariant", action="store_true", help="batch_invariant: every answer's bits as alone")
    ap.add_argument("--overlap", action="store_true", help="async_scheduling: the next step planned while one runs")
    ap.add_argument("--workloads", default="multi-turn,no-reuse", help="which of multi-turn,no-reuse,preemption to run")
    ap.add_argument("--repeats", type=int, default=1, help="runs without and with the tier, alternated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.shape:
        model = build(args.shape, args.device)[0]
        tok, name = None, f"a random {args.shape}"
        opening, each = args.system, args.question
    else:
        model, meta = Llama.smollm2(device=args.device, dtype=getattr(torch, args.dtype))
        tok, name = Tokenizer(meta), "SmolLM2-135M-Instruct"
        opening, each = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}]))), 24
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(model.dtype).bits // 8
    last = opening + args.turns * (each + args.answer)  # a history's tokens at its last turn
    pool = int(per_token * args.conversations * last / args.pool_fraction)
    print(
        f"{name}, {args.device} {model.dtype}, {args.threads} thread(s); {args.conversations} conversations x "
        f"{args.turns} turns (histories up to {last} tokens), {args.answer}-token answers; a pool of {pool >> 20} MiB "
        f"(1/{args.pool_fraction:g} of the live histories), a host tier of {args.tier_gib} GiB"
        + ("; batch-invariant" if args.invariant else "")
        + ("; overlapped scheduling" if args.overlap else "")
        + (f"; the tier keeps contents seen in {args.store_threshold} uses" if args.store_threshold > 1 else "")
    )
    if model.device.type == "cuda":  # (kernels compiled and graphs warmed before anything is timed)
        for gib in (None, args.tier_gib):
            serve(model, tok, 4, 2, 4, pool, gib, True, args)
    print("\n| workload | tier | prefix hit rate | tier blocks stored / loaded | TTFT p50 (ms) | TTFT p90 (ms) | tok/s | "
          "preempted | answers as without the tier (preemption: as the reference) | GC a step |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    asked = args.workloads.split(",")
    for reuse in (True, False):
        if ("multi-turn" if reuse else "no-reuse") in asked:
            alternated(model, tok, "multi-turn" if reuse else "no reuse", pool, reuse, None, args)
    if "preemption" in asked:  # (the reference: a pool that holds every history, nothing preempted)
        whole = per_token * args.conversations * last
        ref = serve(model, tok, args.conversations, args.turns, args.answer, whole, None, False, args)
        row("preemption, every history in the pool", None, ref, "-")
        alternated(model, tok, "preemption", pool, False, ref["answers"], args)


def alternated(
    model: Any, tok: Any, workload: str, pool: int, reuse: bool, reference: Any, args: argparse.Namespace
) -> None:
    """Runs without and with the tier (and with ``--store-threshold``'s, where given), alternated ``--repeats``
    times, a row each, each run's answers against ``reference``'s (None: the first run's); then the runs' median
    tok/s a side against the side without (with ``--repeats`` over 1)."""
    sides: list[tuple[float | None, int]] = [(None, 0), (args.tier_gib, 0)]
    if args.store_threshold > 1:
        sides.append((args.tier_gib, args.store_threshold))
    tps: dict[tuple[float | None, int], list[float]] = {side: [] for side in sides}
    for _ in range(args.repeats):
        for gib, threshold in sides:
            r = serve(model, tok, args.conversations, args.turns, args.answer, pool, gib, reuse, args, threshold)
            same = "-" if reference is None else "yes" if r["answers"] == reference else "NO"
            row(workload, gib, r, same, threshold)
            reference = reference or r["answers"]
            tps[gib, threshold].append(r["tps"])
    if args.repeats > 1:
        off = statistics.median(tps[None, 0])
        print(f"\n{workload}: tok/s median {off:.1f} without the tier (runs {min(tps[None, 0]):.1f}-"
              f"{max(tps[None, 0]):.1f})", flush=True)  # fmt: skip
        for gib, threshold in sides[1:]:
            on = statistics.median(tps[gib, threshold])
            print(f"  with it{f' (kept at {threshold} uses)' if threshold else ''}: {on:.1f} "
                  f"({on / off - 1 if off else float('nan'):+.1%}; runs {min(tps[gib, threshold]):.1f}-"
                  f"{max(tps[gib, threshold]):.1f})", flush=True)  # fmt: skip


def row(workload: str, gib: float | None, r: dict[str, Any], same: str, threshold: int = 0) -> None:
    tier = "-" if gib is None else f"{gib} GiB" + (f", kept at {threshold} uses" if threshold else "")
    print(
        f"| {workload} | {tier} | {r['hit']:.1%} | {r['stored']} / {r['loaded']} | "
        f"{r['ttft50']:.0f} | "
        f"{r['ttft90']:.0f} | {r['tps']:.1f} | {r['preempted']} | {same} | {r['gc']:.2f} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
