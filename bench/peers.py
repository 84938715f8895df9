"""pagedkv's core beside vLLM's KV cache manager, through ../shared/peers/bench_peers.py.

The harness drives every peer with the same continuous-batching trace and
times the bookkeeping only. This adapter drives pagedkv through its public API
the way an engine does: one ``decode_step`` for the whole running batch a step
(each row's last token computed and hashed where a block fills, the sampled
token appended), one ``release_many`` for the requests a step ended, and per
admission ``admit`` then a ``decode_step`` for the prompt's computed KV and the
first sampled token. The state is a value; a refused admission keeps the old one.

    bash ../shared/peers/setup_venv.sh "$PEERS_VENV"
    "$PEERS_VENV"/bin/pip install -e . --no-deps && "$PEERS_VENV"/bin/pip install pyrsistent returns immutables
    "$PEERS_VENV"/bin/python ../shared/peers/bench_peers.py --peers null,vllm,bench/peers.py:Adapter \\
        --n 64,256,1024 --repeats 3 --out peers.json
    python bench/peers.py peers.json          # the table of ratios (GC on, and GC off from a --gc-off run)

``Adapter`` runs the core without KV events, as the harness runs vLLM's manager; add
``bench/peers.py:AdapterWithEvents`` to ``--peers`` for the cost of reporting them.

The harness calls ``decode(handle, token)`` once per request and wants to know
at once whether a block was there. The adapter answers that the way the core
would (a token opens a block when its row's length is a multiple of the block
size) and queues the token; the queue goes to the core as one transition
before anything else happens (an admission, a release, the next step).
"""

from __future__ import annotations

import json
import sys
from array import array
from time import perf_counter_ns
from typing import Any

from returns.result import Success

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, decode_step, initial_state, release_many


class Handle:
    __slots__ = ("rid", "length", "queued")

    def __init__(self, rid: int, length: int) -> None:
        self.rid = rid
        self.length = length  # tokens in the row, before its queued token
        self.queued = False  # a token of it waits in this step's batch


class Adapter:
    """The core as an engine that publishes no KV events runs it (``kv_events=False``), like the harness's
    vLLM manager (``KVCacheManager``'s ``enable_kv_cache_events`` is off by default);
    ``AdapterWithEvents`` reports them."""

    name = "pagedkv"
    kv_events = False

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        cfg = CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks + 1,
            enable_prefix_caching=True,
            max_model_len=max_model_len,
            kv_events=self.kv_events,
        )
        self.state = initial_state(cfg)  # +1: pagedkv's block 0 is the null block, as vLLM's is
        self.block_size = block_size
        self.ids: list[int] = []  # the step's queued decodes: request ids and their sampled tokens
        self.tokens: list[int] = []
        self.handles: list[Handle] = []
        self.opening = 0  # blocks the queued decodes open
        self.ending: list[int] = []  # the step's queued releases
        self.last_hit_tokens = 0
        # per request: the admission (admit + the prompt's commit and first token) and the release,
        # apart from the queued decode batch a call may flush first (bench_peers.py reports p50s)
        self.phases: dict[str, list[int]] = {"admission": [], "release": []}

    def _flush(self) -> None:
        if self.ids:
            self.state = decode_step(self.state, self.ids, self.tokens).unwrap().state
            for h in self.handles:
                h.length += 1
                h.queued = False
            # the same lists, emptied: a new list of N items a step is N references for the GC to walk
            self.ids.clear()
            self.tokens.clear()
            self.handles.clear()
            self.opening = 0
        if self.ending:
            t0 = perf_counter_ns()
            self.state = release_many(self.state, self.ending, "finished").unwrap().state
            per = (perf_counter_ns() - t0) // len(self.ending)
            self.phases["release"].extend([per] * len(self.ending))
            self.ending.clear()

    def begin_step(self) -> None:
        self._flush()

    def admit(self, spec: Any, first_token: int) -> Handle | None:
        self._flush()
        t0 = perf_counter_ns()
        # the prompt's ids packed once, as an engine keeps them from its tokenizer on (an array("Q") is token ids by
        # construction: no check per id again, no copy per use)
        admitted = admit(self.state, RequestSpec(spec.idx, (RowSpec.of_tokens(array("Q", spec.prompt)),)))
        if not isinstance(admitted, Success):
            return None
        step = admitted.unwrap()
        first = decode_step(step.state, [spec.idx], [first_token])  # the prompt computed, its first token sampled
        if not isinstance(first, Success):
            return None  # no block for the first token: the pool keeps the state before the admission
        self.state = first.unwrap().state
        self.phases["admission"].append(perf_counter_ns() - t0)
        self.last_hit_tokens = step.effect.cached_tokens[0]
        return Handle(spec.idx, len(spec.prompt) + 1)

    def decode(self, h: Handle, token: int) -> bool:
        if h.queued:  # a second token of one request before the step ended (the harness's context scan):
            self._flush()  # the first one's step is over
        if h.length % self.block_size == 0:  # this token opens a block
            if self.state.free_blocks - self.opening < 1:
                self._flush()  # the queued releases give their blocks back first
                if self.state.free_blocks < 1:
                    return False
            self.opening += 1
        self.ids.append(h.rid)
        self.tokens.append(token)
        self.handles.append(h)
        h.queued = True
        return True

    def free(self, h: Handle) -> None:
        if self.ids:
            self._flush()
        self.ending.append(h.rid)


