"""Structured outputs' cost and validity on SmolLM2 (issue 65), one table: the decode step of a full batch with
every request constrained (five JSON schemas, compiled before: the steady state) and without, alternated (the
median step that decodes the whole batch and prefills nothing: a constrained request ends when its JSON does, so
whole runs would compare other batches), as tokens/s; a request's time to its first token with a schema seen
before, with a new one (its compile reported apart) and without; and how many of ``--requests`` answers (five
schemas, greedy and sampled) parse and validate against their schema (jsonschema), with why the others did not.

    .venv/bin/python bench/structured.py --server             # CPU, batch 16; the answers through the server too
    .venv/bin/python bench/structured.py --device cuda --batch 256 --requests 1000
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.app.test_structured import ASKS, SCHEMAS  # noqa: E402  (the tests' five schemas and questions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16, help="requests a run (max_num_seqs)")
    ap.add_argument("--max-tokens", type=int, default=48, help="a timed run's tokens a request")
    ap.add_argument("--answer-tokens", type=int, default=200, help="an answer's most tokens (the validity run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200, help="answers checked against their schema")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server", action="store_true", help="also send --requests through pagedkv serve (openai client)")
    args = ap.parse_args()

    import jsonschema
    import torch

    from pagedkv.models.llama import Llama
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.sampling_params import SamplingParams, StructuredOutputsParams
    from pagedkv.shell.engine import Engine

    torch.set_num_threads(args.threads)
    model, meta = Llama.smollm2(device=args.device)
    tok = Tokenizer(meta)
    engine = Engine(model, tok, max_num_seqs=args.batch, time_steps=True)
    prompts = [tok.apply_chat_template([{"role": "user", "content": a}], True) for a in ASKS]

    def params(i: int, constrained: bool, temperature: float = 0.0, seed: int | None = None, most: int = 0) -> Any:
        so = StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]) if constrained else None
        return SamplingParams(temperature=temperature, seed=seed, max_tokens=most or args.max_tokens,
                              structured_outputs=so, ignore_eos=not constrained)  # fmt: skip

    def batch(constrained: bool) -> float:
        """The median step that decoded the whole batch (and prefilled nothing), in seconds."""
        work = [(prompts[i % 5], tok.encode(prompts[i % 5]), params(i, constrained)) for i in range(args.batch)]
        assert engine.step_times is not None
        engine.step_times.clear()
        engine.generate(work)
        full = [s for decodes, prefill, s in engine.step_times if decodes == args.batch and not prefill]
        return med(full)

    def first_token(p: Any) -> float:
        t0, seen = time.perf_counter(), []
        engine.generate(
            [(prompts[0], tok.encode(prompts[0]), p)], on_token=lambda rid, t: seen.append(time.perf_counter())
        )
        return seen[0] - t0

    med = statistics.median
    batch(True), batch(False)  # (warm: every schema compiled, the kernels loaded)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for constrained in (True, False):
            rates[constrained].append(args.batch / batch(constrained))
    one = dict(temperature=0.0, max_tokens=1)
    ttft = {"seen": [], "plain": []}
    for _ in range(args.repeats):
        ttft["seen"].append(
            first_token(SamplingParams(**one, structured_outputs=StructuredOutputsParams(json=SCHEMAS[0])))
        )
        ttft["plain"].append(first_token(SamplingParams(**one)))
    fresh = {"type": "object", "properties": {"k": {"type": "integer"}, "v": {"type": "string"}}, "required": ["k"]}
    t0 = time.perf_counter()
    engine.grammars().compile(StructuredOutputsParams(json=fresh)).result()
    compile_ms = (time.perf_counter() - t0) * 1e3
    ttft_new = first_token(
        SamplingParams(**one, structured_outputs=StructuredOutputsParams(json={**fresh, "title": "n"}))
    )

    work = [
        (prompts[i % 5], tok.encode(prompts[i % 5]),
         params(i, True, *((0.0, None) if i % 2 == 0 else (0.8, i)), most=args.answer_tokens))
        for i in range(args.requests)
    ]  # fmt: skip
    valid, why = 0, collections.Counter[str]()
    for i, c in enumerate(engine.generate(work)):
        if c.finish_reason != "stop":
            why[f"ended with {c.finish_reason} (schema {i % 5})"] += 1
            continue
        try:
            jsonschema.validate(json.loads(c.text), SCHEMAS[i % 5])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            why[f"{type(e).__name__} (schema {i % 5})"] += 1

    print(f"SmolLM2 on {args.device} ({args.threads} threads), batch {args.batch}, up to {args.max_tokens} tokens, "
          f"median of {args.repeats}, alternated\n")  # fmt: skip
    print("| | tokens/s (a full batch's decode step) | vs plain | TTFT ms (one request) | vs plain |")
    print("|---|---:|---:|---:|---:|")
    plain_rate, plain_ttft = med(rates[False]), med(ttft["plain"])
    print(f"| every request constrained (schemas seen before) | {med(rates[True]):,.1f} | "
          f"{med(rates[True]) / plain_rate:.3f}x | {med(ttft['seen']) * 1e3:.1f} | {med(ttft['seen']) / plain_ttft:.3f}x |")  # fmt: skip
    print(f"| no constraint | {plain_rate:,.1f} | 1.000x | {plain_ttft * 1e3:.1f} | 1.000x |")
    print(f"| a new schema (compiled off the step: {compile_ms:.1f} ms) | | | {ttft_new * 1e3:.1f} | "
          f"{ttft_new / plain_ttft:.3f}x |")  # fmt: skip
    print(f"\n{valid} of {args.requests} answers (five schemas, greedy and sampled, up to {args.answer_tokens} tokens) "
          f"stop, parse and validate: {valid / args.requests:.1%}" + "".join(f"; {n} {w}" for w, n in why.items()))  # fmt: skip
    if args.server:
        through_server(args.requests, args.answer_tokens)


def through_server(requests: int, most: int) -> None:
    """``requests`` answers through ``pagedkv serve`` (SmolLM2 in its engine process) with OpenAI's client, 16 at a
    time, half greedy and half sampled, each with ``response_format`` json_schema: how many parse and validate."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    from pagedkv.models.llama import Llama
    from pagedkv.models.tokenizer import Tokenizer
    from tests.app.test_serve import NAME, Served

    model, meta = Llama.smollm2()
    served = Served(model, Tokenizer(meta))
    client = served.client(timeout=600)

    def one(i: int) -> str | None:
        schema = SCHEMAS[i % 5]
        got = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": ASKS[i % 5]}], max_tokens=most,
            temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )  # fmt: skip
        c = got.choices[0]
        if c.finish_reason != "stop":
            return f"ended with {c.finish_reason} (schema {i % 5})"
        try:
            jsonschema.validate(json.loads(c.message.content), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"{type(e).__name__} (schema {i % 5})"
        return None

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(16) as pool:
            why = collections.Counter(w for w in pool.map(one, range(requests)) if w is not None)
    finally:
        served.close()
    valid = requests - sum(why.values())
    print(f"through pagedkv serve (openai client, response_format json_schema, 16 at a time, "
          f"{time.perf_counter() - t0:.0f} s): {valid} of {requests} stop, parse and validate: {valid / requests:.1%}"
          + "".join(f"; {n} {w}" for w, n in why.items()))  # fmt: skip


if __name__ == "__main__":
    main()
