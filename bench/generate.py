"""Tokens per second of pagedkv vs transformers' own generate, same prompts, this CPU.

Greedy, 32 new tokens per prompt, fp32, batch 1 (one prompt) and batch 16 (16 prompts at
once; transformers gets them left-padded in one generate call). Prints a table with the ratio.

    python bench/generate.py
"""

from __future__ import annotations

import argparse
import os
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    model, meta = Llama.smollm2()
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path()), gguf_file=SMOLLM2_FILE, dtype=torch.float32
    ).eval()
    rows = []
    for b in args.batches:
        texts = [
            tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}])
            for i in range(b)
        ]
        ids = [tok.encode(t) for t in texts]
        # pagedkv: no early stop, so both sides produce exactly args.new tokens per prompt
        eng = Engine(model, tok, kv_cache_memory_bytes=128 << 20, max_num_seqs=max(b, 1))
        eng.tokenizer = NoStop(tok)
        t0 = time.perf_counter()
        done = eng.generate([(t, i, SamplingParams(max_tokens=args.new)) for t, i in zip(texts, ids)])
        ours = sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0)
        width = max(map(len, ids))
        pad = tok.eos_token_id
        batch = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                batch,
                attention_mask=mask,
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                do_sample=False,
                pad_token_id=pad,
            )
        theirs = (out.shape[1] - width) * b / (time.perf_counter() - t0)
        rows.append((b, ours, theirs))
    print(
        f"greedy, {args.new} new tokens per prompt, fp32, CPU ({torch.get_num_threads()} threads); "
        "baseline: transformers' generate in the same run"
    )
    print(f"{'batch':>6} {'pagedkv tok/s':>14} {'transformers tok/s':>19} {'ratio':>6}")
    for b, ours, theirs in rows:
        print(f"{b:>6} {ours:>14.1f} {theirs:>19.1f} {ours / theirs:>6.2f}")


class NoStop:
    """The tokenizer with no stop tokens, so that every request makes exactly --new tokens."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.stop_token_ids: frozenset[int] = frozenset()

    def __getattr__(self, name: str) -> object:
        return getattr(self._tok, name)


if __name__ == "__main__":
    main()
