"""``pagedkv generate``: SmolLM2-135M-Instruct served through pagedkv on this machine."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

PROGRESS_WIDTH = 30


def add_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate with SmolLM2-135M-Instruct through the paged KV cache")
    g.add_argument("prompt", nargs="*", help="prompts (or use --prompts)")
    g.add_argument("--prompts", help='JSON Lines, one {"prompt": str, "max_tokens"?: n, "system"?: str} per line')
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template (else raw text)")
    g.add_argument("--json", action="store_true", help='one {"prompt", "text", "token_ids", "finish_reason"} per request')
    g.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights and pages (auto: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "flash_attn", "npu"),
                   help="attention backend (auto: triton on cuda, torch on cpu)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on cuda (graphs are the default)")
    g.add_argument("--kv-cache-memory", type=float, default=256, help="KV cache budget in MiB")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--trace", help="record the scheduler's inputs as a trace (contract v1)")
    g.add_argument("--ranks", type=int, default=1, help="tensor-parallel ranks (torch.distributed, gloo on the CPU)")
    g.add_argument("--page-map", help="draw which request holds which block over time to this PNG (needs matplotlib)")


def _items(args: argparse.Namespace) -> list[dict[str, Any]] | str:
    """The prompts of the command line and of ``--prompts``, or the one-line reason they cannot be read."""
    items: list[dict[str, Any]] = [{"prompt": p} for p in args.prompt]
    if args.prompts:
        try:
            with open(args.prompts, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        obj = json.loads(line)
                        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                            raise ValueError(f'line {n}: expected {{"prompt": str, ...}}')
                        items.append(obj)
        except (OSError, ValueError) as e:
            return f"{args.prompts}: {e}"
    if not items:
        return "give prompts as arguments or with --prompts FILE"
    return items


def _requests(args: argparse.Namespace, items: list[dict[str, Any]], tok: Any) -> list[Any]:
    from pagedkv.shell.engine import SamplingParams

    requests = []
    for i, it in enumerate(items):
        text = it["prompt"]
        if args.chat:
            messages = [{"role": "system", "content": it["system"]}] if it.get("system") else []
            text = tok.apply_chat_template(messages + [{"role": "user", "content": it["prompt"]}])
        elif it.get("system"):
            text = it["system"] + "\n" + text
        params = SamplingParams(max_tokens=int(it.get("max_tokens", args.max_tokens)), temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed + i)  # fmt: skip
        requests.append((text, tok.encode(text), params))
    return requests


def dtype_for(name: str, device: str) -> Any:
    """``--dtype``: ``auto`` is bfloat16 on cuda (the serving path) and float32 elsewhere.

    >>> dtype_for("auto", "cuda"), dtype_for("auto", "cpu"), dtype_for("float16", "cpu")
    (torch.bfloat16, torch.float32, torch.float16)
    """
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def run(args: argparse.Namespace) -> int:
    import torch

    items = _items(args)
    if isinstance(items, str):
        print(f"pagedkv generate: {items}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pagedkv generate: --device cuda, but no CUDA device is available", file=sys.stderr)
        return 2
    from pagedkv.models.gguf import ModelFileMissing
    from pagedkv.models.llama import Llama
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.core.config import InvalidConfig
    from pagedkv.shell.engine import Engine, EngineArgs, freeze_startup
    from pagedkv.shell.errors import BackendUnavailable, ShellError

    t0 = time.perf_counter()
    try:
        model, meta = Llama.smollm2(device=args.device, dtype=dtype_for(args.dtype, args.device))
    except ModelFileMissing as e:
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return 2
    tok = Tokenizer(meta)
    load_s = time.perf_counter() - t0
    try:
        args_ = EngineArgs(block_size=args.block_size, kv_cache_memory_bytes=int(args.kv_cache_memory * 2**20),
                           max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching,
                           backend=args.backend, cuda_graphs=not args.no_cuda_graphs)  # fmt: skip
        rank = args_.rank_for(model)  # the sizes and the backend checked before any file is written
        trace = open(args.trace, "w", encoding="utf-8") if args.trace else None  # noqa: SIM115
        engine = Engine(model, tok, args_, rank=rank, trace=trace, keep_history=bool(args.page_map))
    except (InvalidConfig, OSError, BackendUnavailable) as e:
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return 2
    freeze_startup()  # the process's GC policy, as vLLM's engine core has it
    requests = _requests(args, items, tok)
    if args.ranks > 1:
        return _run_ranks(args, items, requests, tok)
    t1 = time.perf_counter()
    try:
        completions = engine.generate(requests, on_finish=None if args.json else _progress(len(requests)))
    except ShellError as e:  # a request the scheduler refuses to take (max tokens below 1, say)
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return 2
    gen_s = time.perf_counter() - t1
    if trace is not None:
        trace.close()
    if args.page_map:
        from pagedkv.app.plot import page_map

        page_map(engine.kv_history or [engine.state.kv], args.page_map)
    if args.json:
        for it, c in zip(items, completions):
            print(json.dumps({"prompt": it["prompt"], "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))  # fmt: skip
        return 0
    _summary(args, items, completions, engine, gen_s, load_s)
    return 0


def _progress(total: int) -> Any:
    done = 0

    def progress(_: object) -> None:
        nonlocal done
        done += 1
        bar = "#" * (PROGRESS_WIDTH * done // total)
        print(f"\r[{bar:<{PROGRESS_WIDTH}}] {done}/{total}", end="" if done < total else "\n", file=sys.stderr,
              flush=True)  # fmt: skip

    return progress


def _summary(args: argparse.Namespace, items: list[dict[str, Any]], completions: list[Any], engine: Any,
             gen_s: float, load_s: float) -> None:  # fmt: skip
    for i, (it, c) in enumerate(zip(items, completions)):
        print(f"--- [{i}] {it['prompt']}")
        print(f"{c.text.strip()}  ({len(c.token_ids)} tokens, {c.finish_reason}, {c.cached_tokens} prompt tokens cached)")
    st = engine.stats
    kv = engine.state.kv
    print("--- summary")
    print(f"requests            {len(completions)}")
    print(f"prompt tokens       {st.prompt_tokens}")
    print(f"generated tokens    {st.generated_tokens}")
    print(f"tokens per second   {st.generated_tokens / gen_s:.1f} generated ({(st.generated_tokens + st.prompt_tokens) / gen_s:.1f} "
          f"with prompts) on {args.device}; model load {load_s:.1f} s")  # fmt: skip
    print(f"prefix hit rate     {kv.prefix_hit_rate:.1%} of prompt tokens")
    print(f"peak blocks in use  {st.peak_blocks} of {kv.config.usable_blocks} ({st.peak_blocks / kv.config.usable_blocks:.1%} "
          f"of the pool: {engine.sizing})")  # fmt: skip
    print(f"preemptions         {st.preemptions}")
    print(f"engine steps        {st.steps}")


def _run_ranks(args: argparse.Namespace, items: list[dict[str, Any]], requests: list[Any], tok: Any) -> int:
    from pagedkv.app.ranks import run_ranks

    t0 = time.perf_counter()
    results = run_ranks(args.ranks, requests, kv_cache_memory_bytes=int(args.kv_cache_memory * 2**20),
                        max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                        enable_prefix_caching=not args.no_prefix_caching)  # fmt: skip
    lead = results[0]
    errors = [f"rank {r['rank']}: {r['error']}" for r in results if r.get("error")]
    if errors:
        print("pagedkv generate: " + "; ".join(errors), file=sys.stderr)
        return 1
    for it, (ids, reason) in zip(items, lead["completions"]):
        text = tok.decode(ids)
        if args.json:
            print(json.dumps({"prompt": it["prompt"], "text": text, "token_ids": ids, "finish_reason": reason}))
        else:
            print(f"--- {it['prompt']}\n{text.strip()}  ({len(ids)} tokens, {reason})")
    if not args.json:
        generated = sum(len(ids) for ids, _ in lead["completions"])
        print(f"--- {args.ranks} ranks: {generated} tokens in {lead['seconds']:.1f} s, {lead['steps']} steps; metadata "
              f"broadcast {lead['broadcast_seconds'] / max(lead['steps'], 1) * 1e3:.2f} ms a step; wall "
              f"{time.perf_counter() - t0:.1f} s with start-up")  # fmt: skip
    return 0
