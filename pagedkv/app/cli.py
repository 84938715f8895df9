"""The ``pagedkv`` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence

from pagedkv.app.args import USAGE_EXIT, Parser, UsageError, bounded_int, file_name, read_lines, writable_target
from pagedkv.core.config import InvalidConfig
from pagedkv.core.store.state import KVState
from pagedkv.core.verify.alphabet import CheckConfig
from pagedkv.core.verify.check import CheckResult, check
from pagedkv.core.verify.trace import TraceHeaderError, kv_of, replay


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, generate = _parsers()
    try:
        if argv[:1] == ["generate"]:  # prompts may come anywhere among its options
            args = generate.parse_intermixed_args(argv[1:])
            args.command = "generate"
        else:
            args = parser.parse_args(argv)
    except SystemExit as e:  # a usage error (one line, said) or --help: the status, returned as every path does
        return e.code if isinstance(e.code, int) else USAGE_EXIT
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # (what is buffered fails here, inside the handler, not at exit)
        return code
    except KeyboardInterrupt:
        print(f"pagedkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the output cannot be written: a closed pipe (| head -1), a full disk (> /dev/full)
        _quiet_stdout()
        what = "standard output was closed" if isinstance(e, BrokenPipeError) else f"cannot write: {e.strerror or e}"
        with contextlib.suppress(OSError):
            print(f"pagedkv {args.command}: {what}", file=sys.stderr)
        return 1


def _quiet_stdout() -> None:
    """Standard output pointed at /dev/null: Python's flush at exit then has nowhere to fail."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    from pagedkv.app.denoise import add_parser as add_denoise
    from pagedkv.app.generate import add_parser as add_generate
    from pagedkv.app.serve import add_parser as add_serve

    parser = Parser(prog="pagedkv", description="A scheduler-managed paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,serve,replay,check,denoise}")
    p = sub.add_parser(
        "replay",
        help="re-run a trace (contract version 1) through the core",
        description="Re-run a trace through the core; report each event's result and the first "
        "divergence from its expect fields (exit 1).",
    )
    p.add_argument("file", help="a JSON Lines trace; - reads standard input")
    p.add_argument("--json", action="store_true", help="print one JSON result object per event")
    p.add_argument(
        "--check", action="store_true", help="check every invariant after every event (exit 1 if one breaks)"
    )
    p.add_argument(
        "--page-map",
        type=file_name,
        metavar="FILE.png",
        help="draw who holds which block, event by event (.png, .svg or .pdf; needs matplotlib)",
    )
    c = sub.add_parser(
        "check",
        help="model-check every reachable state of a small configuration",
        description="Explore every state a small configuration reaches, breadth first, checking "
        "the invariants in each; a violation's shortest trace is written to --out. The "
        "default explores 15,353 states in about 20 s on one idle core of CI's machine (each state more costs "
        "about 1 ms: --blocks 6 --requests 3 explores 109,476 in about 2 minutes); a "
        "progress bar shows on a terminal's stderr, and the summary at the end.",
    )
    d = CheckConfig()
    # bounds a search can finish in: the state space grows exponentially in each
    c.add_argument("--block-size", type=bounded_int(1, 16), default=d.block_size, help="tokens per block")
    c.add_argument(
        "--blocks", type=bounded_int(1, 64), default=d.usable_blocks, help="usable blocks (the null block comes on top)"
    )
    c.add_argument("--requests", type=bounded_int(1, 26), default=d.requests, help="request ids in the alphabet (A..Z)")
    c.add_argument("--rows", type=bounded_int(1, 8), default=d.max_rows, help="max rows per request")
    c.add_argument(
        "--window", type=bounded_int(0, 64), default=d.window, help="sliding-window group size; 0: one full group only"
    )
    c.add_argument("--no-prefix-caching", action="store_true", help="explore without the prefix cache")
    c.add_argument("--max-model-len", type=bounded_int(1, 256), default=d.max_model_len, help="tokens a row may hold")
    c.add_argument(
        "--destinations",
        action="store_true",
        help="also admit rows whose KV arrives from elsewhere (pending_tokens) and mark it ready",
    )
    c.add_argument("--mamba", action="store_true", help="add a state (Mamba) group after the attention groups")
    c.add_argument(
        "--mamba-align",
        action="store_true",
        help="add an align-mode state group (vLLM's mamba_cache_mode='align') after the attention groups",
    )
    c.add_argument(
        "--ahead",
        action="store_true",
        help="also grow rows by placeholders, fill their ids and cut rows back (async scheduling, drafts)",
    )
    c.add_argument(
        "--hash-lookahead",
        type=bounded_int(0, 16),
        default=d.hash_lookahead,
        help="ids after each block its hash also covers (vLLM's EAGLE lookahead hashes)",
    )
    c.add_argument(
        "--host-blocks",
        type=bounded_int(0, 16),
        default=d.host_blocks,
        help="keep the blocks the pool evicts in a host tier of this many blocks, and load hits there back "
        "(CacheConfig.host_blocks; 0: none)",
    )
    c.add_argument(
        "--host-store-threshold",
        type=bounded_int(0, 16),
        default=d.host_store_threshold,
        help="the host tier keeps an evicted block only once its content was seen in this many uses "
        "(CacheConfig.host_store_threshold; below 2: every one)",
    )
    c.add_argument(
        "--host-tracker-size",
        type=bounded_int(1, 1 << 16),
        default=d.host_tracker_size,
        help="contents the host tier's use table counts (CacheConfig.host_tracker_size)",
    )
    c.add_argument(
        "--long-prompts",
        action="store_true",
        help="also admit a prompt long enough that its prefix hit leaves window positions null",
    )
    c.add_argument(
        "--free-queue",
        choices=("tail", "vllm"),
        default="tail",
        help="where freed blocks go: all to the tail, or (vllm) those without a hash to the head",
    )
    c.add_argument(
        "--caching-point",
        choices=("commit", "schedule"),
        default="commit",
        help="when full blocks enter the prefix cache: once computed, or (vLLM) once planned; "
        "schedule adds cache_ahead and a failed-step release to the alphabet",
    )
    c.add_argument(
        "--cache-duplicates",
        action="store_true",
        help="cache every block that fills with a content already cached (vLLM's block pool)",
    )
    c.add_argument(
        "--reset-when-idle",
        action="store_true",
        help="reset_prefix_cache is refused while blocks are held (vLLM's semantics)",
    )
    c.add_argument("--max-states", type=bounded_int(1, 10**8), default=d.max_states, help="stop after this many states")
    c.add_argument(
        "--max-depth", type=bounded_int(1, 10**6), default=None, help="stop at this depth (default: no bound)"
    )
    c.add_argument(
        "--out",
        type=file_name,
        default="counterexample.jsonl",
        help="where a violation's trace is written (its folder must exist)",
    )
    c.add_argument(
        "--json", action="store_true", help='end with {"states", "depth", "violations", "seconds", "exhaustive"}'
    )
    generate = add_generate(sub)
    add_serve(sub)
    add_denoise(sub)
    return parser, generate


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "denoise":
        from pagedkv.app.denoise import run as run_denoise

        return run_denoise(args)
    if args.command == "generate":
        from pagedkv.app.generate import run

        return run(args)
    if args.command == "serve":
        from pagedkv.app.serve import run as run_serve

        return run_serve(args)
    if args.command == "replay":
        return _replay(args.file, args.json, args.check, args.page_map)
    return _check(args)


