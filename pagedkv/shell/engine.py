"""The engine: the imperative loop a serving engine runs around pagedkv.

schedule (pure) -> install each snapshot (worker) -> forward -> sample -> on_output (pure),
releasing finished and preempted requests' rows in the worker. Continuous batching, chunked
prefill, prefix caching and preemption by recompute come from the scheduler.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import torch
from returns.result import Failure

from pagedkv.core.config import InvalidConfig
from pagedkv.core.errors import RequestId
from pagedkv.core.metadata import KVMetadata, Phase
from pagedkv.core.scheduler import SchedulerConfig, SeqRequest, StepPlan, cancel, new_scheduler, on_output, schedule, submit
from pagedkv.shell.attention import AttentionBackend, get_backend
from pagedkv.shell.errors import ShellError
from pagedkv.shell.rank import Rank, rank_for
from pagedkv.shell.recorder import Recorder
from pagedkv.shell.sampling import SamplingParams, cut_at_stop, generator_for, sample

__all__ = ["Completion", "Engine", "EngineArgs", "EngineStats", "SamplingParams", "freeze_startup", "sample"]


@dataclass(slots=True)
class Completion:
    request_id: RequestId
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated (a stop token included, as HF does)
    text: str = ""
    finish_reason: str | None = None  # stop | length | cancelled | error | UNSCHEDULABLE ...
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """An engine's sizes and switches, in one place (a launcher of several ranks reads them too)."""

    block_size: int = 16
    kv_cache_memory_bytes: int = 256 << 20  # per rank
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    backend: str = "torch"

    def rank_for(self, model: Any, backend: AttentionBackend | None = None) -> Rank:
        """The KV side these arguments give ``model`` (``shell.rank.rank_for``)."""
        return rank_for(model, max_model_len=model.config.max_position, block_size=self.block_size,
                        kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                        enable_prefix_caching=self.enable_prefix_caching, max_rows=self.max_num_seqs,
                        max_tokens=self.max_num_batched_tokens, backend=backend)  # fmt: skip


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0


