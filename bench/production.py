"""The core on production traffic: a published trace replayed through three schedulers with no model, on a virtual
clock, GC on (issue 62).

A trace in Mooncake's FAST'25 format (github: kvcache-ai/Mooncake, ``FAST25-release/traces/*.jsonl``: one request a
line, ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``: a prompt's 512-token chunks, identical
where their hash ids are) is turned into token ids (a chunk's ids a function of its hash id, so equal hash ids share
prefixes exactly; a last chunk shorter than 512 is that function's first ids) and replayed: each request arrives at
its timestamp on a virtual clock that a step advances by 5 ms + 0.05 ms a scheduled token, asks its output length
(no early stop), and every variant sees the same arrivals. Variants, each in a process of its own, alternated over
the repeats:

- ``vllm``: vLLM's v1 ``Scheduler`` with its own KV cache manager (vLLM 0.33 or 0.34, whichever is installed);
- ``vllm+pagedkv``: the same scheduler with pagedkv's manager (``PagedKVScheduler``);
- ``pagedkv``: pagedkv's own pure scheduler (``core.scheduler``: ``schedule`` and ``on_output``), with vLLM's cache
  policies (``VLLM_POLICIES``: blocks cached when a chunk is planned, vLLM's free-queue order, duplicate contents
  cached), as pagedkv's manager runs inside vLLM, so that its hits are vLLM's; ``--own-policies``: pagedkv's defaults
  (a block cached once computed: a request arriving while a prompt's chunks run finds fewer).

Timed, per step: the scheduler's CPU (vLLM: ``schedule`` and ``update_from_output``; pagedkv: ``schedule`` and
``on_output``), with GC on; apart: taking a request in (vLLM's ``add_request`` of a ``Request`` whose block hashes
its front end computed, the hashing included; pagedkv's ``submit``, which hashes them). Reported: per-step p50 / p99 and the total, the prefix hit rate (the
tokens each request's first chunk found cached over its prompt tokens), preemptions, steps, and whether the two vLLM
variants scheduled identically (a digest of every step's scheduled tokens and preemptions). vLLM's chunked prefill
and prefix caching on; pagedkv's scheduler with chunked prefill and prefix caching, the same budget, seats and pool.
``--peers-workload`` replays ../shared/peers' workload instead of a trace file (``peers_records``: its draws, in
Mooncake's format, every request arriving at once; ``--max-num-seqs`` the running requests it keeps). Run it where
vLLM is installed (``.ci/vllm_env.sh VENV 0.34.0``):

    VENV/bin/python bench/production.py --trace synthetic_trace.jsonl --requests 2000
    VENV/bin/python bench/production.py --trace synthetic_trace.jsonl --requests 3993 --blocks 100000
    VENV/bin/python bench/production.py --peers-workload --requests 2000 --max-num-seqs 256 --blocks 40000 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHUNK = 512  # the trace's hash-id granularity, in tokens
VOCAB = 32_000
VARIANTS = ("vllm", "vllm+pagedkv", "pagedkv")
# vLLM's block pool's policies (docs/vllm.md), which pagedkv's manager inside vLLM runs with: pagedkv's own scheduler
# takes them too unless --own-policies, so that its hits are vLLM's (blocks cached when a chunk is planned, the free
# queue's order, duplicate contents cached)
VLLM_POLICIES = dict(caching_point="schedule", free_queue="vllm", cache_duplicates=True)


def prompts(path: str, n: int) -> list[tuple[float, list[int], int]]:
    """The first ``n`` requests of the trace: (arrival ms, prompt ids, output tokens)."""
    records = []
    with open(path) as f:
        for line in f:
            if len(records) >= n:
                break
            records.append(json.loads(line))
    return work_of(records)


def work_of(records: list[dict[str, Any]]) -> list[tuple[float, list[int], int]]:
    """Trace records (Mooncake's format) as (arrival ms, prompt ids, output tokens): a chunk's ids a function of its
    hash id, so equal hash ids share prefixes exactly."""
    out = []
    for r in records:
        ids: list[int] = []
        for h in r["hash_ids"]:
            take = min(CHUNK, r["input_length"] - len(ids))
            ids.extend((h * 2_654_435_761 + k * 40_503) % VOCAB + 1 for k in range(take))
        out.append((float(r["timestamp"]), ids, max(1, int(r["output_length"]))))
    return out


def peers_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` requests drawn as ../shared/peers' harness draws its workload (its defaults: prompts lognormal around
    250 tokens, sigma 1.0, 4 to 2,048; outputs lognormal around 200, sigma 0.8, 1 to 1,024; 30% of them one of 8
    shared 512-token prefixes followed by their own tokens), in Mooncake's format, every one arriving at 0 (the
    harness keeps its running requests topped up from a queue: here the scheduler's seats, ``--max-num-seqs``). A
    shared prefix is one chunk (hash id 0-7); a request's own tokens are chunks of hash ids no other request has."""
    out = []
    fresh = 8  # (hash ids 0-7: the shared prefixes)
    for i in range(n):
        r = random.Random(seed * 1_000_003 + i + 1)
        length = max(4, min(round(r.lognormvariate(math.log(250), 1.0)), 2048))
        output = max(1, min(round(r.lognormvariate(math.log(200), 0.8)), 1024))
        prefix = []
        if r.random() < 0.3:  # one of the shared prefixes, then the request's own tokens
            prefix = [r.randrange(8)]
            length = CHUNK + min(length, 2048 - CHUNK)
        own = -(-(length - CHUNK * len(prefix)) // CHUNK)
        out.append({"timestamp": 0, "input_length": length, "output_length": output,
                    "hash_ids": prefix + list(range(fresh, fresh + own))})  # fmt: skip
        fresh += own
    return out


def step_ms(tokens: int) -> float:
    return 5.0 + 0.05 * tokens


class Gc:
    """Counts CPython's collections and the seconds they take (gc.callbacks), the oldest generation's apart."""

    def __init__(self) -> None:
        self.count = self.full = 0
        self.seconds = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.count += 1
            self.full += info.get("generation") == 2
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0


def run_vllm(work: list[tuple[float, list[int], int]], args: argparse.Namespace, ours: bool) -> dict[str, Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from tests.integrations.vllm_harness import BLOCK_SIZE, Layout, make_scheduler, model_output, scheduler_classes

    cls = scheduler_classes(False)[1 if ours else 0]
    sched = make_scheduler(
        cls,
        args.blocks,
        Layout(),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.budget,
        max_model_len=args.max_model_len,
        events=False,
        log_stats=False,
        hash_algo="sha256",
    )
    hasher = get_request_block_hasher(BLOCK_SIZE, get_hash_fn_by_name("sha256"), 0)
    pending = list(enumerate(work))
    clock, step, times, intake = 0.0, 0, [], 0.0
    seen: set[str] = set()
    hit = total = preempted = 0
    digest = hashlib.sha256()
    collections = Gc()
    gc.collect()
    gc.freeze()
    while pending or sched.has_requests():
        while pending and pending[0][1][0] <= clock:
            i, (_, ids, out) = pending.pop(0)
            t0 = time.perf_counter()  # (the front end's Request hashes the prompt's blocks: intake, as submit's)
            request = Request(
                f"r{i}",
                ids,
                SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True),
                None,
                block_hasher=hasher,
            )
            sched.add_request(request)
            intake += time.perf_counter() - t0
        if not sched.has_requests():
            clock = pending[0][1][0]
            continue
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        runner = model_output(sched, so, step)
        t2 = time.perf_counter()
        sched.update_from_output(so, runner)
        times.append(t1 - t0 + time.perf_counter() - t2)
        for new in so.scheduled_new_reqs:
            if new.req_id not in seen:
                seen.add(new.req_id)
                hit += new.num_computed_tokens
                total += len(work[int(new.req_id[1:])][1])
        preempted += len(so.preempted_req_ids or ())
        digest.update(repr((sorted(so.num_scheduled_tokens.items()), sorted(so.preempted_req_ids or ()))).encode())
        clock += step_ms(so.total_num_scheduled_tokens)
        step += 1
    return {"times": times, "intake": intake, "hit": hit, "prompt": total, "preempted": preempted, "steps": step,
            "gc": collections.count, "gc_full": collections.full, "gc_s": collections.seconds,
            "digest": digest.hexdigest()[:12], "clock_s": clock / 1e3}  # fmt: skip


def run_pagedkv(work: list[tuple[float, list[int], int]], args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv.core import CacheConfig
    from pagedkv.core.outputs.metadata import Phase
    from pagedkv.core.scheduler import SchedulerConfig, SeqRequest, new_scheduler, on_output, schedule, submit
    from tests.integrations.vllm_harness import BLOCK_SIZE, sampled

    state = new_scheduler(
        CacheConfig(
            block_size=BLOCK_SIZE,
            num_blocks=args.blocks,
            enable_prefix_caching=True,
            max_model_len=args.max_model_len,
            kv_events=False,
            **({} if args.own_policies else VLLM_POLICIES),
        ),
        SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget, chunked_prefill=True),
    )
    pending = list(enumerate(work))
    clock, step, times, intake = 0.0, 0, [], 0.0
    seen: set[str] = set()
    hit = total = preempted = 0
    collections = Gc()
    gc.collect()
    gc.freeze()
    while pending or state.live:
        while pending and pending[0][1][0] <= clock:
            i, (_, ids, out) = pending.pop(0)
            t0 = time.perf_counter()
            state = submit(state, SeqRequest(f"r{i}", tuple(ids), max_tokens=out)).unwrap()
            intake += time.perf_counter() - t0
        if not state.live:
            clock = pending[0][1][0]
            continue
        t0 = time.perf_counter()
        state, plan = schedule(state).unwrap()
        t1 = time.perf_counter()
        tokens = {rid: sampled(rid, step) for rid in plan.samples}
        t2 = time.perf_counter()
        state, _ = on_output(state, tokens).unwrap()
        times.append(t1 - t0 + time.perf_counter() - t2)
        for meta in plan.metadata:
            if meta.phase is Phase.PREFILL:
                for row in meta.rows:
                    if row.request_id not in seen:
                        seen.add(row.request_id)
                        hit += row.kv_start_pos
                        total += len(work[int(str(row.request_id)[1:])][1])
        preempted += len(plan.preempted)
        clock += step_ms(plan.num_tokens)
        step += 1
    return {"times": times, "intake": intake, "hit": hit, "prompt": total, "preempted": preempted, "steps": step,
            "gc": collections.count, "gc_full": collections.full, "gc_s": collections.seconds,
            "digest": "-", "clock_s": clock / 1e3}  # fmt: skip


def child(args: argparse.Namespace) -> None:
    work = work_of(peers_records(args.requests)) if args.trace is None else prompts(args.trace, args.requests)
    t0 = time.perf_counter()
    if args.variant == "pagedkv":
        out = run_pagedkv(work, args)
    else:
        out = run_vllm(work, args, ours=args.variant == "vllm+pagedkv")
    out["wall"] = time.perf_counter() - t0
    print(json.dumps(out))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="a Mooncake FAST'25 trace (JSON Lines)")
    source.add_argument(
        "--peers-workload",
        action="store_true",
        help="../shared/peers' workload instead (short prompts decoding, 30%% sharing a prefix; all arrive at once)",
    )
    ap.add_argument("--requests", type=int, default=2000, help="its first N requests")
    ap.add_argument("--blocks", type=int, default=20_000, help="the pool, in 16-token blocks (the null block included)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--max-model-len", type=int, default=262_144)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--own-policies", action="store_true", help="pagedkv's scheduler with its own cache policies")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # (a child's)
    args = ap.parse_args()
    if args.variant:
        child(args)
        return
    variants = args.variants.split(",")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(args.repeats):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, *sys.argv[1:]]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
            if done.returncode or not lines:
                print(f"{v} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
                sys.exit(1)
            runs[v].append(json.loads(lines[-1]))
            print(f"  {v}: {runs[v][-1]['wall']:.1f} s", file=sys.stderr, flush=True)
    import vllm

    def middle(xs: list[dict[str, Any]]) -> dict[str, Any]:
        return sorted(xs, key=lambda x: sum(x["times"]))[len(xs) // 2]

    base = sum(middle(runs["vllm"])["times"]) if "vllm" in runs else None
    policies = "its own cache policies" if args.own_policies else "vLLM's cache policies"
    print(
        f"{os.path.basename(args.trace) if args.trace else 'the peers harness workload'}, first {args.requests} "
        f"requests; pool {args.blocks} blocks of 16, "
        f"max_num_seqs {args.max_num_seqs}, {args.budget} tokens a step, chunked prefill and prefix caching on; "
        f"vLLM {vllm.__version__}; GC on; median of {args.repeats} run(s) a variant, each in its own process; "
        f"pagedkv's scheduler with {policies}"
    )
    print("\n| variant | scheduler CPU a step p50 / p99 (ms) | total (s) | vs vLLM | intake (s) | hit rate | "
          "preemptions | steps | GC runs (full) / s | schedule digest | wall (s) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for v in variants:
        xs = runs[v]
        mid = middle(xs)
        tot = sum(mid["times"])
        ratio = f"{tot / base:.2f}x" if base else "-"
        print(
            f"| {v} | {1e3 * pct(mid['times'], 0.5):.2f} / {1e3 * pct(mid['times'], 0.99):.2f} | {tot:.1f} | "
            f"{ratio} | {mid['intake']:.1f} | {100 * mid['hit'] / max(mid['prompt'], 1):.2f}% "
            f"({mid['hit']:,} tokens) | {mid['preempted']} | {mid['steps']} | "
            f"{mid['gc']} ({mid['gc_full']}) / {mid['gc_s']:.2f} | {mid['digest']} | "
            f"{mid['wall']:.0f} |"
        )


if __name__ == "__main__":
    main()