def _check(args: argparse.Namespace) -> int:
    try:
        cfg = CheckConfig(
            block_size=args.block_size,
            usable_blocks=args.blocks,
            requests=args.requests,
            max_rows=args.rows,
            window=args.window or None,
            prefix_caching=not args.no_prefix_caching,
            max_model_len=args.max_model_len,
            max_states=args.max_states,
            max_depth=args.max_depth,
            destinations=args.destinations,
            mamba=args.mamba,
            mamba_align=args.mamba_align,
            free_queue=args.free_queue,
            reset_when_idle=args.reset_when_idle,
            cache_at_schedule=args.caching_point == "schedule",
            duplicates=args.cache_duplicates,
            long_prompts=args.long_prompts,
            ahead=args.ahead,
            hash_lookahead=args.hash_lookahead,
            host_blocks=args.host_blocks,
            host_store_threshold=args.host_store_threshold,
            host_tracker_size=args.host_tracker_size,
        )
        cfg.cache_config()
        writable_target(args.out)  # before the search: a counterexample found must have somewhere to go
    except (InvalidConfig, UsageError) as e:
        print(f"pagedkv check: {e}", file=sys.stderr)
        return USAGE_EXIT
    from tqdm import tqdm

    t0 = time.perf_counter()
    with tqdm(
        total=cfg.max_states,
        unit="states",
        desc="check",
        file=sys.stderr,
        leave=False,
        disable=None,
        dynamic_ncols=True,
    ) as bar:  # on a terminal only; its rate is states/s

        def progress(r: CheckResult) -> None:
            bar.update(r.states - bar.n)
            bar.set_postfix(depth=r.depth, transitions=r.transitions, refresh=False)

        result = check(cfg, progress=progress)
    seconds = time.perf_counter() - t0
    bound = "exhaustive" if result.exhaustive else "stopped at a bound"
    print(f"states explored: {result.states}")
    print(f"depth reached:   {result.depth}")
    print(f"transitions:     {result.transitions}")
    print(f"states/second:   {result.states / seconds:.0f}")
    print(f"seconds:         {seconds:.1f} ({bound})")
    if result.violation:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(result.trace) + "\n")
        print(f"VIOLATION after {len(result.trace) - 2} events:", file=sys.stderr)  # (the header, the end record)
        for v in result.violation:
            print(f"  {v}", file=sys.stderr)
        print(f"counterexample written to {args.out} (pagedkv replay --check {args.out})", file=sys.stderr)
    else:
        print("violations:      0")
    if args.json:
        print(
            json.dumps(
                {
                    "states": result.states,
                    "depth": result.depth,
                    "violations": int(bool(result.violation)),
                    "seconds": round(seconds, 3),
                    "exhaustive": result.exhaustive,
                }
            )
        )
    return 1 if result.violation else 0


