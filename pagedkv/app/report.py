"""``pagedkv generate``'s output: each completion (a line of JSON, or the prompt and its text), the summary,
the requests that were not served, a trace that could not be written, the page map, the progress bar."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from pagedkv.app.args import USAGE_EXIT

SHOWN_PROMPT_CHARS = 100
REFUSED = ("UNSCHEDULABLE", "INVALID")  # finish reasons of a request the core would never admit


def unserved(completions: list[Any]) -> int:
    """Each request that was not served, with why, on stderr: exit 2 when the core refused every one (a usage
    error: too long for the pool), 1 when any was not served, 0 when all were."""
    unserved = [c for c in completions if c.finish_reason in REFUSED or c.finish_reason == "error"]
    for c in unserved:
        print(f"pagedkv generate: {c.finish_reason}: {c.error}", file=sys.stderr)
    if not unserved:
        return 0
    if all(c.finish_reason in REFUSED for c in completions):
        print(f"pagedkv generate: no request could run ({len(unserved)} refused)", file=sys.stderr)
        return USAGE_EXIT
    print(f"pagedkv generate: {len(unserved)} of {len(completions)} requests were not served", file=sys.stderr)
    return 1


def trace_written(engine: Any, trace: TextIO | None, path: str | None) -> int:
    """1, said on stderr, when the trace could not be written whole (the run itself went on)."""
    error = engine.trace_error
    if trace is not None and error is None:
        try:
            trace.flush()
        except OSError as e:
            error = e
    if error is None:
        return 0
    print(
        f"pagedkv generate: the trace {path} was not written whole: {getattr(error, 'strerror', None) or error}",
        file=sys.stderr,
    )
    return 1


def draw_page_map(engine: Any, path: str) -> int:
    from pagedkv.app.plot import page_map

    try:
        page_map(
            engine.kv_history or [engine.state.kv],
            path,
            xlabel="engine step",
            title="pagedkv generate: blocks held per engine step",
        )
    except (OSError, RuntimeError, ValueError) as e:
        print(f"pagedkv generate: the page map was not written: {e}", file=sys.stderr)
        return 1
    print(f"page map written to {path}", file=sys.stderr)
    return 0


def progress_bar(total: int, disable: bool) -> Any:
    """A progress bar of finished requests on a terminal's stderr (tqdm; nothing when stderr is a file)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="req",
        desc="generate",
        file=sys.stderr,
        disable=True if disable else None,
        leave=False,
        dynamic_ncols=True,
    )


def shown(text: str, limit: int = SHOWN_PROMPT_CHARS) -> str:
    """A prompt on one line of the summary: its first ``limit`` characters and how long it was.

    >>> shown("What is 2+2?")
    'What is 2+2?'
    >>> shown("a b\\nc " * 40, limit=12)
    'a b c a b c ... (240 characters)'
    """
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else f"{flat[:limit]}... ({len(text):,} characters)"


def print_completion(args: argparse.Namespace, i: int, item: dict[str, Any], c: Any) -> None:
    print_one(args, i, item, c.text, c.token_ids, c.finish_reason, c.error, c.cached_tokens)


def print_one(
    args: argparse.Namespace,
    i: int,
    item: dict[str, Any],
    text: str,
    token_ids: list[int],
    reason: str | None,
    error: str | None,
    cached: int | None,
) -> None:
    """One request's output: a JSON line, or its prompt and completion (``cached``: None where unknown)."""
    if args.json:  # "error" only where a request was not served (the four keys are the contract)
        print(
            json.dumps(
                {
                    "prompt": item["prompt"],
                    "text": text,
                    "token_ids": token_ids,
                    "finish_reason": reason,
                    **({"error": error} if error else {}),
                }
            )
        )
        return
    print(f"--- [{i}] {shown(item['prompt'])}")
    if reason in REFUSED or reason == "error":
        print(f"(not served: {reason}: {error})")
    else:
        tail = "" if cached is None else f", {cached} prompt tokens cached"
        print(f"{text.strip()}  ({len(token_ids)} tokens, {reason}{tail})")


def summary(
    args: argparse.Namespace, completions: list[Any], engine: Any, gen_s: float, load_s: float, n_threads: int
) -> None:
    st = engine.stats
    kv = engine.state.kv
    served = [c for c in completions if c.finish_reason not in REFUSED]
    prompt_tokens = sum(len(c.prompt_token_ids) for c in served)  # the prompts that ran (a refused one never did)
    where = f"on {args.device}" + (f", {n_threads} threads" if args.device == "cpu" else "")
    print("--- summary")
    print(f"model               {getattr(args, 'model_name', 'SmolLM2-135M-Instruct')}")
    print(
        f"requests            {len(completions)}"
        + (f" ({len(completions) - len(served)} refused)" if len(served) < len(completions) else "")
    )
    print(f"prompt tokens       {prompt_tokens}")
    print(f"generated tokens    {st.generated_tokens}")
    if st.generated_tokens and gen_s > 0:
        print(
            f"tokens per second   {st.generated_tokens / gen_s:.1f} generated ({(st.generated_tokens + prompt_tokens) / gen_s:.1f} "
            f"with prompts) {where}; model load {load_s:.1f} s"
        )
    else:
        print(f"tokens per second   - (nothing was generated) {where}; model load {load_s:.1f} s")
    print(f"prefix hit rate     {kv.prefix_hit_rate:.1%} of prompt tokens")
    tier = engine.host_pages
    if tier is not None:  # (hits by tier: the host tier's, in blocks loaded back; its blocks stored)
        print(
            f"host tier           {kv.config.host_blocks} blocks; {tier.loaded} loaded back on hits "
            f"({tier.loaded * kv.config.block_size} tokens), {tier.stored} stored from the pool"
            + (f", {tier.shed} shed under back-pressure" if tier.shed else "")
        )
    print(
        f"peak blocks in use  {st.peak_blocks} of {kv.config.usable_blocks} ({st.peak_blocks / kv.config.usable_blocks:.1%} "
        f"of the pool: {engine.sizing})"
    )
    if engine.pool.fp8:  # fp8 pages: their dtype and the range of the layers' scales
        scales = [p.kv_scales for p in engine.layout.by_name.values()]
        print(
            f"kv cache dtype      {engine.pool.dtype} pages; K scales {min(k for k, _ in scales):.3g}-"
            f"{max(k for k, _ in scales):.3g}, V scales {min(v for _, v in scales):.3g}-{max(v for _, v in scales):.3g}"
        )
    print(f"preemptions         {st.preemptions}")
    print(f"engine steps        {st.steps}")
    if st.verifies:  # speculative decoding: how many drafts the model kept, and what a verify gave a request
        print(
            f"speculation         {st.acceptance:.1%} of {st.draft_tokens} drafts accepted; "
            f"{(st.accepted_tokens + st.verifies) / st.verifies:.2f} tokens a verify; "
            f"{st.generated_tokens / st.steps:.2f} tokens a step"
        )
