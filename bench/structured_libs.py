"""Grammar libraries for structured outputs on this machine (issue 65's choice): xgrammar and llguidance, each with
the model's own vocabulary (SmolLM2's, transformers' tokenizer over pagedkv's tokenizer.json: ``models.tokenizer.Tokenizer.as_hf``),
timed on what a serving step pays: handing the vocabulary over (once an engine), compiling a grammar (once a
grammar: cached by its text), making a matcher (once a request), and filling the batch's token bitmask (every step),
at the grammar's start and in the middle of a JSON string. One thread; a library not installed is skipped with why.

    pip install xgrammar==0.2.8 apache-tvm-ffi llguidance==1.9.1   # (or either)
    python bench/structured_libs.py --batch 256
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age"],
}
PREFIX = '{"name": "Ada Lovel'  # (the middle of a string: most ids allowed, the grammar's widest masks)


def tokenizer() -> Any:
    from pagedkv.models.gguf import load_tokenizer_meta
    from pagedkv.models.tokenizer import Tokenizer

    return Tokenizer(load_tokenizer_meta()).as_hf()


def run_xgrammar(tok: Any, batch: int) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(batch)]
    t3 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(batch, info.vocab_size)
    t4 = time.perf_counter()
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(mask, i)
    t5 = time.perf_counter()
    for m in matchers:
        for t in tok.encode(PREFIX, add_special_tokens=False):
            assert m.accept_token(t)
    t6 = time.perf_counter()
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(mask, i)
    t7 = time.perf_counter()
    return {"vocab": t1 - t0, "compile": t2 - t1, "matchers": t3 - t2, "start": t5 - t4, "mid": t7 - t6}


def run_llguidance(tok: Any, batch: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    first = llguidance.LLMatcher(lltok, grammar)  # (the grammar is built with its first matcher)
    t2 = time.perf_counter()
    matchers = [first] + [llguidance.LLMatcher(lltok, grammar) for _ in range(batch - 1)]
    t3 = time.perf_counter()
    mask = allocate_token_bitmask(batch, lltok.vocab_size)
    t4 = time.perf_counter()
    for i, m in enumerate(matchers):
        fill_next_token_bitmask(m, mask, i)
    t5 = time.perf_counter()
    for m in matchers:
        assert m.consume_tokens(tok.encode(PREFIX, add_special_tokens=False))
    t6 = time.perf_counter()
    for i, m in enumerate(matchers):
        fill_next_token_bitmask(m, mask, i)
    t7 = time.perf_counter()
    return {"vocab": t1 - t0, "compile": t2 - t1, "matchers": t3 - t2, "start": t5 - t4, "mid": t7 - t6}


LIBS = {"xgrammar": run_xgrammar, "llguidance": run_llguidance}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256, help="requests whose masks a step fills")
    args = ap.parse_args()
    tok = tokenizer()
    print(f"SmolLM2's vocabulary ({len(tok)} ids), a 3-field JSON schema, {args.batch} requests, one thread\n")
    print("| library | vocabulary handed over ms | grammar compiled ms | a matcher us | a mask at the start us | "
          "a mask mid-string us |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name, run in LIBS.items():
        if importlib.util.find_spec(name) is None:
            print(f"| {name} | not installed here (pip install {name}) | | | | |")
            continue
        r = run(tok, args.batch)
        b = args.batch
        print(f"| {name} | {1e3 * r['vocab']:.0f} | {1e3 * r['compile']:.1f} | {1e6 * r['matchers'] / b:.1f} | "
              f"{1e6 * r['start'] / b:.1f} | {1e6 * r['mid'] / b:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