def _replay(path: str, as_json: bool, check_invariants: bool = False, page_map_path: str | None = None) -> int:
    try:
        lines = _trace_lines(path, page_map_path)
    except UsageError as e:
        print(f"pagedkv replay: {e}", file=sys.stderr)
        return USAGE_EXIT
    first: str | None = None
    events = divergences = failures = 0
    out = sys.stdout
    for stream in (out, sys.stderr):  # an id holding a lone surrogate prints escaped, never raises
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    table = f"{'i':>4} {'line':>5}  {'op':<18} {'result':<20} {'gen':>5} {'free':>6}  {'digest':<12}  detail\n"
    try:
        states: list[KVState] = []
        for ev in replay(lines, check=check_invariants):
            if not as_json and not events:  # (the table's head once the trace is known readable)
                out.write(table)
            events += 1
            if page_map_path:
                states.append(kv_of(ev.state))
            r = ev.result
            failures += not r["ok"]
            problem = ev.divergence
            if ev.violations:
                problem = "invariant broken: " + "; ".join(ev.violations)
            if problem is not None:
                divergences += 1
                if first is None:
                    first = f"line {ev.line} (event {r['i']}, {r['op']}): {problem}"
            if as_json:
                out.write(json.dumps(r) + "\n")
            else:
                out.write(_row(ev.line, r) + "\n")
    except (TraceHeaderError, UsageError) as e:  # (a line past the bound, read as the replay goes)
        out.flush()
        print(f"pagedkv replay: {e}", file=sys.stderr)
        return USAGE_EXIT
    if not as_json:
        out.write(
            ("" if events else table) + f"{events} events, {failures} refused, {divergences} diverged from expect\n"
        )
    if page_map_path and states:
        from pagedkv.app.plot import page_map

        try:
            page_map(states, page_map_path, title=f"pagedkv replay {path}", xlabel="trace event (i)")
        except (OSError, RuntimeError, ValueError) as e:  # after the table: the replay's output is kept
            print(f"pagedkv replay: the page map was not written: {e}", file=sys.stderr)
            return 1
    if first is not None:
        print(f"pagedkv replay: first divergence at {first}", file=sys.stderr)
        if divergences > 1:
            print(f"pagedkv replay: {divergences} events diverged in all", file=sys.stderr)
        return 1
    return 0


def _trace_lines(path: str, page_map_path: str | None) -> Iterator[str]:
    """The trace's lines (``-``: standard input) as they are read, once the page map's target is checked;
    ``UsageError`` for what cannot be read (a line past the bound: as it is read)."""
    if page_map_path:
        from pagedkv.app.plot import check_target

        check_target(page_map_path)
    return read_lines(path, path, strict=False)


def _row(line: int, r: dict[str, object]) -> str:
    err = r["error"]
    result = "ok" if r["ok"] else err["code"] if isinstance(err, dict) else "?"
    detail = ""
    if r["ok"]:
        if r.get("cached_tokens") is not None:
            detail = f"cached {r['cached_tokens']} blocks {r['blocks']}"
        elif r.get("blocks") is not None:
            detail = f"blocks {r['blocks']}"
        elif isinstance(rows := r.get("rows"), list):
            detail = "; ".join(
                f"{x['request']}/{x['row']} q[{x['kv_start_pos']}:{x['kv_start_pos'] + x['query_len']}] "
                f"kv {x['seq_len']} slots {_short(x['slots'])}"
                for x in rows
            )
    elif isinstance(err, dict):
        detail = str(err["message"])
    return (
        f"{r['i']:>4} {line:>5}  {r['op']!s:<18} {result:<20} {r['generation']:>5} {r['free_blocks']:>6}  "
        f"{str(r['digest'])[:12]:<12}  {detail}"
    )


def _short(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 6 else f"[{xs[0]}..{xs[-1]}] ({len(xs)})"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
