"""Real-size models offline, beside another tree in the same call (issue 63): a Llama of the given shape (random init,
built on the GPU with transformers in bf16, its config read by pagedkv's checkpoint reader), the prompts vLLM's side
serves bit for bit (../shared/vllm_gpu/prompts.py: ``make_prompts(n, 0, vocab)``, median 150 tokens) x ``--new``
tokens each, greedy, no early stop, one ``generate`` call, without and with overlapped scheduling, against the matrix
products' floor (``--tflops``) and against that floor plus the decode attention's reads of the KV pages at the card's
copy bandwidth (measured in the run: a decode at 8B reads ~128 KB of K and V a key over 32 layers, a bound no
kernel passes, which the products' floor leaves out). Each tree (``--trees name=PATH``: this one, the last release tag's, a suspect commit's
checked out beside it) runs in a process of its own with PYTHONPATH at that tree, alternating over ``--repeats``; a
tree that knows them also runs the variants named by ``--variants``, each with one of the engine's recent choices
turned off (where the 8B regression of issue 63 hides):

- ``default``: the engine as it ships;
- ``eager-prefill``: prefill forwards never laid out one token a row through the decode kernel and its graphs (the
  varlen prefill kernel, launched eagerly, as before c2422c8);
- ``no-cap``: no 512-token cap on a prompt's chunk a step (``long_prefill_token_threshold`` 0, as before f91b4fe);
- ``no-ride``: decode rows never ride in a prompt's forward (as before d0d92cc);
- ``none``: all three off;
- ``unfused``: the forward's elementwise work in torch's kernels, not ``shell.fused``'s (issue 63's fusion off);
- ``flat-N``: prefill forwards of at most N tokens laid out one token a row and replayed (``ModelRunner.flat_tokens``
  given), a forward over a replay's tokens never cut (``ModelRunner.pieces`` off); ``flat-N-pieces``: cut into
  replays between requests (on).

    python bench/gpu_real.py --shape llama-8b --trees main=.,dca3de6=.devold/dca3de6 --variants default,none
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(HERE)  # (appended: a child's PYTHONPATH tree stays the pagedkv imported)
from children import child_result, result, tree_env  # noqa: E402
from llama_shapes import SHAPES, load  # noqa: E402


def variant(name: str) -> Any:
    """Turn off what ``name`` says (a context of monkeypatches on this tree's engine); what a tree lacks is None."""
    import contextlib

    import importlib.util

    import pagedkv.shell.engine as E
    from pagedkv.shell.engine_args import EngineArgs

    # (the forward's layout: the model runner's since shell/runner.py; an older tree's in the engine)
    R: Any = importlib.import_module("pagedkv.shell.runner") if importlib.util.find_spec("pagedkv.shell.runner") else E
    runs = getattr(R, "ModelRunner", E.Engine)

    @contextlib.contextmanager
    def patched() -> Any:
        saved: list[tuple[Any, str, Any]] = []

        def put(obj: Any, attr: str, value: Any) -> None:
            saved.append((obj, attr, getattr(obj, attr)))
            setattr(obj, attr, value)

        if name in ("eager-prefill", "none"):
            real = runs._token_rows
            put(runs, "_token_rows", lambda self, meta, verifying: real(self, meta, verifying) if verifying else False)
            put(runs, "_pieces", lambda self, meta, verify: [meta])
        if name in ("no-cap", "none"):
            put(EngineArgs, "prefill_chunk_cap", lambda self, model, backend: 0)
        if name in ("no-ride", "none"):
            put(R, "ride_along", lambda forwards, *_: [(f, None) for f in forwards])
        if name.startswith("flat-"):  # flat-N[-pieces]: the runner's layout rule given (ModelRunner.flat_tokens)
            most, init = int(name.split("-")[1]), runs.__init__

            def given(self: Any, *a: Any, **k: Any) -> None:
                init(self, *a, **k)
                self.flat_tokens, self.pieces = most, name.endswith("-pieces")

            put(runs, "__init__", given)
        try:
            yield
        finally:
            for obj, attr, value in reversed(saved):
                setattr(obj, attr, value)

    if name == "unfused":
        try:
            import pagedkv.shell.fused as fused
        except ImportError:
            return None

        @contextlib.contextmanager
        def off() -> Any:
            fused.ENABLED = False
            try:
                yield
            finally:
                fused.ENABLED = True

        return off()
    needs = {"eager-prefill": "_token_rows", "no-cap": "prefill_chunk_cap", "no-ride": "ride_along"}
    have = {"_token_rows": hasattr(runs, "_token_rows"), "prefill_chunk_cap": hasattr(EngineArgs, "prefill_chunk_cap"),
            "ride_along": hasattr(R, "ride_along")}  # fmt: skip
    if name == "default":
        return contextlib.nullcontext()
    if name == "none":
        return patched() if all(have.values()) else None
    if name.startswith("flat-"):  # (the first tree's variants only: this tree's runner)
        return patched()
    return patched() if have[needs[name]] else None


def child(args: argparse.Namespace) -> None:
    """One tree's runs, in this process (``measure``), as a ``RESULT`` line."""
    result(measure(args))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One tree's runs, in this process: the model built once, each variant plain and overlapped (``runs``:
    "variant/plain" and "variant/overlap", seconds and steps), its floors' inputs beside them."""
    import torch

    for where in (args.prompts_dir, os.path.join(HERE, "..", "..", "shared", "vllm_gpu"), ".vw2/tools"):
        if where and os.path.exists(os.path.join(where, "prompts.py")):
            sys.path.insert(0, os.path.abspath(where))
            break
    from prompts import make_prompts, prompts_digest  # (../shared/vllm_gpu's: the ids vLLM's side serves)

    from pagedkv.models.llama import IdTokenizer
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.engine_args import freeze_startup
    from pagedkv.shell.sampling import SamplingParams

    t0 = time.perf_counter()
    model, layer, head = load(args.checkpoint, args.shape, args.device)  # (vLLM's side's checkpoint, or random)
    vocab = model.config.vocab_size
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    built = time.perf_counter() - t0
    ids = make_prompts(args.prompts, 0, vocab)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.new
    )  # (IdTokenizer has no stop ids: every request runs to max_tokens)
    reqs = [("", p, params) for p in ids]
    ptoks, new = sum(map(len, ids)), args.prompts * args.new
    floor = (2 * layer * (ptoks + new) + 2 * head * new) / (args.tflops * 1e12)
    # the decode steps' keys: a request's j-th new token (j >= 1) is decoded over its prompt and j tokens
    c = model.config
    keys = sum((args.new - 1) * len(p) + (args.new - 1) * args.new // 2 for p in ids)
    kv_bytes = keys * c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.finfo(torch.bfloat16).bits // 8
    out: dict[str, Any] = {"built_s": built, "floor_s": floor, "digest": prompts_digest(ids), "prompt_tokens": ptoks,
                           "new_tokens": new, "kv_bytes": kv_bytes, "copy_gbs": copy_bandwidth(args.device) / 1e9,
                           "runs": {}, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "CPU"}  # fmt: skip
    for name in args.variants.split(","):
        ctx = variant(name)
        if ctx is None:
            continue
        with ctx:
            for overlap in (False, True):
                eng = Engine(model, IdTokenizer(), kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget,
                             enable_prefix_caching=False, async_scheduling=overlap)  # fmt: skip
                eng.generate(reqs[:8])  # (warm: first calls' set-up)
                freeze_startup()  # as an engine process does (vLLM's engine core too); undone before it goes
                sync()
                t = time.perf_counter()
                done = eng.generate(reqs)
                sync()
                dt = time.perf_counter() - t
                gc.unfreeze()  # (the engine and its pool collectable again: the next one takes their memory)
                assert all(len(c.token_ids) == args.new for c in done)
                out["runs"][f"{name}/{'overlap' if overlap else 'plain'}"] = {"s": dt, "steps": eng.stats.steps}
                print(f"{name} {'overlap' if overlap else 'plain'}: {dt:.2f} s", file=sys.stderr, flush=True)
                del eng, done
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def copy_bandwidth(device: str) -> float:
    """Bytes a second a device-to-device copy of 1 GiB moves (read and written), best of 5: the rate the KV reads'
    floor takes."""
    import torch

    if device != "cuda":
        return float("inf")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--trees", default="main=.", help="name=PATH,... (each tree run with PYTHONPATH=PATH)")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--tflops", type=float, default=790.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (--shape tiny --kv-gib 1)")
    ap.add_argument("--checkpoint", help="a checkpoint directory to serve instead of --shape's random model")
    ap.add_argument("--prompts-dir", default=os.environ.get("PROMPTS_DIR"), help="where prompts.py is")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    trees = [t.split("=", 1) for t in args.trees.split(",")]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for r in range(args.repeats):
        for name, path in trees[r % len(trees) :] + trees[: r % len(trees)]:
            variants = args.variants if name == trees[0][0] else "default"
            cmd = [sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:], "--variants", variants]
            if args.prompts_dir:
                cmd += ["--prompts-dir", os.path.abspath(args.prompts_dir)]
            got = child_result(cmd, tree_env(path), name, cwd=os.path.abspath(path), echo=True)
            if got is not None:
                results[name].append(got)
    first = next((x for xs in results.values() for x in xs), None)
    if first is None:
        sys.exit("no tree gave a result (each one's output is above)")
    kv_s = first["kv_bytes"] / (first["copy_gbs"] * 1e9)
    what = f"checkpoint {args.checkpoint}" if args.checkpoint else f"{args.shape} shapes, random init"
    print(f"\n{first['gpu']}; {what}, bf16; {args.prompts} prompts ({first['prompt_tokens']} "
          f"tokens, digest {first['digest']}) x {args.new} new; max_num_seqs {args.max_num_seqs}, budget {args.budget}; "
          f"floor {first['floor_s']:.2f} s (products at {args.tflops:.0f} TFLOP/s); the decode's KV reads "
          f"{first['kv_bytes'] / 1e12:.2f} TB at {first['copy_gbs']:,.0f} GB/s: {kv_s:.2f} s more\n")  # fmt: skip
    print(
        "| tree | variant | plain s | tok/s | overlapped s | tok/s | overlapped / floor | overlapped / floor with KV reads |"
        "\n|---|---|---:|---:|---:|---:|---:|---:|"
    )
    for name, xs in results.items():
        for v in dict.fromkeys(k.split("/")[0] for x in xs for k in x["runs"]):
            p = sorted(x["runs"][f"{v}/plain"]["s"] for x in xs if f"{v}/plain" in x["runs"])
            o = sorted(x["runs"][f"{v}/overlap"]["s"] for x in xs if f"{v}/overlap" in x["runs"])
            pm, om = p[len(p) // 2], o[len(o) // 2]
            new = first["new_tokens"]
            print(f"| {name} | {v} | {pm:.2f} | {new / pm:,.0f} | {om:.2f} | {new / om:,.0f} | "
                  f"{om / first['floor_s']:.2f}x | {om / (first['floor_s'] + kv_s):.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