class Engine:
    """One rank's engine over a model with ``forward(tokens, batch, pool, backend, group)``.

    ``args`` (``EngineArgs``, any field also as a keyword) size it. Its KV side is ``rank``
    (``shell.rank``; its buffers must hold the batches ``args`` allow), or the one ``args`` give the
    model. ``keep_history``: keep the core's snapshot after every step (``kv_history``);
    ``time_steps``: (decode rows, prefill tokens, seconds) of every step in ``step_times``, the
    device synchronised first.
    """

    def __init__(self, model: Any, tokenizer: Any, args: EngineArgs | None = None, *, trace: TextIO | None = None,
                 rank: Rank | None = None, keep_history: bool = False, time_steps: bool = False,
                 **fields: Any) -> None:  # fmt: skip
        args = replace(args or EngineArgs(), **fields)
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.backend = get_backend(args.backend)
        if rank is None:
            rank = args.rank_for(model, self.backend)
        elif (rank.worker.max_rows, rank.worker.max_tokens) < (args.max_num_seqs, args.max_num_batched_tokens):
            raise InvalidConfig(f"the rank's buffers hold {rank.worker.max_rows} rows and {rank.worker.max_tokens} "
                                f"tokens; the scheduler may batch {args.max_num_seqs} and "
                                f"{args.max_num_batched_tokens}")  # fmt: skip
        self.rank, self.cache, self.pool, self.worker, self.group = rank, rank.cache, rank.pool, rank.worker, rank.group
        self.sizing = rank.sizing
        sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
        self.state = new_scheduler(self.cache, sched)
        self.requests: dict[RequestId, tuple[Completion, SamplingParams, torch.Generator]] = {}
        self.stats = EngineStats()
        self._prefilled: set[RequestId] = set()  # requests whose first prefill ran (cached_tokens is known)
        self.recorder = None if trace is None else Recorder(trace, self.cache, sched)
        self.kv_history: list[Any] | None = [] if keep_history else None
        self.step_times: list[tuple[int, int, float]] | None = [] if time_steps else None

    # -- step-level API ----------------------------------------------------------
    def add_request(self, rid: RequestId, prompt: str, prompt_ids: list[int], params: SamplingParams) -> None:
        req = SeqRequest(rid, tuple(prompt_ids), max_tokens=params.max_tokens)
        submitted = submit(self.state, req)
        if isinstance(submitted, Failure):  # a bad request: typed, and the engine as it was
            raise ShellError(submitted.failure())
        self.state = submitted.unwrap()
        self.requests[rid] = (Completion(rid, prompt, list(prompt_ids)), params, generator_for(rid, params))
        self.stats.prompt_tokens += len(prompt_ids)
        if self.recorder is not None:
            self.recorder.submit(req)

    def cancel(self, rid: RequestId) -> None:
        cancelled = cancel(self.state, rid)
        if isinstance(cancelled, Failure):  # an unknown or ended request
            raise ShellError(cancelled.failure())
        self.state = cancelled.unwrap()
        self.worker.remove([rid])
        self.requests[rid][0].finish_reason = "cancelled"
        if self.recorder is not None:
            self.recorder.cancel(rid)

    def has_unfinished(self) -> bool:
        return bool(self.state.requests)

    def step(self, on_token: Callable[[RequestId, int], None] | None = None) -> list[Completion]:
        """One engine step; the completions that finished in it."""
        t0 = time.perf_counter()
        self.state, plan = schedule(self.state).unwrap()
        if self.recorder is not None:
            self.recorder.schedule()
        self.stats.steps += 1
        self.stats.preemptions += len(plan.preempted)
        if plan.preempted:
            self.worker.remove(list(plan.preempted))
        done = []
        for rid, how in plan.finished:  # refused for good by admission
            comp = self.requests[rid][0]
            comp.finish_reason = how
            done.append(comp)
        logits = self._forward(plan)
        kv = self.state.kv
        self.stats.peak_blocks = max(self.stats.peak_blocks, kv.config.usable_blocks - kv.free_blocks)
        sampled, stop = self._sample(plan, logits, on_token)
        self.state, ended = on_output(self.state, sampled, stop).unwrap()
        if self.recorder is not None:
            self.recorder.output(sampled, stop)
        if ended:
            self.worker.remove([rid for rid, _ in ended])
        if self.kv_history is not None:
            self.kv_history.append(self.state.kv)
        if self.step_times is not None:
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
            self.step_times.append((len(plan.decode), sum(q for _, q in plan.prefill), time.perf_counter() - t0))
        for rid, _ in ended:
            comp, params, _ = self.requests[rid]
            comp.finish_reason = comp.finish_reason or "length"
            comp.text = cut_at_stop(self.tokenizer.decode(comp.token_ids), params.stop)
            done.append(comp)
        return done

    def _forward(self, plan: StepPlan) -> dict[RequestId, torch.Tensor]:
        """Install each of the plan's snapshots and run it: the logits of every row's last token."""
        logits: dict[RequestId, torch.Tensor] = {}
        for meta in plan.metadata:
            batch = self.worker.install(meta)
            out = self.model.forward(self._tokens(meta), batch, self.pool, self.backend, self.group)
            for r, row in enumerate(meta.rows):
                logits[row.request_id] = out[r]
            for row in meta.rows:  # a request's first prefill starts where its prefix-cache hit ended
                if meta.phase is Phase.PREFILL and row.request_id not in self._prefilled:
                    self._prefilled.add(row.request_id)
                    self.requests[row.request_id][0].cached_tokens = row.kv_start_pos
        return logits

    def _sample(self, plan: StepPlan, logits: dict[RequestId, torch.Tensor],
                on_token: Callable[[RequestId, int], None] | None) -> tuple[dict[RequestId, int], list[RequestId]]:  # fmt: skip
        """A token for every row the plan samples, and the requests that stopped on it."""
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
            if tok in self.tokenizer.stop_token_ids or (
                params.stop and any(s in self.tokenizer.decode(comp.token_ids) for s in params.stop)
            ):
                comp.finish_reason = "stop"
                stop.append(rid)
        return sampled, stop

    def _tokens(self, meta: KVMetadata) -> torch.Tensor:
        ids: list[int] = []
        seqs, log = self.state.seqs, self.state.log
        for row in meta.rows:  # what the row's query positions hold: its prompt, then what it generated
            prompt = seqs[row.request_id].prompt
            start, end, p = row.kv_start_pos, row.seq_len, len(prompt)
            ids.extend(prompt[start:end])
            if end > p:
                ids.extend(log.ids(row.request_id, max(start - p, 0), end - p))
        return torch.tensor(ids)

    # -- the whole-request API -------------------------------------------------------
    def generate(self, prompts: Iterable[tuple[str, list[int], SamplingParams]],
                 on_finish: Callable[[Completion], None] | None = None) -> list[Completion]:  # fmt: skip
        items = [(f"req-{len(self.requests) + k}", text, ids, params) for k, (text, ids, params) in enumerate(prompts)]
        state = self.state
        for rid, _, ids, params in items:  # all of them are taken, or none (the engine as it was)
            submitted = submit(state, SeqRequest(rid, tuple(ids), max_tokens=params.max_tokens))
            if isinstance(submitted, Failure):
                raise ShellError(submitted.failure())
            state = submitted.unwrap()
        for rid, text, ids, params in items:
            self.add_request(rid, text, ids, params)
        order = [rid for rid, *_ in items]
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
