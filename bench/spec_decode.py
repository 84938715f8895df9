"""Speculative decoding by n-gram prompt lookup: tokens per second, engine steps and acceptance, with and
without drafts, on SmolLM2-135M-Instruct (the real weights), greedy.

Two workloads: a repetitive one (code edits and summaries that quote their input: the answer repeats much
of the prompt) and a non-repetitive one (short questions). Each at batch 1 (prompts one after another) and
batch 8 (all at once). Runs alternate (off, on, off, on, ...) and the table gives medians; GC on, as engines
run, with its collections a step. Greedy output is checked equal with and without drafts.

    python bench/spec_decode.py                                 # CPU, fp32
    python bench/spec_decode.py --device cuda --dtype bfloat16  # a GPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from pagedkv.models.llama import Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams

CODE = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n"
    "\n    def pop(self):\n        return self.items.pop()\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n        print(i, 'is odd')\n",
    "import json\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\ndef save(path, data):\n"
    "    with open(path, 'w') as f:\n        json.dump(data, f)\n",
]
TEXT = [
    "The paged KV cache stores the keys and values of each request in fixed-size blocks. Blocks are allocated "
    "from a shared pool, so memory is not wasted on padding, and requests that share a prefix share its blocks.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It takes place in the chloroplasts, mainly in the leaves.",
]
REPETITIVE = (
    [f"Rewrite this Python code with a docstring for each function, changing nothing else:\n\n{c}" for c in CODE]
    + [f"Repeat the following text word for word, then say 'done'.\n\n{t}" for t in TEXT]
    + [f"Quote the first sentence of this text exactly:\n\n{t}" for t in TEXT]
)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Translate 'good morning' into French.",
    "Give me a tip for learning to cook.",
]


def run(model: Llama, tok: Tokenizer, prompts: list[str], batch: int, spec: dict | None, new: int) -> dict:
    eng = Engine(model, tok, speculative_config=spec, max_num_seqs=max(batch, 1), kv_cache_memory_bytes=256 << 20)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    reqs = [(t, tok.encode(t), SamplingParams(temperature=0.0, max_tokens=new)) for t in texts]
    gc0 = sum(g["collections"] for g in gc.get_stats())
    t0 = time.perf_counter()
    out = []
    for k in range(0, len(reqs), batch):
        out += eng.generate(reqs[k : k + batch])
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    st = eng.stats
    return {
        "tokens": [c.token_ids for c in out],
        "tps": st.generated_tokens / dt,
        "steps": st.steps,
        "acceptance": st.acceptance,
        "per_verify": (st.accepted_tokens + st.verifies) / st.verifies if st.verifies else None,
        "gc": (sum(g["collections"] for g in gc.get_stats()) - gc0) / st.steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=96, help="max tokens a prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", default="2,4", help="num_speculative_tokens values to measure")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, meta = Llama.smollm2(device=args.device, dtype=getattr(torch, args.dtype))
    tok = Tokenizer(meta)
    ks = [int(k) for k in args.k.split(",")]
    print(
        f"SmolLM2-135M-Instruct, {args.device} {args.dtype}, {args.threads} thread(s), greedy, up to {args.new} tokens "
        f"a prompt, medians of {args.repeats} alternating runs; drafts: ngram, prompt_lookup 2..4"
    )
    print(
        "\n| workload | batch | k | tok/s off | tok/s on | speed-up | steps off | steps on | steps on/off | accepted "
        "| tokens a verify | GC a step off / on | same tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for name, prompts in (("repetitive", REPETITIVE), ("questions", QUESTIONS)):
        for batch in (1, 8):
            for k in ks:
                spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
                offs, ons = [], []
                for _ in range(args.repeats):
                    offs.append(run(model, tok, prompts, batch, None, args.new))
                    ons.append(run(model, tok, prompts, batch, spec, args.new))
                off_tps = statistics.median(r["tps"] for r in offs)
                on_tps = statistics.median(r["tps"] for r in ons)
                same = all(r["tokens"] == offs[0]["tokens"] for r in offs + ons)
                a, b = offs[0], ons[0]
                print(
                    f"| {name} | {batch} | {k} | {off_tps:.1f} | {on_tps:.1f} | {on_tps / off_tps:.2f}x | {a['steps']} | "
                    f"{b['steps']} | {b['steps'] / a['steps']:.2f} | {b['acceptance'] or 0:.0%} | "
                    f"{b['per_verify'] or 0:.2f} | {a['gc']:.2f} / {b['gc']:.2f} | {same} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
