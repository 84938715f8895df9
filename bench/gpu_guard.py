"""Every GPU figure of issue 63 in one device call, one table: each tree (``--trees name=PATH``: this one, the last
release tag's or any older one checked out beside it) in a process of its own with PYTHONPATH at that tree, the
trees alternated over ``--repeats``, the measuring code this checkout's for all of them (bench/gpu_serve.py's and
bench/gpu_real.py's), and vLLM 0.25.1 on the same checkpoints and prompt ids where ../shared/vllm_gpu staged it.

Rows (medians over the repeats; the last column: the first tree over the second):

- SmolLM2-135M (the real weights, bf16): batch ``--batch`` offline tokens/s and transformers' ``generate`` on the
  same prompts (``smollm2``); the overlapped decode step against its graph floor at 1 / 16 / 64 / 256 rows, with
  the host's ms a step (``overlap``); the arrival mix's TTFT and ITL p50 / p99 with the engine alone (``mix``);
- Llama-1B and -8B shapes (``llama-1b``, ``llama-8b``): offline tokens/s waiting and overlapped, against the
  products' floor and the floor with the decode's KV reads; vLLM's offline tokens/s beside them where staged
  (then both engines serve vLLM's side's checkpoint, ``/tmp/ckpt_<shape>``, and the same prompt ids);
- the arrival mix at Llama-8B's shapes (``arrivals``: bench/gpu_arrivals.py's, ``--arrivals`` requests at
  ``--arrivals-rate`` a second, overlapped): TTFT and ITL p50 / p99, vLLM's ``LLMEngine`` on the same checkpoint,
  prompt ids, output lengths and arrival times beside them where staged.

The parts run in the order named, each one for every tree before the next part starts (a child process a tree and
part, the trees' order turned each part and repeat), so a part that ran compares its trees. ``--time-limit``
(seconds, default 540: a device call runs 600 at most) stops starting children once spent; a part not run says so.
What one call cannot hold, the next one can: ``--json-out FILE`` writes every result so far (its ``$OUT``, then
carried back), ``--json-in FILE`` takes earlier ones in (the same card, warm, for ratios), and ``--table FILE...``
prints the table from such files here, with no device. On the device machine, with vLLM staged (../shared/vllm_gpu/README.md) and pagedkv's wheels
installed (bench/device_install.sh):

    python bench/gpu_guard.py --trees main=.,ref=.devold/<tag> --vllm-tools .vw2/tools --prompts-dir .vw2/tools
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(HERE)  # (appended: a child's PYTHONPATH tree stays the pagedkv imported)
from children import child_result, result, tree_env  # noqa: E402

PARTS = (
    "llama-8b",
    "arrivals",
    "overlap",
    "mix",
    "smollm2",
    "llama-1b",
)  # (the default order: the headline figures first)
VLLM_SHAPES = {"llama-1b": "1b", "llama-8b": "8b"}  # (../shared/vllm_gpu's names for the shapes)
ARRIVALS_CKPT = "/tmp/ckpt_8b"  # (the arrival mix's checkpoint: vLLM's 8B one, where its run built it)


def arrivals_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench/gpu_arrivals.py's arguments for the ``arrivals`` part (both engines'): its own defaults, the guard's
    requests, rate and prompts, vLLM's 8B checkpoint where its run built it (else a random model of those shapes)."""
    import gpu_arrivals

    given = ["--shape", "llama-8b", "--requests", str(args.arrivals), "--rate", str(args.arrivals_rate)]
    if os.path.isdir(ARRIVALS_CKPT):
        given += ["--checkpoint", ARRIVALS_CKPT]
    if args.prompts_dir:
        given += ["--prompts-dir", os.path.abspath(args.prompts_dir)]
    return gpu_arrivals.parser().parse_args(given)


