"""vLLM's real v1 ``Scheduler`` on the CPU, driven step by step without a model: the differential test of
pagedkv's KV cache manager (tests/test_vllm_manager.py) and bench/vllm_step.py share it.

Needs vLLM 0.33 importable (../shared/peers' venv: ``VLLM_TARGET_DEVICE=cpu``; ``pip install einops``
there). A folder holding a tiny Llama ``config.json`` stands for the model (no hub, no weights, no
tokenizer); the "model" samples token ``(request, step)``-determined ids, so both managers see the same
tokens. Each step records what the scheduler decided: the requests scheduled and their token counts, the
block ids each was given, each new request's prefix hit, the preempted and finished ids, and the KV events
(encoded and decoded with vLLM's own msgspec types).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

BLOCK_SIZE = 16
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
              "torch_dtype": "float32"}  # fmt: skip


def vllm_available() -> str | None:
    """None when vLLM's scheduler can be built here, else why not."""
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (any import failure means: not here)
        return f"vLLM's v1 scheduler is not importable here: {type(exc).__name__}: {exc}"
    return None


@dataclass
class Layout:
    """The KV cache groups: full attention, and optionally sliding-window groups."""

    windows: tuple[int, ...] = ()  # one sliding-window group per entry, its window in tokens

    def kv_cache_config(self, num_blocks: int) -> Any:
        import torch
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec,
        )  # fmt: skip

        groups = [KVCacheGroupSpec(["full.0"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2,
                                                                 head_size=16, dtype=torch.float32))]  # fmt: skip
        for i, w in enumerate(self.windows):
            groups.append(KVCacheGroupSpec([f"swa.{i}"], SlidingWindowSpec(
                block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=w)))
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)  # no worker here


def make_scheduler(scheduler_cls: type, num_blocks: int, layout: Layout, *, max_num_seqs: int = 32,
                   max_num_batched_tokens: int = 256, max_model_len: int = 2048, events: bool = True,
                   log_stats: bool = True, caching: bool = True, watermark: float = 0.0) -> Any:  # fmt: skip
    """vLLM's ``Scheduler`` (or a subclass) over a ``num_blocks`` pool, as its engine core builds it."""
    from vllm.config import (
        CacheConfig, DeviceConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig,
    )  # fmt: skip
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.structured_output import StructuredOutputManager

    folder = tempfile.mkdtemp(prefix="pagedkv-tinyllama-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    model = ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching, prefix_caching_hash_algo="sha256_cbor")
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, is_encoder_decoder=False, watermark=watermark)  # fmt: skip
    kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None
    config = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched,
                        device_config=DeviceConfig("cpu"), kv_events_config=kv_events)  # fmt: skip
    config.cache_config.num_gpu_blocks = num_blocks
    init_none_hash(sha256_cbor)
    return scheduler_cls(vllm_config=config, kv_cache_config=layout.kv_cache_config(num_blocks),
                         structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
                         log_stats=log_stats)  # fmt: skip


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
    requests: list[tuple[str, list[int], int, int | None]] = field(default_factory=list)  # id, prompt, max, abort

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        systems = [[rng.randrange(1, 1000) for _ in range(rng.choice((16, 32, 40, 64)))] for _ in range(self.prefixes)]
        for i in range(self.num_requests):
            head = systems[rng.randrange(self.prefixes)] if rng.random() < 0.7 else []
            prompt = head + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 90))]
            abort_at = rng.randrange(1, 12) if i % self.abort_every == 5 else None
            self.requests.append((f"r{i}", prompt, rng.randrange(1, 60), abort_at))


def sampled(req_id: str, step: int) -> int:
    """The token the fake model samples for a request at a step: the same for both managers."""
    return (sum(map(ord, req_id)) * 31 + step * 17) % 999 + 1


@dataclass
class StepRecord:
    scheduled: dict[str, int]  # request -> tokens scheduled
    new_blocks: dict[str, tuple[tuple[int, ...], ...]]  # new requests: their block ids; running: the new ids
    hits: dict[str, int]  # new (or resumed) requests: num_computed_tokens at scheduling
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    events: list[Any]  # decoded with vLLM's types
    stats: tuple[Any, ...]  # KV cache usage, the step's prefix-cache stats (vLLM's SchedulerStats), a reset's answer


def drive(scheduler: Any, workload: Workload, *, max_steps: int = 5000,
          on_step: Callable[[int], None] | None = None) -> list[StepRecord]:  # fmt: skip
    """Run the workload to its end through ``scheduler``; what each step decided."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    hasher = get_request_block_hasher(BLOCK_SIZE, sha256_cbor)
    recorder = Recorder(msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVEventBatch))
    scheduler.kv_event_publisher = recorder
    pending = list(workload.requests)
    started: dict[str, int] = {}  # request -> the step it was first scheduled at
    abort_at = {rid: a for rid, _, _, a in workload.requests if a is not None}
    records: list[StepRecord] = []
    step = 0
    first_late = len(pending) if workload.idle_after is None else workload.idle_after
    while (pending or scheduler.has_unfinished_requests()) and step < max_steps:
        arriving = pending[: workload.arrivals_per_step]
        if len(workload.requests) - len(pending) >= first_late and scheduler.has_unfinished_requests():
            arriving = []  # the late ones wait for an idle scheduler (a reset between them then clears the cache)
        for rid, prompt, max_tokens, _ in arriving:
            skip = workload.skip_cache_every and int(rid[1:]) % workload.skip_cache_every == 7
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, skip_reading_prefix_cache=bool(skip) or None)
            scheduler.add_request(Request(rid, prompt, params, pooling_params=None, block_hasher=hasher))
        del pending[: len(arriving)]
        for rid, at in list(abort_at.items()):  # aborts arrive between steps
            if rid in started and step - started[rid] >= at:
                scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                del abort_at[rid]
        out = scheduler.schedule()
        new_blocks: dict[str, tuple[tuple[int, ...], ...]] = {}
        hits: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            new_blocks[new.req_id] = tuple(tuple(g) for g in new.block_ids)
            hits[new.req_id] = new.num_computed_tokens
            started.setdefault(new.req_id, step)
        cached = out.scheduled_cached_reqs
        for rid, ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            new_blocks[rid] = tuple(tuple(g) for g in ids) if ids is not None else ()
            if rid in cached.resumed_req_ids:
                hits[rid] = computed
        req_ids = list(out.num_scheduled_tokens)
        sampled_ids = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            done_prefill = req.num_computed_tokens >= req.num_tokens  # the scheduler advanced it already
            sampled_ids.append([sampled(rid, step)] if done_prefill else [])
        runner = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled_ids)  # fmt: skip
        engine_out = scheduler.update_from_output(out, runner)
        stats: tuple[Any, ...] = ()
        for eco in engine_out.values():
            if eco.scheduler_stats is not None:
                st = eco.scheduler_stats
                p = st.prefix_cache_stats
                stats = (round(st.kv_cache_usage, 12), p.requests, p.queries, p.hits, p.preempted_requests,
                         p.preempted_queries, p.preempted_hits, p.reset)  # fmt: skip
        if workload.reset_every and step % workload.reset_every == workload.reset_every - 1:
            stats += (scheduler.reset_prefix_cache(),)  # refused while blocks are held; else clears the cache
        events = [ev for batch in recorder.batches for ev in batch.events]
        recorder.batches.clear()
        records.append(StepRecord(dict(out.num_scheduled_tokens), new_blocks, hits,
                                  tuple(sorted(out.preempted_req_ids or ())), tuple(sorted(out.finished_req_ids)),
                                  events, stats))  # fmt: skip
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
