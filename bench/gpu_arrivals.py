"""The arrival mix at a real model's shapes, pagedkv beside vLLM on one card (issue 63: "under the arrival mix on the 8B
shape, TTFT p50 and ITL p99 at most vLLM's"): the same checkpoint (../shared/vllm_gpu's, ``/tmp/ckpt_<shape>``), the
same prompt ids (its ``prompts.make_prompts``), the same output lengths (lognormal, median ~100, ignore_eos) and the same
Poisson arrival times, each engine driven the way a server drives it: requests added when their time comes, one engine
step at a time, each token's time taken when the step hands it to the host. TTFT: from a request's arrival time to its
first token; ITL: between a request's consecutive tokens.

- pagedkv: ``Engine.add_request`` / ``Engine.step(on_token)``, overlapped scheduling (``async_scheduling``);
  ``pagedkv-sync``: the same without overlap (each step's tokens on the host before the next step is scheduled);
- vLLM 0.25.1: its v1 ``LLMEngine`` (``add_request(request_id, {"prompt_token_ids": ...}, SamplingParams,
  arrival_time=...)``, ``step()``, its outputs' token counts), its defaults otherwise (CUDA graphs, torch.compile,
  async scheduling), with ``/tmp/site`` (../shared/vllm_gpu's install) on its path.

Each engine in a process of its own, alternated over ``--repeats``; one table. On the device machine, vLLM staged
(../shared/vllm_gpu/README.md) and its checkpoint built (``bench_vllm.py --shape 8b --build-only`` or a run of it):

    python bench/gpu_arrivals.py --checkpoint /tmp/ckpt_8b --prompts-dir .vw2/tools --rate 20 --requests 400
    python bench/gpu_arrivals.py --engines pagedkv,pagedkv-sync --shape tiny --device cpu --requests 16 --rate 50 --kv-gib 1 --time-steps  # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(HERE)  # (appended: a child's PYTHONPATH tree stays the pagedkv imported)
from children import child_result, result, tree_env  # noqa: E402


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[float, list[int], int]]:
    """(arrival second, prompt ids, new tokens) a request, in arrival order: what both engines serve."""
    for where in (args.prompts_dir, os.path.join(HERE, "..", "..", "shared", "vllm_gpu")):
        if where and os.path.exists(os.path.join(where, "prompts.py")):
            sys.path.insert(0, os.path.abspath(where))
            break
    from prompts import make_prompts  # (../shared/vllm_gpu's: the ids vLLM's side serves)

    ids = make_prompts(args.requests, args.seed, vocab)
    rng = random.Random(args.seed + 1)
    out, t = [], 0.0
    for p in ids:
        t += rng.expovariate(args.rate)
        out.append((t, p, min(max(int(rng.lognormvariate(4.6, 0.7)), 4), args.max_new)))
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(int(q * len(xs)), len(xs) - 1)] * 1e3 if xs else float("nan")


class Clock:
    """Requests served as they arrive, their tokens timed as each step hands them to the host: ``run`` adds each
    request when its time comes (seconds from the run's start) and steps the engine while any is unfinished;
    ``token`` marks a request's token (its first: the time to it from its arrival; the next ones: the gaps)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: dict[Any, float] = {}
        self.last: dict[Any, float] = {}
        self.gaps: list[float] = []
        self.calls: list[tuple[float, int]] = []  # (a step call's seconds, first tokens it handed out)

    def token(self, rid: Any, _tok: int | None = None) -> None:
        now = time.perf_counter() - self.t0
        if rid not in self.first:
            self.first[rid] = now
        else:
            self.gaps.append(now - self.last[rid])
        self.last[rid] = now

    def run(
        self, times: list[float], add: Callable[[int], None], step: Callable[[], None], busy: Callable[[], bool]
    ) -> float:
        """Request k added (``add(k)``) once ``times[k]`` seconds have passed, ``step()`` while ``busy()``, idle
        waits slept: the run's wall seconds."""
        self.t0 = time.perf_counter()
        k = 0
        while k < len(times) or busy():
            now = time.perf_counter() - self.t0
            while k < len(times) and times[k] <= now:
                add(k)
                k += 1
            if busy():
                t, firsts = time.perf_counter(), len(self.first)
                step()
                self.calls.append((time.perf_counter() - t, len(self.first) - firsts))
            elif k < len(times):
                time.sleep(max(0.0, times[k] - (time.perf_counter() - self.t0)))
        return time.perf_counter() - self.t0

    def figures(self, arrivals: dict[Any, float], made: int, wall: float) -> dict[str, Any]:
        """TTFT and ITL percentiles (ms), tokens a second over the run."""
        ttft = [self.first[r] - arrivals[r] for r in self.first]
        firsts = [t for t, f in self.calls if f]
        others = [t for t, f in self.calls if not f]
        return {
            "requests": len(arrivals),
            "answered": len(self.first),
            "tok_s": made / wall,
            "wall_s": wall,
            "ttft_p50_ms": pct(ttft, 0.5),
            "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(self.gaps, 0.5),
            "itl_p99_ms": pct(self.gaps, 0.99),
            # The step calls as the caller sees them (either engine alike; overlapped, a call's wait is the step
            # before's device time): those that handed out first tokens (prompts' steps) and the others.
            "first_call_p50_ms": pct(firsts, 0.5),
            "first_call_p99_ms": pct(firsts, 0.99),
            "other_call_p50_ms": pct(others, 0.5),
            "other_call_p99_ms": pct(others, 0.99),
            "first_calls": len(firsts),
            "firsts_a_call": len(self.first) / max(1, len(firsts)),
        }


def step_figures(steps: list[tuple[int, int, float]]) -> dict[str, Any]:
    """The engine's timed steps (``time_steps``: each synchronised, so overlap is lost) by kind: those that carry
    prompt tokens and those that decode only, ms p50 / p99, and the slowest eight (decode rows, prompt tokens, ms)."""
    prompt = [t for _, p, t in steps if p]
    decode = [t for _, p, t in steps if not p]
    return {
        "steps": len(steps),
        "prompt_steps": len(prompt),
        "prompt_tokens_p50": statistics.median([p for _, p, _ in steps if p]) if prompt else 0,
        "prompt_step_p50_ms": pct(prompt, 0.5),
        "prompt_step_p99_ms": pct(prompt, 0.99),
        "decode_step_p50_ms": pct(decode, 0.5),
        "decode_step_p99_ms": pct(decode, 0.99),
        "slowest": [(r, p, round(t * 1e3, 2)) for r, p, t in sorted(steps, key=lambda x: -x[2])[:8]],
    }


def run_pagedkv(args: argparse.Namespace, overlap: bool) -> dict[str, Any]:
    import torch

    from pagedkv.models.llama import IdTokenizer
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.engine_args import freeze_startup
    from pagedkv.shell.sampling import SamplingParams

    from llama_shapes import load

    model = load(args.checkpoint, args.shape, args.device)[0]
    reqs = workload(args, model.config.vocab_size)
    eng = Engine(model, IdTokenizer(), kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget, enable_prefix_caching=False,
                 async_scheduling=overlap and args.device == "cuda", time_steps=args.time_steps,
                 long_prefill_token_threshold=args.long_prefill_token_threshold)  # fmt: skip
    if args.flat_tokens is not None:  # (an experiment: the runner's layout rule, ModelRunner.flat_tokens)
        eng.runner.flat_tokens = args.flat_tokens
    if args.pieces is not None:
        eng.runner.pieces = args.pieces == "on"
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.generate([("", p, warm) for _, p, _ in reqs[:8]])  # (first calls' set-up, graphs captured)
    freeze_startup()  # as an engine process does (vLLM's engine core too): the start-up heap not walked again
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    if eng.step_times is not None:
        eng.step_times.clear()
    clock = Clock()

    def add(k: int) -> None:
        eng.add_request(
            f"a{k}", "", reqs[k][1], SamplingParams(temperature=0.0, max_tokens=reqs[k][2], ignore_eos=True)
        )

    def step() -> None:
        eng.step(clock.token)

    wall = clock.run([t for t, _, _ in reqs], add, step, eng.has_unfinished)
    sync()
    gc.unfreeze()  # (the engine collectable again once it goes: a caller may build another in this process)
    got = clock.figures({f"a{k}": t for k, (t, _, _) in enumerate(reqs)}, sum(n for _, _, n in reqs), wall)
    return got | ({"steps": step_figures(eng.step_times)} if eng.step_times is not None else {})


def run_vllm(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # (FlashInfer is not carried: bench_vllm.py's setting)
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_args = EngineArgs(model=args.checkpoint, tokenizer=args.checkpoint, dtype="bfloat16",
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget, max_model_len=2048,
                             gpu_memory_utilization=0.9, enable_prefix_caching=False, seed=0,
                             generation_config="vllm", load_format="safetensors")  # fmt: skip
    eng = LLMEngine.from_engine_args(engine_args)
    config = json.load(open(os.path.join(args.checkpoint, "config.json")))
    reqs = workload(args, config["vocab_size"])
    for k, (_, p, _) in enumerate(reqs[:8]):  # (the same warm-up as pagedkv's)
        eng.add_request(
            f"warm{k}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        )
    while eng.has_unfinished_requests():
        eng.step()
    clock, seen = Clock(), dict[str, int]()
    base = time.time() - time.perf_counter()  # (vLLM's arrival_time is wall-clock seconds: base + perf_counter)

    def add(k: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=reqs[k][2], ignore_eos=True)
        eng.add_request(f"a{k}", {"prompt_token_ids": reqs[k][1]}, params, arrival_time=base + clock.t0 + reqs[k][0])

    def step() -> None:
        for out in eng.step():  # (each output's token ids so far: the new ones came with this step)
            rid, n = out.request_id, len(out.outputs[0].token_ids)
            for _ in range(n - seen.get(rid, 0)):
                clock.token(rid)
            seen[rid] = n

    wall = clock.run([t for t, _, _ in reqs], add, step, eng.has_unfinished_requests)
    return clock.figures({f"a{k}": t for k, (t, _, _) in enumerate(reqs)}, sum(n for _, _, n in reqs), wall)


def parser() -> argparse.ArgumentParser:
    """The script's arguments (bench/gpu_guard.py's ``arrivals`` part parses its own through it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="vllm,pagedkv", help="comma list of vllm, pagedkv, pagedkv-sync")
    ap.add_argument("--checkpoint", help="the checkpoint both serve (../shared/vllm_gpu's /tmp/ckpt_<shape>)")
    ap.add_argument("--shape", default="tiny", help="pagedkv alone, no checkpoint: a random model of these shapes")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=20.0, help="requests a second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new", type=int, default=512, help="the most new tokens a request")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--kv-gib", type=float, default=40.0, help="pagedkv's KV pool")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts-dir", default=os.environ.get("PROMPTS_DIR"), help="where prompts.py is")
    ap.add_argument("--vllm-path", default="/tmp/site", help="vLLM's install, put on its process' path")
    ap.add_argument("--long-prefill-token-threshold", type=int, help="pagedkv's prompt chunk cap (default: its own)")
    ap.add_argument(
        "--flat-tokens",
        type=int,
        help="pagedkv's prefill forwards of at most this many tokens laid out "
        "a token a row and replayed (ModelRunner.flat_tokens; default: its own)",
    )
    ap.add_argument(
        "--pieces",
        choices=("on", "off"),
        help="pagedkv's prefill forwards over a replay's tokens cut into replays between requests, or not "
        "(ModelRunner.pieces; default: its own)",
    )
    ap.add_argument("--time-steps", action="store_true", help="pagedkv's steps timed (each synchronised) and shown")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.child:
        result(run_vllm(args) if args.child == "vllm" else run_pagedkv(args, overlap=args.child == "pagedkv"))
        return
    engines = [e for e in args.engines.split(",") if e]
    if any(e not in ("vllm", "pagedkv", "pagedkv-sync") for e in engines):
        ap.error(f"--engines takes vllm, pagedkv and pagedkv-sync, got {args.engines!r}")
    if "vllm" in engines and not args.checkpoint:
        ap.error("vLLM serves a checkpoint: give --checkpoint (../shared/vllm_gpu's /tmp/ckpt_<shape>)")
    results: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for r in range(args.repeats):
        for name in engines[r % len(engines) :] + engines[: r % len(engines)]:
            env = tree_env(args.vllm_path if name == "vllm" else os.path.join(HERE, ".."), only=name == "vllm")
            got = child_result([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", name], env, name)
            if got is not None:
                results[name].append(got)
    print(f"\n{args.requests} requests at {args.rate:g}/s; {args.checkpoint or args.shape}; max_num_seqs "
          f"{args.max_num_seqs}, budget {args.budget}; medians of {args.repeats}\n")  # fmt: skip
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tok_s")
    print("| engine | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL p99 / p50 | tok/s | answered |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, xs in results.items():
        if not xs:
            print(f"| {name} | failed | | | | | | |")
            continue
        m = {k: statistics.median(x[k] for x in xs) for k in keys}
        print(f"| {name} | {m['ttft_p50_ms']:.1f} | {m['ttft_p99_ms']:.1f} | {m['itl_p50_ms']:.2f} | "
              f"{m['itl_p99_ms']:.2f} | {m['itl_p99_ms'] / m['itl_p50_ms']:.2f}x | {m['tok_s']:,.0f} | "
              f"{xs[0]['answered']} / {xs[0]['requests']} |")  # fmt: skip
    print("\n| engine | calls with first tokens | firsts a call | their ms p50 / p99 | other calls' ms p50 / p99 |")
    print("|---|---:|---:|---:|---:|")
    for name, xs in results.items():
        for x in xs:
            print(f"| {name} | {x['first_calls']} | {x['firsts_a_call']:.2f} | {x['first_call_p50_ms']:.2f} / "
                  f"{x['first_call_p99_ms']:.2f} | {x['other_call_p50_ms']:.2f} / {x['other_call_p99_ms']:.2f} |")  # fmt: skip
    for name, xs in results.items():
        for x in xs:
            if "steps" in x:
                print(f"{name} steps (timed, each synchronised): {x['steps']}")


if __name__ == "__main__":
    main()