def child(args: argparse.Namespace) -> None:
    """This process's tree: the parts named, each one's figures, as one ``RESULT`` line."""
    import torch

    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "parts": {}}
    parts = args.parts.split(",")
    deadline = args.deadline
    smol = [p for p in parts if p in ("smollm2", "overlap", "mix")]
    if smol:
        import gpu_serve

        from pagedkv.models.llama import Llama
        from pagedkv.models.tokenizer import Tokenizer
        from pagedkv.shell.engine_args import freeze_startup

        _, meta = Llama.smollm2(device="cpu")
        tok = Tokenizer(meta)
        freeze_startup()  # as an engine process does (vLLM's too): the start-up heap is not walked again
        for part in smol:
            if time.time() > deadline:
                continue
            if part == "smollm2":
                hf = gpu_serve.hf_model(torch.bfloat16)
                gpu_serve.hf_generate(hf, [tok.encode("warm up")] * 4, 8, tok.eos_token_id)
                freeze_startup()  # (transformers' model too, as gpu_serve.py's own run has it)
                out["parts"][part] = gpu_serve.batches(tok, [args.batch], args.new, hf)[0]
                del hf
            elif part == "overlap":
                out["parts"][part] = gpu_serve.overlap(tok, [1, 16, 64, 256], 64)
            else:
                got = gpu_serve.mix(tok, args.mix, args.rate, None)
                got.pop("lines")
                out["parts"][part] = got
            torch.cuda.empty_cache()
    if "arrivals" in parts and time.time() <= deadline:
        import gpu_arrivals

        out["parts"]["arrivals"] = gpu_arrivals.run_pagedkv(arrivals_args(args), overlap=True)
        torch.cuda.empty_cache()
    for part in parts:
        if part not in VLLM_SHAPES or time.time() > deadline:
            continue
        import gpu_real

        ckpt = f"/tmp/ckpt_{VLLM_SHAPES[part]}"
        real = argparse.Namespace(
            shape=part, checkpoint=ckpt if os.path.isdir(ckpt) else None, prompts_dir=args.prompts_dir,
            prompts=args.prompts, new=128, max_num_seqs=256, budget=8192, kv_gib=40.0, tflops=args.tflops,
            device="cuda", variants="default",
        )  # fmt: skip
        out["parts"][part] = gpu_real.measure(real)
    result(out)


