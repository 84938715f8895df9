"""vLLM's real v1 ``Scheduler`` on the CPU, driven step by step without a model: the differential test of
pagedkv's KV cache manager (tests/integrations/test_vllm_manager.py) and bench/vllm_step.py share it.

Needs vLLM 0.33 or 0.34 importable (.ci/vllm_env.sh: ``VLLM_TARGET_DEVICE=cpu``). A folder holding a tiny Llama
``config.json`` stands for the model (no hub, no weights, no tokenizer; one folder a process, removed at exit);
the "model" samples token ``(request, step)``-determined ids, so both managers see the same tokens. Each step
records what the scheduler decided: the requests scheduled and their token counts, the block ids each was given,
each new (or resumed) request's prefix hit, the preempted and finished ids, and the KV events (encoded and decoded
with vLLM's own msgspec types). What differs between the releases the harness drives (0.34: resumed requests among
the new ones, no ``req_id_to_index``, no V1 model runner, a CPU platform that asks for triton-cpu on x86) is read
here by what the installed vLLM has.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import random
import shutil
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

BLOCK_SIZE = 16
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 1 << 18,  # (the production-trace bench serves 191k-token prompts)
    "torch_dtype": "float32",
}


_FOLDER: list[str] = []


def model_folder() -> str:
    """The tiny Llama's folder, made once a process (every config of a run reads it) and removed at exit."""
    if not _FOLDER:
        folder = tempfile.mkdtemp(prefix="pagedkv-tinyllama-")
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        atexit.register(shutil.rmtree, folder, True)
        _FOLDER.append(folder)
    return _FOLDER[0]


def release() -> tuple[int, int]:
    """The installed vLLM's (major, minor)."""
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


def vllm_available() -> str | None:
    """None when vLLM's scheduler can be built here, else why not."""
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (any import failure means: not here)
        return f"vLLM's v1 scheduler is not importable here: {type(exc).__name__}: {exc}"
    return None


@dataclass
class Layout:
    """The KV cache groups: full attention, and optionally sliding-window groups and Mamba groups (a hybrid
    model's, in ``mamba_cache_mode="align"``, its state's page padded to the attention page as vLLM pads it)."""

    windows: tuple[int, ...] = ()  # one sliding-window group per entry, its window in tokens
    mamba: int = 0  # Mamba groups after them

    def kv_cache_config(self, num_blocks: int) -> Any:
        import torch
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
            SlidingWindowSpec,
        )

        groups = [
            KVCacheGroupSpec(
                ["full.0"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float32)
            )
        ]
        for i, w in enumerate(self.windows):
            groups.append(
                KVCacheGroupSpec(
                    [f"swa.{i}"],
                    SlidingWindowSpec(
                        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=w
                    ),
                )
            )
        for i in range(self.mamba):  # (conv state 3 x 32, SSM state 2 x 16 x 8, in the attention page's 4 KiB)
            groups.append(
                KVCacheGroupSpec(
                    [f"mamba.{i}"],
                    MambaSpec(
                        block_size=BLOCK_SIZE,
                        shapes=((3, 32), (2, 16, 8)),
                        dtypes=(torch.float32, torch.float32),
                        page_size_padded=groups[0].kv_cache_spec.page_size_bytes,
                        mamba_cache_mode="align",
                    ),
                )
            )
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)  # no worker here


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding as vLLM's ``SpeculativeConfig`` sets it up: n-gram prompt lookup or EAGLE, ``k``
    drafts a step; EAGLE's block hashes cover the token after each block (vLLM 0.33's default) or, with
    ``lookahead_hashes`` off, a hit drops its last block instead."""

    method: str  # "ngram" or "eagle"
    k: int
    lookahead_hashes: bool = True


def make_scheduler(
    scheduler_cls: type,
    num_blocks: int,
    layout: Layout,
    *,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 2048,
    events: bool = True,
    log_stats: bool = True,
    caching: bool = True,
    watermark: float = 0.0,
    hash_algo: str = "sha256_cbor",
    metrics: bool = False,
    async_scheduling: bool = False,
    speculation: Speculation | None = None,
    v2_runner: bool = False,
    cache_aware: int = 0,
) -> Any:
    """vLLM's ``Scheduler`` (or a subclass) over a ``num_blocks`` pool, as its engine core builds it;
    ``hash_algo`` its ``--prefix-caching-hash-algo``, ``metrics`` its KV cache residency metrics (every block
    sampled, so the counts are deterministic); ``async_scheduling`` on (``scheduler_cls`` is then an
    ``AsyncScheduler``: vLLM's CPU platform turns it off, it is turned on again here), ``speculation``,
    ``v2_runner`` vLLM's V2 model runner (what the scheduler sends it and how it resumes requests; 0.34 has no
    other), ``cache_aware`` vLLM 0.34's ``--cache-aware-admission-window`` (its threshold 0: every step; the
    scheduler then probes its manager's cache, ``get_num_cached_tokens``; 0.33 has none)."""
    env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if release() < (0, 34):  # (0.34 has the V2 model runner alone)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = (
            "1" if v2_runner else "0"
        )  # (read while the config and scheduler are built)
    try:
        return _make_scheduler(
            scheduler_cls,
            num_blocks,
            layout,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            events,
            log_stats,
            caching,
            watermark,
            hash_algo,
            metrics,
            async_scheduling,
            speculation,
            cache_aware,
        )
    finally:
        if env is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = env


