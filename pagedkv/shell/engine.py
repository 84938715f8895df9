"""The engine: the imperative loop a serving engine runs around pagedkv.

schedule (pure) -> install each snapshot (worker) -> forward -> sample -> on_output (pure),
releasing finished and preempted requests' rows in the worker. Continuous batching, chunked
prefill, prefix caching and preemption by recompute come from the scheduler.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from pagedkv.core import CacheConfig
from pagedkv.core.errors import RequestId
from pagedkv.core.scheduler import SchedulerConfig, SeqRequest, cancel, new_scheduler, on_output, schedule, submit
from pagedkv.core.verify.record import output_event, scheduler_header, submit_event
from pagedkv.shell.attention import get_backend
from pagedkv.shell.pool import PagePool, size_pool
from pagedkv.shell.worker import Worker


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None  # per request: the same seed, the same tokens
    stop: tuple[str, ...] = ()


@dataclass(slots=True)
class Completion:
    request_id: RequestId
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated (a stop token included, as HF does)
    text: str = ""
    finish_reason: str | None = None  # stop | length | cancelled | error | UNSCHEDULABLE ...
    cached_tokens: int = 0


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0


class Engine:
    """One rank's engine over a model with ``forward(tokens, batch, pool, backend, group)``."""

    def __init__(self, model: Any, tokenizer: Any, *, block_size: int = 16, kv_cache_memory_bytes: int = 256 << 20,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 backend: str = "torch", trace: TextIO | None = None) -> None:  # fmt: skip
        c = model.config
        self.model, self.tokenizer = model, tokenizer
        sizing = size_pool(num_layers=c.num_layers, block_size=block_size, kv_heads=c.num_kv_heads,
                           head_dim=c.head_dim, dtype=model.dtype, device=model.device,
                           kv_cache_memory_bytes=kv_cache_memory_bytes)  # fmt: skip
        self.sizing = sizing
        self.cache = CacheConfig(block_size=block_size, num_blocks=sizing.num_blocks,
                                 enable_prefix_caching=enable_prefix_caching, max_model_len=c.max_position)  # fmt: skip
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        self.state = new_scheduler(self.cache, sched)
        self.pool = PagePool(self.cache, num_layers=c.num_layers, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                             dtype=model.dtype, device=model.device)  # fmt: skip
        max_blocks = -(-c.max_position // block_size)
        self.worker = Worker(self.cache, max_rows=max_num_seqs, max_blocks_per_row=max_blocks,
                             max_tokens=max_num_batched_tokens, device=model.device)  # fmt: skip
        self.backend = get_backend(backend)
        self.requests: dict[RequestId, tuple[Completion, SamplingParams, torch.Generator]] = {}
        self.stats = EngineStats()
        self._prefilled: set[RequestId] = set()  # requests whose first prefill ran (cached_tokens is known)
        self.trace = trace
        self.kv_history: list[Any] | None = None  # set to [] to keep the core's snapshot after every step
        self.step_hook: list[tuple[int, int, float]] | None = None  # (decode rows, prefill tokens, seconds) a step
        if trace is not None:
            trace.write(json.dumps(scheduler_header(self.cache, sched)) + "\n")

    # -- step-level API ----------------------------------------------------------
    def add_request(self, rid: RequestId, prompt: str, prompt_ids: list[int], params: SamplingParams) -> None:
        req = SeqRequest(rid, tuple(prompt_ids), max_tokens=params.max_tokens)
        self.state = submit(self.state, req).unwrap()
        g = torch.Generator().manual_seed(params.seed if params.seed is not None else hash(str(rid)) & 0xFFFFFFFF)
        self.requests[rid] = (Completion(rid, prompt, list(prompt_ids)), params, g)
        self.stats.prompt_tokens += len(prompt_ids)
        if self.trace is not None:
            self.trace.write(json.dumps(submit_event(req)) + "\n")

    def cancel(self, rid: RequestId) -> None:
        self.state = cancel(self.state, rid).unwrap()
        self.worker.remove([rid])
        comp = self.requests[rid][0]
        comp.finish_reason = "cancelled"
        if self.trace is not None:
            self.trace.write(json.dumps({"op": "cancel", "request": rid}) + "\n")

    def has_unfinished(self) -> bool:
        return bool(self.state.requests)

    def step(self, on_token: Callable[[RequestId, int], None] | None = None) -> list[Completion]:
        """One engine step; the completions that finished in it."""
        t0 = time.perf_counter()
        self.state, plan = schedule(self.state).unwrap()
        if self.trace is not None:
            self.trace.write('{"op": "schedule"}\n')
        self.stats.steps += 1
        self.stats.preemptions += len(plan.preempted)
        if plan.preempted:
            self.worker.remove(list(plan.preempted))
        done = []
        for rid, how in plan.finished:  # refused for good by admission
            comp = self.requests[rid][0]
            comp.finish_reason = how
            done.append(comp)
        logits: dict[RequestId, torch.Tensor] = {}
        for meta in plan.metadata:
            batch = self.worker.install(meta)
            tokens = self._tokens(meta)
            out = self.model.forward(tokens, batch, self.pool, self.backend, self.cache.groups[0])
            for r, row in enumerate(meta.rows):
                logits[row.request_id] = out[r]
        kv = self.state.kv
        self.stats.peak_blocks = max(self.stats.peak_blocks, kv.config.usable_blocks - kv.free_blocks)
        sampled: dict[RequestId, int] = {}
        stop: list[RequestId] = []
        for rid in plan.samples:
            comp, params, g = self.requests[rid]
            tok = sample(logits[rid], params, g)
            sampled[rid] = tok
            comp.token_ids.append(tok)
            self.stats.generated_tokens += 1
            if on_token is not None:
                on_token(rid, tok)
            if tok in self.tokenizer.stop_token_ids:
                comp.finish_reason = "stop"
                stop.append(rid)
            elif params.stop and any(s in self.tokenizer.decode(comp.token_ids) for s in params.stop):
                comp.finish_reason = "stop"
                stop.append(rid)
        for meta in plan.metadata:  # a request's first prefill starts where its prefix-cache hit ended
            for row in meta.rows:
                if meta.phase == "prefill" and row.request_id not in self._prefilled:
                    self._prefilled.add(row.request_id)
                    self.requests[row.request_id][0].cached_tokens = row.kv_start_pos
        self.state, ended = on_output(self.state, sampled, stop).unwrap()
        if self.trace is not None:
            self.trace.write(json.dumps(output_event(sampled, stop)) + "\n")
        if ended:
            self.worker.remove([rid for rid, _ in ended])
        if self.kv_history is not None:
            self.kv_history.append(self.state.kv)
        if self.step_hook is not None:
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
            self.step_hook.append((len(plan.decode), sum(q for _, q in plan.prefill), time.perf_counter() - t0))
        for rid, _ in ended:
            comp, params, _ = self.requests[rid]
            comp.finish_reason = comp.finish_reason or "length"
            comp.text = self._text(comp, params)
            done.append(comp)
        return done

    def _tokens(self, meta: Any) -> torch.Tensor:
        ids: list[int] = []
        seqs, log = self.state.seqs, self.state.log
        for row in meta.rows:  # what the row's query positions hold: its prompt, then what it generated
            prompt = seqs[row.request_id].prompt
            start, end, p = row.kv_start_pos, row.seq_len, len(prompt)
            ids.extend(prompt[start:end])
            if end > p:
                ids.extend(log.ids(row.request_id, max(start - p, 0), end - p))
        return torch.tensor(ids)

    def _text(self, comp: Completion, params: SamplingParams) -> str:
        text = self.tokenizer.decode(comp.token_ids)
        for s in params.stop:
            if s in text:
                text = text[: text.index(s)]
        return text

    # -- the whole-request API -------------------------------------------------------
    def generate(self, prompts: Iterable[tuple[str, list[int], SamplingParams]],
                 on_finish: Callable[[Completion], None] | None = None) -> list[Completion]:  # fmt: skip
        order = []
        for text, ids, params in prompts:
            rid = f"req-{len(self.requests)}"
            self.add_request(rid, text, ids, params)
            order.append(rid)
        while self.has_unfinished():
            for comp in self.step():
                if on_finish is not None:
                    on_finish(comp)
        return [self.requests[rid][0] for rid in order]


def freeze_startup() -> None:
    """What a serving process should do once its model, pools and engine exist: collect, then move
    everything alive into CPython's permanent generation (``gc.freeze``, as vLLM's engine core
    does), so full collections never walk the weights' and the start-up state's objects again.
    The core does not need it (its step leaves little for the GC to walk, with the GC on at
    default thresholds: bench/peers.py); it is the process's policy, so the app calls it, never
    the library on its own."""
    gc.collect()
    gc.freeze()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Greedy at temperature 0; else temperature, top-k, top-p, drawn with the request's generator."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_k > 0:
        kth = torch.topk(probs, min(params.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p * sorted_p.sum()
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[idx[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