def run_child(args: argparse.Namespace, name: str, path: str, part: str, deadline: float) -> dict[str, Any] | None:
    """One tree's ``part`` in a process of its own with PYTHONPATH at the tree: its RESULT (None, said, when it
    failed)."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        *sys.argv[1:],
        "--parts",
        part,
        "--deadline",
        str(deadline + 3600),
    ]  # fmt: skip  (a child started runs its part through)
    if args.prompts_dir:
        cmd += ["--prompts-dir", os.path.abspath(args.prompts_dir)]
    got: dict[str, Any] | None = child_result(cmd, tree_env(path), f"{name} {part}", cwd=os.path.abspath(path))
    return got


def run_vllm(tools: str, shape: str, prompts: int, limit: float) -> dict[str, Any] | str:
    """vLLM's offline run of ``shape`` (../shared/vllm_gpu's bench_vllm.py, vLLM in /tmp/site): its RESULT, or why
    not."""
    cmd = [sys.executable, os.path.join(tools, "bench_vllm.py"), "--shape", VLLM_SHAPES[shape],
           "--num-prompts", str(prompts), "--max-num-batched-tokens", "8192"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH="/tmp/site")
    got: dict[str, Any] | None = child_result(cmd, env, f"vLLM {shape}", timeout=max(1.0, limit))
    return "failed or timed out (its output above)" if got is None else got


def run_vllm_arrivals(args: argparse.Namespace, limit: float) -> dict[str, Any] | str:
    """vLLM's side of the ``arrivals`` part (bench/gpu_arrivals.py's vLLM child, vLLM in /tmp/site): its figures, or
    why not."""
    a = arrivals_args(args)
    if a.checkpoint is None:
        return f"no checkpoint at {ARRIVALS_CKPT} (vLLM's llama-8b part, or bench_vllm.py --build-only, builds it)"
    cmd = [sys.executable, os.path.join(HERE, "gpu_arrivals.py"), "--checkpoint", a.checkpoint, "--requests",
           str(a.requests), "--rate", str(a.rate), "--prompts-dir", a.prompts_dir, "--child", "vllm"]  # fmt: skip
    got: dict[str, Any] | None = child_result(cmd, tree_env("/tmp/site", only=True), "vLLM arrivals", timeout=limit)
    return "failed or timed out (its output above)" if got is None else got


def table(results: dict[str, list[dict[str, Any]]], vllm: dict[str, Any], parts: list[str]) -> list[str]:
    """One row a figure: each tree's median, the first tree over the second, vLLM's where it ran."""
    names = list(results)
    rows: list[tuple[str, str, list[float | None], float | None]] = []  # (figure, goal, per tree, vLLM's)

    def med(name: str, get: Any) -> float | None:
        xs = []
        for r in results[name]:  # (each result holds the parts one child ran: those without this figure pass)
            try:
                xs.append(float(get(r["parts"])))
            except (KeyError, IndexError, TypeError, ZeroDivisionError):
                pass
        return statistics.median(xs) if xs else None

    def add(figure: str, goal: str, get: Any, theirs: float | None = None) -> None:
        rows.append((figure, goal, [med(n, get) for n in names], theirs))

    if "smollm2" in parts:
        add("SmolLM2 offline tok/s, batch 256", "", lambda p: p["smollm2"]["tok_s"])
        add("  / transformers' generate", "", lambda p: p["smollm2"]["tok_s"] / p["smollm2"]["hf_tok_s"])
    if "overlap" in parts:
        for i, b in enumerate((1, 16, 64, 256)):
            goal = "at most 1.05x" if b == 256 else ""
            add(f"SmolLM2 overlapped step / floor, batch {b}", goal,
                lambda p, i=i: p["overlap"][i]["overlap_ms"] / p["overlap"][i]["floor_ms"])  # fmt: skip
        add("  host ms a step at 256 (overlapped)", "", lambda p: p["overlap"][3]["host_ms"])
    if "mix" in parts:
        add("arrival mix TTFT p50 ms", "", lambda p: p["mix"]["ttft_p50_ms"])
        add("arrival mix TTFT p99 ms", "", lambda p: p["mix"]["ttft_p99_ms"])
        add("arrival mix ITL p50 ms", "", lambda p: p["mix"]["itl_p50_ms"])
        add("arrival mix ITL p99 ms", "", lambda p: p["mix"]["itl_p99_ms"])
        add("  ITL p99 / p50", "at most 2x", lambda p: p["mix"]["itl_p99_ms"] / p["mix"]["itl_p50_ms"])
    if "arrivals" in parts or "arrivals" in vllm:
        va = vllm.get("arrivals")
        mix8 = "llama-8b arrival mix"
        for key, figure, goal in (
            ("ttft_p50_ms", f"{mix8} TTFT p50 ms", "at most vLLM's"),
            ("ttft_p99_ms", f"{mix8} TTFT p99 ms", ""),
            ("itl_p50_ms", f"{mix8} ITL p50 ms", ""),
            ("itl_p99_ms", f"{mix8} ITL p99 ms", "at most vLLM's"),
            ("tok_s", f"  {mix8} tok/s", ""),
            ("first_call_p50_ms", f"  {mix8} prompt steps' calls p50 ms", ""),  # (the calls handing out first tokens)
            ("first_call_p99_ms", f"  {mix8} prompt steps' calls p99 ms", ""),
            ("other_call_p50_ms", f"  {mix8} other steps' calls p50 ms", ""),
        ):
            add(figure, goal, lambda p, k=key: p["arrivals"][k], va.get(key) if isinstance(va, dict) else None)
    for shape in ("llama-1b", "llama-8b"):
        if shape not in parts and shape not in vllm:
            continue
        v = vllm.get(shape)
        vt = v["gen_tok_per_s"] if isinstance(v, dict) else None

        def tok_s(p: dict[str, Any], kind: str, shape: str = shape) -> float:
            got = p[shape]
            return float(got["new_tokens"] / got["runs"][f"default/{kind}"]["s"])

        def kv_floor(p: dict[str, Any], shape: str = shape) -> float:
            got = p[shape]
            return float(got["floor_s"] + got["kv_bytes"] / (got["copy_gbs"] * 1e9))

        add(f"{shape} offline tok/s, waiting", "", lambda p, s=shape: tok_s(p, "plain", s))
        add(f"{shape} offline tok/s, overlapped", "at least vLLM's", lambda p, s=shape: tok_s(p, "overlap", s), vt)
        add(f"  {shape} overlapped / products' floor", "at most 1.3x" if shape == "llama-8b" else "",
            lambda p, s=shape: p[s]["runs"]["default/overlap"]["s"] / p[s]["floor_s"])  # fmt: skip
        add(f"  {shape} overlapped / floor with KV reads", "",
            lambda p, s=shape: p[s]["runs"]["default/overlap"]["s"] / kv_floor(p, s))  # fmt: skip
    head = " | ".join(names)
    ratio = f"{names[0]} / {names[1]}" if len(names) > 1 else "-"
    out = [f"| figure | goal | {head} | {ratio} | vLLM 0.25.1 |", "|---|---|" + "---:|" * (len(names) + 2)]

    def shown(x: float) -> str:
        return f"{x:,.2f}" if x < 100 else f"{x:,.0f}"

    for figure, goal, vals, theirs in rows:
        cells = " | ".join("-" if x is None else shown(x) for x in vals)
        r = f"{vals[0] / vals[1]:.2f}x" if len(vals) > 1 and vals[0] and vals[1] else "-"
        vcell = "-" if theirs is None else f"{shown(theirs)} ({vals[0] / theirs:.2f}x)" if vals[0] else shown(theirs)
        out.append(f"| {figure} | {goal} | {cells} | {r} | {vcell} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="main=.", help="name=PATH,... (each tree run with PYTHONPATH=PATH)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch", type=int, default=256, help="SmolLM2's offline batch (beside transformers)")
    ap.add_argument("--new", type=int, default=64, help="SmolLM2's new tokens a request")
    ap.add_argument("--mix", type=int, default=400, help="requests in the arrival mix")
    ap.add_argument("--rate", type=float, default=40.0, help="the arrival mix's requests a second")
    ap.add_argument("--prompts", type=int, default=1000, help="prompts of the Llama shapes' runs (vLLM's too)")
    ap.add_argument("--arrivals", type=int, default=400, help="requests of the arrival mix at Llama-8B's shapes")
    ap.add_argument("--arrivals-rate", type=float, default=20.0, help="its requests a second (Poisson)")
    ap.add_argument("--tflops", type=float, default=790.0)
    ap.add_argument("--vllm-tools", help="../shared/vllm_gpu's scripts on the device (.vwN/tools): run vLLM there")
    ap.add_argument("--prompts-dir", default=os.environ.get("PROMPTS_DIR"), help="where prompts.py is")
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds; no part starts past it")
    ap.add_argument("--json-out", help="write every result so far here (after each child)")
    ap.add_argument("--json-in", nargs="+", help="earlier --json-out files: their results join this run's")
    ap.add_argument("--table", nargs="+", metavar="FILE", help="print the table of --json-out files (no device)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    parts = [p for p in args.parts.split(",") if p]
    if args.table:
        runs = [json.load(open(f)) for f in args.table]
        merged: dict[str, list[dict[str, Any]]] = {}
        for run in runs:
            for name, xs in run["trees"].items():
                merged.setdefault(name, []).extend(xs)
        theirs = {k: v for run in runs for k, v in run.get("vllm", {}).items()}
        have = {p for xs in merged.values() for x in xs for p in x["parts"]}
        print("\n".join(table(merged, theirs, [p for p in PARTS if p in have])))
        return
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part {bad[0]!r}: choose from {', '.join(PARTS)}")
    if any(p in VLLM_SHAPES or p == "arrivals" for p in parts) and not args.prompts_dir:
        ap.error("the Llama parts need --prompts-dir (../shared/vllm_gpu's prompts.py: the ids vLLM's side serves)")
    t0 = time.time()
    deadline = t0 + args.time_limit
    vllm: dict[str, Any] = {}
    if args.vllm_tools:  # (first: its checkpoints are the ones both engines then serve)
        for shape in (p for p in parts if p in VLLM_SHAPES):
            vllm[shape] = run_vllm(args.vllm_tools, shape, args.prompts, deadline - time.time())
            print(f"vLLM {shape}: {vllm[shape] if isinstance(vllm[shape], str) else 'done'}", file=sys.stderr)
        if "arrivals" in parts:  # (after its 8B run: the checkpoint both engines serve)
            vllm["arrivals"] = run_vllm_arrivals(args, max(1.0, deadline - time.time()))
            print(
                f"vLLM arrivals: {vllm['arrivals'] if isinstance(vllm['arrivals'], str) else 'done'}", file=sys.stderr
            )
    trees = [t.split("=", 1) for t in args.trees.split(",")]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for path in args.json_in or ():
        earlier = json.load(open(path))
        vllm = {**earlier.get("vllm", {}), **vllm}
        for name, xs in earlier["trees"].items():
            results.setdefault(name, []).extend(xs)
    turn = 0
    for r in range(args.repeats):
        for part in parts:
            for name, path in trees[turn % len(trees) :] + trees[: turn % len(trees)]:
                if time.time() > deadline:
                    print(f"{name} {part}, repeat {r + 1}: not run (--time-limit spent)", file=sys.stderr)
                    continue
                got = run_child(args, name, path, part, deadline)
                if got is not None:
                    results[name].append(got)
                if args.json_out:  # (after each child: a call cut short keeps what ran)
                    with open(args.json_out, "w") as f:
                        json.dump({"trees": results, "vllm": vllm}, f)
            turn += 1
    first = next((x for xs in results.values() for x in xs), None)
    if first is None:
        sys.exit("no tree gave a result (each one's output is above)")
    ran = {p for xs in results.values() for x in xs for p in x["parts"]}
    missing = [p for p in parts if p not in ran]
    print(f"\n{first['gpu']}; trees {args.trees}; {args.repeats} repeat(s), alternated; {time.time() - t0:.0f} s"
          + (f"; not run (time): {', '.join(missing)}" if missing else "") + "\n")  # fmt: skip
    print("\n".join(table(results, vllm, [p for p in parts if p in ran])))


if __name__ == "__main__":
    main()