def _make_scheduler(
    scheduler_cls: type,
    num_blocks: int,
    layout: Layout,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    events: bool,
    log_stats: bool,
    caching: bool,
    watermark: float,
    hash_algo: str,
    metrics: bool,
    async_scheduling: bool,
    speculation: Speculation | None,
    cache_aware: int,
) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        ModelConfig,
        ObservabilityConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.structured_output import StructuredOutputManager

    folder = model_folder()
    model = ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len)
    cache = CacheConfig(
        block_size=BLOCK_SIZE,
        enable_prefix_caching=caching,
        prefix_caching_hash_algo=hash_algo,
        mamba_cache_mode="align" if layout.mamba else "none",
    )
    aware = {"cache_aware_admission_window": cache_aware, "cache_aware_admission_threshold": 0.0}
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        watermark=watermark,
        **(aware if cache_aware and release() >= (0, 34) else {}),
    )
    kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None
    observe = ObservabilityConfig(kv_cache_metrics=metrics, kv_cache_metrics_sample=1.0)
    parallel = ParallelConfig()
    spec = None
    if speculation is not None:
        how: dict[str, Any] = (
            {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
            if speculation.method == "ngram"
            else {"model": folder, "disable_lookahead_block_hashes": not speculation.lookahead_hashes}
        )
        spec = SpeculativeConfig(
            target_model_config=model,
            target_parallel_config=parallel,
            method=speculation.method,
            num_speculative_tokens=speculation.k,
            **how,
        )
    sched.async_scheduling = async_scheduling  # (validated as vLLM does on a GPU)
    import vllm.triton_utils as triton_utils

    had = triton_utils.HAS_TRITON  # (vLLM 0.34's CPU platform refuses x86 without triton-cpu: its model runner
    triton_utils.HAS_TRITON = True  # needs it; no model runs here, and a GPU user never meets the check)
    try:
        config = VllmConfig(
            model_config=model,
            cache_config=cache,
            scheduler_config=sched,
            device_config=DeviceConfig("cpu"),
            kv_events_config=kv_events,
            observability_config=observe,
            parallel_config=parallel,
            speculative_config=spec,
        )
    finally:
        triton_utils.HAS_TRITON = had
    config.scheduler_config.async_scheduling = async_scheduling  # (the CPU platform turned it off)
    config.cache_config.num_gpu_blocks = num_blocks
    init_none_hash(get_hash_fn_by_name(hash_algo))
    return scheduler_cls(
        vllm_config=config,
        kv_cache_config=layout.kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=log_stats,
    )


@dataclass
class Workload:
    """Requests arriving over steps: prompts sharing prefixes, outputs of different lengths, some aborted."""

    num_requests: int = 200
    seed: int = 0
    prefixes: int = 6  # shared system prompts
    arrivals_per_step: int = 6
    abort_every: int = 11  # every n-th request is aborted mid-way
    reset_every: int = 0  # a reset_prefix_cache after every n-th step (0: none)
    skip_cache_every: int = 13  # every n-th request asks for prompt logprobs: it must not read the prefix cache
    idle_after: int | None = None  # requests from this index on arrive only once the scheduler is idle
    long_prompts: float = 0.0  # the share of prompts of 200 to max_prompt tokens (long hits under windows)
    repeats: float = 0.0  # the share of prompts that repeat an earlier one whole (a hit on its own prefix)
    lora_every: int = 0  # every n-th request runs one of two LoRA adapters (0: none)
    salt_every: int = 0  # every n-th request carries one of two cache salts (0: none)
    report_every: int = 0  # every n-th request asks kv_cache_report_mode="full" (0: none)
    # every n-th request scores its prompt (prompt logprobs) and reads the prefix cache all the same: vLLM 0.34 from
    # row 32 on (its hit limit: 32 tokens at most), 0.33 whole (0: none)
    scored_every: int = 0
    max_prompt: int = 2000  # no prompt is longer (so every request fits the pool alone)
    requests: list[tuple[str, list[int], int, int | None]] = field(default_factory=list)  # id, prompt, max, abort

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        systems = [[rng.randrange(1, 1000) for _ in range(rng.choice((16, 32, 40, 64)))] for _ in range(self.prefixes)]
        for i in range(self.num_requests):
            if self.repeats and self.requests and rng.random() < self.repeats:  # (no draw when off: the
                # workloads of the first cases stay what they were)
                prompt = list(rng.choice(self.requests)[1])
            else:
                head = systems[rng.randrange(self.prefixes)] if rng.random() < 0.7 else []
                long = bool(self.long_prompts) and rng.random() < self.long_prompts
                n = rng.randrange(200, max(201, min(self.max_prompt, 1800))) if long else rng.randrange(1, 90)
                prompt = (head + [rng.randrange(1, 1000) for _ in range(n)])[: self.max_prompt]
            abort_at = rng.randrange(1, 12) if i % self.abort_every == 5 else None
            self.requests.append((f"r{i}", prompt, rng.randrange(1, 60), abort_at))

    def extras(self, rid: str) -> dict[str, Any]:
        """A request's LoRA adapter, cache salt and report mode (vLLM's Request and SamplingParams fields)."""
        i = int(rid[1:])
        out: dict[str, Any] = {}
        if self.lora_every and i % self.lora_every == 1:
            from vllm.lora.request import LoRARequest

            k = 1 + i // self.lora_every % 2
            out["lora_request"] = LoRARequest(f"adapter-{k}", k, f"/adapters/{k}")
        if self.salt_every and i % self.salt_every == 2:
            out["cache_salt"] = f"tenant-{i // self.salt_every % 2}"
        if self.report_every and i % self.report_every == self.report_every - 1:
            out["extra_args"] = {"kv_cache_report_mode": "full"}
        if self.scored_every and i % self.scored_every == 3:
            out["scored"] = {"prompt_logprobs": 1, "skip_reading_prefix_cache": False}
            if release() >= (0, 34):
                out["scored"]["prompt_logprob_start"] = 32
        return out


def sampled(req_id: str, step: int) -> int:
    """The token the fake model samples for a request at a step: the same for both managers."""
    return (sum(map(ord, req_id)) * 31 + step * 17) % 999 + 1


def _mix(req_id: str, step: int, salt: int) -> int:
    return (sum(map(ord, req_id)) * (salt * 2 + 131) + step * (salt * 6 + 37) + salt * 1009) % 10007


def draft_ids(req_id: str, step: int, k: int) -> list[int]:
    """The drafts the fake drafter proposes for a request after a step: 0 to k ids (n-gram lookup often finds
    fewer, or none)."""
    n = min(k, _mix(req_id, step, 1) % (k + 2))
    return [(_mix(req_id, step, 2 + j) % 999) + 1 for j in range(n)]


def accepted(req_id: str, step: int, drafts: int) -> int:
    """How many of a request's ``drafts`` scheduled drafts the fake target model accepts at a step."""
    return min(drafts, _mix(req_id, step, 3) % (drafts + 2))


@dataclass
class StepRecord:
    scheduled: dict[str, int]  # request -> tokens scheduled
    new_blocks: dict[str, tuple[tuple[int, ...], ...]]  # new requests: their block ids; running: the new ids
    hits: dict[str, int]  # new (or resumed) requests: num_computed_tokens at scheduling
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    events: list[Any]  # decoded with vLLM's types
    stats: tuple[Any, ...]  # KV cache usage, the step's prefix-cache stats (vLLM's SchedulerStats), a reset's answer
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the draft ids scheduled (-1: a placeholder)


def model_output(scheduler: Any, out: Any, step: int) -> Any:
    """What the fake model returns for a scheduled step, decided when it is scheduled (the GPU runs it then):
    a token for each request whose step ends its prefill, after the drafts it accepts. Under async scheduling
    the scheduler sends -1 placeholders for drafts the worker made itself; the fake worker's drafts stand
    behind them, but not behind the padding of a request just taken from the waiting queue (it has none)."""
    from vllm.v1.outputs import ModelRunnerOutput

    async_ = scheduler.scheduler_config.async_scheduling
    resumed = getattr(out.scheduled_cached_reqs, "resumed_req_ids", ())  # (0.34: resumed among the new ones)
    fresh = {new.req_id for new in out.scheduled_new_reqs} | set(resumed)
    req_ids = list(out.num_scheduled_tokens)
    tokens = []
    for rid in req_ids:
        if scheduler.requests[rid].is_prefill_chunk:
            tokens.append([])
            continue
        drafts = list(out.scheduled_spec_decode_tokens.get(rid, ()))
        if async_ and rid not in fresh and drafts:
            drafts = [(_mix(rid, step, 4 + j) % 999) + 1 for j in range(len(drafts))]
        good = []
        for t in drafts[: accepted(rid, step, len(drafts))]:
            if t < 0:  # (padding is never accepted)
                break
            good.append(t)
        tokens.append(good + [sampled(rid, step)])
    index = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    extra = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if "req_id_to_index" in index else {}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=tokens, **extra)  # (0.34: no req_id_to_index)


