"""The ``pagedkv`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pagedkv.core.trace import TraceHeaderError, replay


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv", description="A scheduler-managed paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("replay", help="re-run a trace (contract version 1) through the core")
    p.add_argument("file", help="a JSON Lines trace; - reads standard input")
    p.add_argument("--json", action="store_true", help="print one JSON result object per event")
    args = parser.parse_args(argv)
    if args.command == "replay":
        return _replay(args.file, args.json)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _replay(path: str, as_json: bool) -> int:
    try:
        if path == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
    except OSError as e:
        print(f"pagedkv replay: cannot read {path}: {e.strerror}", file=sys.stderr)
        return 2
    first: str | None = None
    events = divergences = failures = 0
    out = sys.stdout
    try:
        if not as_json:
            out.write(f"{'i':>4} {'line':>5}  {'op':<18} {'result':<20} {'gen':>5} {'free':>6}  {'digest':<12}  detail\n")
        for ev in replay(lines):
            events += 1
            r = ev.result
            failures += not r["ok"]
            if ev.divergence is not None:
                divergences += 1
                if first is None:
                    first = f"line {ev.line} (event {r['i']}, {r['op']}): {ev.divergence}"
            if as_json:
                out.write(json.dumps(r) + "\n")
            else:
                out.write(_row(ev.line, r) + "\n")
    except TraceHeaderError as e:
        print(f"pagedkv replay: {e}", file=sys.stderr)
        return 2
    if not as_json:
        out.write(f"{events} events, {failures} refused, {divergences} diverged from expect\n")
    if first is not None:
        print(f"pagedkv replay: first divergence at {first}", file=sys.stderr)
        if divergences > 1:
            print(f"pagedkv replay: {divergences} events diverged in all", file=sys.stderr)
        return 1
    return 0


def _row(line: int, r: dict[str, object]) -> str:
    err = r["error"]
    result = "ok" if r["ok"] else err["code"] if isinstance(err, dict) else "?"
    detail = ""
    if r["ok"]:
        if r.get("cached_tokens") is not None:
            detail = f"cached {r['cached_tokens']} blocks {r['blocks']}"
        elif r.get("blocks") is not None:
            detail = f"blocks {r['blocks']}"
        elif isinstance(r.get("rows"), list):
            detail = "; ".join(
                f"{x['request']}/{x['row']} q[{x['kv_start_pos']}:{x['kv_start_pos'] + x['query_len']}] "
                f"kv {x['seq_len']} slots {_short(x['slots'])}"
                for x in r["rows"]  # type: ignore[union-attr]
            )
    elif isinstance(err, dict):
        detail = str(err["message"])
    return (f"{r['i']:>4} {line:>5}  {str(r['op']):<18} {result:<20} {r['generation']:>5} {r['free_blocks']:>6}  "
            f"{str(r['digest'])[:12]:<12}  {detail}")  # fmt: skip


def _short(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 6 else f"[{xs[0]}..{xs[-1]}] ({len(xs)})"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
