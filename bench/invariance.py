"""Are a request's tokens its own, whatever else is in the batch? Issue 50's table on the real SmolLM2 weights:
each chat prompt served alone, then in company (a full batch, batch 7, overlapped scheduling, n-gram drafts alone
and batched, a pool that preempts, prompts chunked), greedy, with each token's logprob (so a request is identical
only when its logits' bits are): how many requests get what they got alone, and where the first divergence is; the
default path beside ``batch_invariant=True``, and what the invariant path costs (seconds of the same run). GC on.

    python bench/invariance.py                                                # CPU, fp32, 16 prompts x 24 tokens
    python bench/invariance.py --device cuda --dtype bfloat16 --prompts 48 --tokens 64

Then the cost a step: the median decode step at batch 64 and 256 (CUDA; 8 on the CPU), and the median step that
carries prompts (that many 128-token prompts arriving together), default and invariant.
"""

from __future__ import annotations

import argparse

import torch

from pagedkv.models.llama import Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.sampling import SamplingParams
from tests.invariance_rig import chat_prompts, step_seconds, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--preempting-pool", type=int, default=None, help="KV bytes of the pool that preempts")
    ap.add_argument("--step-batches", default=None, help="batches whose step times are compared (default: 64,256 "
                    "on CUDA, 8 on the CPU; 0: none)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, meta = Llama.smollm2(device=args.device, dtype=getattr(torch, args.dtype))
    tok = Tokenizer(meta)
    prompts = chat_prompts(tok, args.prompts)
    # (a pool of about a third of what the batch needs: bytes a token, times the tokens, over three)
    per_token = 2 * model.config.num_layers * model.config.num_kv_heads * model.config.head_dim
    per_token *= torch.finfo(model.dtype).bits // 8
    pool = args.preempting_pool or per_token * sum(len(p) + args.tokens for p in prompts) // 3
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0)
    print(
        f"SmolLM2-135M-Instruct, {args.device} {args.dtype}, {args.threads} thread(s), {len(prompts)} chat prompts x "
        f"{args.tokens} greedy tokens (each with its logprob), the preempting pool {pool >> 10} KiB"
    )
    runs = {mode: table(model, tok, prompts, params, pool, batch_invariant=mode) for mode in (False, True)}
    n = len(prompts)
    print("\n| served as | default: same tokens | same bits | first divergence | batch-invariant: same tokens | same "
          "bits | first divergence | seconds default | seconds invariant | invariant / default | steps | preempted | GC a "
          "step default / invariant |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for d, i in zip(runs[False], runs[True]):
        first = {k: "-" if r["first"] is None else f"token {r['first']} (median {r['median first']})" for k, r in
                 (("d", d), ("i", i))}  # fmt: skip
        print(
            f"| {d['served as']} | {d['tokens']} / {n} | {d['identical']} / {n} | {first['d']} | {i['tokens']} / {n} | "
            f"{i['identical']} / {n} | {first['i']} | {d['seconds']:.1f} | {i['seconds']:.1f} | "
            f"{i['seconds'] / d['seconds']:.2f}x | {i['steps']} | {i['preempted']} | {d['gc']:.2f} / {i['gc']:.2f} |",
            flush=True,
        )
    chosen = args.step_batches or ("64,256" if args.device.startswith("cuda") else "8")
    batches = [int(b) for b in chosen.split(",") if int(b)]
    if batches:
        print("\n| batch | decode step default (ms) | invariant (ms) | invariant / default | prefill step default (ms) "
              "| invariant (ms) | invariant / default |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        pool = 2 * per_token * b * (128 + 32)
        d, i = (
            step_seconds(model, tok, b, 128, 32, kv_cache_memory_bytes=pool, batch_invariant=m) for m in (False, True)
        )
        print(
            f"| {b} | {d['decode'] * 1e3:.1f} | {i['decode'] * 1e3:.1f} | {i['decode'] / d['decode']:.2f}x | "
            f"{d['prefill'] * 1e3:.1f} | {i['prefill'] * 1e3:.1f} | {i['prefill'] / d['prefill']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