class EngineLoop:
    """vLLM's engine core driving a scheduler (``EngineCore.step``, and under async scheduling
    ``step_with_batch_queue`` with two batches in flight: step N+1 is scheduled before step N's output is
    read), the fake model answering each batch (``model_output``); with speculative decoding and no async
    scheduling, the drafter's proposals reach the scheduler after each step's output (``post_step``)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.async_ = scheduler.scheduler_config.async_scheduling
        self.depth = 2 if self.async_ else 1  # (vLLM's max_concurrent_batches without pipeline parallelism)
        self.k = scheduler.num_spec_tokens
        self.in_flight: deque[tuple[Any, Any, int]] = deque()

    def step(self, step: int) -> tuple[Any, Any]:
        """One engine-core step: (the scheduler output scheduled, or None; the engine outputs of the batch whose
        output was read, or None)."""
        from vllm.v1.outputs import DraftTokenIds

        sched = self.scheduler
        out = None
        if sched.has_requests():
            out = sched.schedule()
            self.in_flight.appendleft((out, model_output(sched, out, step), step))
        ran = out is not None and (out.total_num_scheduled_tokens > 0 or sched.has_requests())
        if not self.in_flight or (ran and len(self.in_flight) < self.depth):
            return out, None  # (the batch runs; no output is read this step)
        done, runner, at = self.in_flight.pop()
        engine_out = sched.update_from_output(done, runner)
        if self.k and not self.async_ and done.total_num_scheduled_tokens > 0:  # the drafter's proposals
            ids = list(done.num_scheduled_tokens)
            drafts = [draft_ids(rid, at, self.k) if runner.sampled_token_ids[i] else [] for i, rid in enumerate(ids)]
            sched.update_draft_token_ids(DraftTokenIds(ids, drafts))
        return out, engine_out


def drive(
    scheduler: Any, workload: Workload, *, max_steps: int = 5000, on_step: Callable[[int], None] | None = None
) -> list[StepRecord]:
    """Run the workload to its end through ``scheduler`` as vLLM's engine core drives it (``EngineLoop``);
    what each step decided."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request, RequestStatus

    config = scheduler.vllm_config
    hasher = get_request_block_hasher(
        BLOCK_SIZE,
        get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo),
        config.num_hash_lookahead_tokens,
    )
    recorder = Recorder(msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVEventBatch))
    scheduler.kv_event_publisher = recorder
    engine = EngineLoop(scheduler)
    pending = list(workload.requests)
    started: dict[str, int] = {}  # request -> the step it was first scheduled at
    abort_at = {rid: a for rid, _, _, a in workload.requests if a is not None}
    records: list[StepRecord] = []
    step = 0
    first_late = len(pending) if workload.idle_after is None else workload.idle_after
    while (pending or scheduler.has_requests() or engine.in_flight) and step < max_steps:
        arriving = pending[: workload.arrivals_per_step]
        if len(workload.requests) - len(pending) >= first_late and scheduler.has_unfinished_requests():
            arriving = []  # the late ones wait for an idle scheduler (a reset between them then clears the cache)
        for rid, prompt, max_tokens, _ in arriving:
            skip = workload.skip_cache_every and int(rid[1:]) % workload.skip_cache_every == 7
            extra = workload.extras(rid)
            scored = extra.pop("scored", {})
            reads = scored.pop("skip_reading_prefix_cache", None)
            params = SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                skip_reading_prefix_cache=bool(skip) or reads,
                extra_args=extra.pop("extra_args", None),
                **scored,
            )
            scheduler.add_request(Request(rid, prompt, params, pooling_params=None, block_hasher=hasher, **extra))
        del pending[: len(arriving)]
        for rid, at in list(abort_at.items()):  # aborts arrive between steps
            if rid in started and step - started[rid] >= at:
                scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                del abort_at[rid]
        record = StepRecord({}, {}, {}, (), (), [], ())
        out, engine_out = engine.step(step)
        if out is not None:
            for new in out.scheduled_new_reqs:
                record.new_blocks[new.req_id] = tuple(tuple(g) for g in new.block_ids)
                record.hits[new.req_id] = new.num_computed_tokens
                started.setdefault(new.req_id, step)
            cached = out.scheduled_cached_reqs
            resumed = set(getattr(cached, "resumed_req_ids", ()))  # (0.34: resumed among the new ones)
            for rid, ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
                record.new_blocks[rid] = tuple(tuple(g) for g in ids) if ids is not None else ()
                if rid in resumed:
                    record.hits[rid] = computed
            record.scheduled = dict(out.num_scheduled_tokens)
            record.preempted = tuple(sorted(out.preempted_req_ids or ()))
            record.finished = tuple(sorted(out.finished_req_ids))
            record.drafts = {rid: tuple(d) for rid, d in out.scheduled_spec_decode_tokens.items()}
        for eco in (engine_out or {}).values():
            if eco.scheduler_stats is not None:
                st = eco.scheduler_stats
                p = st.prefix_cache_stats
                record.stats = (
                    round(st.kv_cache_usage, 12),
                    p.requests,
                    p.queries,
                    p.hits,
                    p.preempted_requests,
                    p.preempted_queries,
                    p.preempted_hits,
                    p.reset,
                    tuple(len(e.reuse_gaps_seconds) for e in st.kv_cache_eviction_events),
                )
        if workload.reset_every and step % workload.reset_every == workload.reset_every - 1:
            record.stats += (scheduler.reset_prefix_cache(),)  # refused while blocks are held; else clears the cache
        record.events = [ev for batch in recorder.batches for ev in batch.events]
        recorder.batches.clear()
        records.append(record)
        if on_step is not None:
            on_step(step)
        step += 1
    return records