class AdapterWithEvents(Adapter):
    name = "pagedkv+events"
    kv_events = True


def table(paths: list[str]) -> str:
    """Same-repeat ratios of pagedkv's step to vLLM's (and nano-vllm's, where it ran), per N and GC
    setting, from bench_peers.py's JSON files; medians over the repeats. Admission and release are
    per request: vLLM's admit and free calls against this adapter's admission and release phases."""
    lines = [
        "| GC | N | pagedkv step µs | vLLM step µs | pagedkv / vLLM | nano-vllm / vLLM | admission µs p / v | "
        "release µs p / v | GC runs a step p (gen 0/1/2) | GC runs a step v | prefix-hit fraction p / v |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for path in paths:
        data = json.load(open(path))
        runs = data["runs"]
        ours = next(k for k in runs if k.endswith(":Adapter") and "peers.py" in k)
        steps = data["args"]["steps"]
        gc = "off" if data["args"].get("gc_off") else "on"
        for n in sorted(runs[ours], key=int):
            p, v = runs[ours][n], runs["vllm"][n]
            ratio = _median([a["step_p50_us"] / b["step_p50_us"] for a, b in zip(p["reps"], v["reps"])])
            nano = "-"
            if "nanovllm" in runs:
                q = runs["nanovllm"][n]
                nano = f"{_median([a['step_p50_us'] / b['step_p50_us'] for a, b in zip(q['reps'], v['reps'])]):.2f}x"
            ph = p.get("phases_p50_us", {})
            adm, rel = ph.get("admission", float("nan")), ph.get("release", float("nan"))
            ours_gc = "/".join(f"{c / steps:.2f}" for c in p["gc_collections_gen012"])
            vllm_gc = f"{sum(v['gc_collections_gen012']) / steps:.2f}"
            lines.append(
                f"| {gc} | {n} | {p['step_p50_us']:.0f} | {v['step_p50_us']:.0f} | {ratio:.2f}x | {nano} | "
                f"{adm:.0f} / {v['admit_p50_us']:.0f} ({adm / v['admit_p50_us']:.2f}x) | "
                f"{rel:.1f} / {v['free_p50_us']:.1f} ({rel / v['free_p50_us']:.2f}x) | {ours_gc} | {vllm_gc} | "
                f"{p['prefix_hit_frac']:.4f} / {v['prefix_hit_frac']:.4f} |"
            )
    return "\n".join(lines)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


if __name__ == "__main__":
    print(table(sys.argv[1:]))