class Recorder:
    """Stands for vLLM's event publisher: each batch through the wire (vLLM's own msgspec types) and kept."""

    def __init__(self, encoder: Any, decoder: Any) -> None:
        self.encoder, self.decoder = encoder, decoder
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(self.decoder.decode(self.encoder.encode(batch)))

    def shutdown(self) -> None:
        pass


FIELDS = ("scheduled", "new_blocks", "hits", "preempted", "finished", "events", "stats", "drafts")


def first_difference(theirs: list[StepRecord], ours: list[StepRecord]) -> str | None:
    """Where pagedkv's run departs from vLLM's: the first step and field that differ, or None."""
    for i, (a, b) in enumerate(zip(theirs, ours)):
        for name in FIELDS:
            if getattr(b, name) != getattr(a, name):
                return f"step {i}: {name} differs: vLLM {getattr(a, name)!r:.300}, pagedkv {getattr(b, name)!r:.300}"
    if len(ours) != len(theirs):
        return f"{len(theirs)} steps in vLLM's run, {len(ours)} in pagedkv's"
    return None


def fuzzed(seed: int) -> tuple[int, Layout, dict[str, Any], dict[str, Any]]:
    """A configuration drawn from ``seed``: (pool blocks, layout, workload options, scheduler options). Pools
    from tight (preemption, long hits under windows) to roomy; every option the manager serves."""
    rng = random.Random(seed)
    windows = tuple(sorted(rng.sample((16, 32, 48, 64, 128), rng.choice((0, 0, 1, 1, 2)))))
    blocks = rng.choice((40, 60, 90, 200, 300))
    algo = rng.choice(("sha256", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor"))
    chunk = rng.choice((64, 128, 256, 512))
    # the longest prompt a request with its output still fits alone: the full group's blocks and each window's
    fits = (blocks - 1 - sum((w + chunk) // BLOCK_SIZE + 2 for w in windows)) * BLOCK_SIZE - 64
    work = {
        "num_requests": rng.choice((40, 60, 80)),
        "seed": rng.randrange(1 << 30),
        "long_prompts": rng.choice((0, 0.1, 0.3)),
        "max_prompt": max(fits, 32),
        "repeats": rng.choice((0, 0.2, 0.5)),
        "lora_every": rng.choice((0, 3, 5)),
        "salt_every": rng.choice((0, 4)),
        "report_every": rng.choice((0, 3)),
        "reset_every": rng.choice((0, 0, 9)),
        "arrivals_per_step": rng.choice((2, 6)),
    }
    options = {
        "max_num_batched_tokens": chunk,
        "max_num_seqs": rng.choice((8, 32)),
        "watermark": rng.choice((0.0, 0.0, 0.05)),
        "caching": rng.random() < 0.9,
        "hash_algo": algo,
        "metrics": rng.random() < 0.5,
    }
    # issue 31 (drawn after the rest, so each seed's other choices stay what they were): async scheduling,
    # speculative decoding (n-gram, EAGLE with lookahead hashes or its block drop), vLLM's V2 model runner
    method = rng.choice((None, None, "ngram", "eagle"))
    options["async_scheduling"] = rng.random() < 0.4
    if method is not None:
        options["speculation"] = Speculation(method, rng.choice((1, 2, 3, 4, 8)), lookahead_hashes=rng.random() < 0.6)
    options["v2_runner"] = options["async_scheduling"] and (method == "ngram" or rng.random() < 0.5)
    # issue 34 (drawn last again): a Mamba group in align mode, without speculation (its blocks for drafts are
    # refused)
    mamba = int(method is None and rng.random() < 0.4)
    # issue 61 (drawn last again): vLLM 0.34's hit limit for requests scoring their prompt, and its cache-aware
    # admission (0.33: the prompt read whole, admission in order)
    work["scored_every"] = rng.choice((0, 0, 5))
    options["cache_aware"] = rng.choice((0, 0, 4, 16))
    return blocks, Layout(windows=windows, mamba=mamba), work, options


def scheduler_classes(async_scheduling: bool) -> tuple[type, type]:
    """(vLLM's scheduler, pagedkv's) for the setting: ``Scheduler`` and ``PagedKVScheduler``, or their async forms."""
    from pagedkv.integrations import vllm as ours

    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        return AsyncScheduler, ours.PagedKVAsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler, ours.PagedKVScheduler


def differential(
    blocks: int, layout: Layout, work: dict[str, Any], options: dict[str, Any]
) -> tuple[str | None, int, Any]:
    """vLLM's scheduler with its own manager and with pagedkv's on one workload: the first difference (or
    None; a raise in either run is one), the steps run, and pagedkv's manager."""
    theirs_cls, ours_cls = scheduler_classes(options.get("async_scheduling", False))
    theirs = drive(make_scheduler(theirs_cls, blocks, layout, **options), Workload(**work))
    ours_sched = make_scheduler(ours_cls, blocks, layout, **options)
    try:
        ours = drive(ours_sched, Workload(**work))
    except Exception as e:  # noqa: BLE001  (a raise is a difference, reported with the rest)
        return f"pagedkv's run raised {type(e).__name__}: {e}", len(theirs), ours_sched.kv_cache_manager
    return first_difference(theirs, ours), len(theirs), ours_sched.kv_cache_manager


def ahead_of(options: dict[str, Any]) -> str:
    """A configuration's async scheduling and speculation, shortly: ``async+eagle4/drop``, ``ngram2``, ``-``."""
    spec = options.get("speculation")
    parts = [
        "async" if options.get("async_scheduling") else "",
        ""
        if spec is None
        else f"{spec.method}{spec.k}" + ("" if spec.lookahead_hashes or spec.method != "eagle" else "/drop"),
    ]
    return "+".join(p for p in parts if p) or "-"


def main() -> None:
    """Seeded fuzzing of the differential: ``python -m tests.integrations.vllm_harness [first_seed] [count]``, one line a
    configuration and a total (PYTHONHASHSEED is set, so the xxhash kinds' seed is shared by both runs)."""
    import sys
    import time

    os.environ.setdefault("PYTHONHASHSEED", "0")
    first, count = (int(sys.argv[1]) if len(sys.argv) > 1 else 0), (int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    same = steps = 0
    print(f"{'seed':>5} {'blocks':>6} {'windows':<10} {'algo':<12} {'ahead':<16} {'steps':>6} {'s':>6}  result")
    for seed in range(first, first + count):
        blocks, layout, work, options = fuzzed(seed)
        t = time.perf_counter()
        diff, n, _ = differential(blocks, layout, work, options)
        steps += n
        same += diff is None
        print(
            f"{seed:>5} {blocks:>6} {str(layout.windows):<10} {options['hash_algo']:<12} {ahead_of(options):<16} {n:>6} "
            f"{time.perf_counter() - t:>6.1f}  {diff or 'identical'}",
            flush=True,
        )
    print(f"{same} of {count} configurations identical to the end, {steps} steps")


def drive_reading_state(scheduler: Any, workload: Workload) -> tuple[list[StepRecord], int]:
    """``drive``, reading pagedkv's ``manager.state`` every fifth step (``rows_as_vllm_sees_them``): what each
    step decided, and how many rows the reads checked."""
    read: list[int] = []

    def on_step(step: int) -> None:
        if step % 5 == 2:
            read.append(rows_as_vllm_sees_them(scheduler))

    return drive(scheduler, workload, on_step=on_step), sum(read)


def rows_as_vllm_sees_them(scheduler: Any) -> int:
    """``manager.state``: each running request's row holds a slot for every position vLLM gave it, its known ids
    are vLLM's tokens (a prefix of them), and its blocks are the ones vLLM's scheduler holds; how many rows."""
    from pagedkv.core.store.state import row_token_ids

    manager = scheduler.kv_cache_manager
    state = manager.state
    rows = 0
    for request in scheduler.running:
        req = state.requests.get(request.request_id)
        if req is None:
            continue
        slot = req.slots[0]
        length, ids = state.row_len[slot], row_token_ids(state, slot)
        assert length >= request.num_computed_tokens and -(-length // manager.block_size) == len(
            manager.get_block_ids(request.request_id)[0]
        )
        assert ids is None or list(ids) == list(request.all_token_ids[: len(ids)])
        rows += 1
    return rows


if __name__ == "__main__":
    main()
