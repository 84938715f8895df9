"""Overlapped scheduling (``EngineArgs(async_scheduling=True)``): the engine plans, installs and launches step N+1
before it reads step N's sampled ids, so the host's work for a step runs while the device computes the last one.

Step N+1's decode rows take step N's ids on the device (``gather``), and the scheduler is told of step N's tokens
as ``None`` (``on_output``: they count, the rows grow by placeholders) until the ids are read, one step later,
while step N+1 runs (``resolve``: ``on_tokens``, which also ends the requests that stopped on them). A request
that reaches ``max_tokens`` ends at its output with its last id still on the device: its completion is handed
out when that id is read (``closing``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pagedkv.core.errors import RequestId
from pagedkv.core.scheduler import StepPlan, on_tokens
from pagedkv.shell.transfer import Readback, to_device


class Overlap:
    """An engine's step in flight: its plan (samples still live) and its ids on the device, read one step later."""

    def __init__(self) -> None:
        self.pending: tuple[StepPlan, tuple[RequestId, ...], Readback | None] | None = None
        self.closing: list[RequestId] = []  # ended at their output (max_tokens), their last id not read yet

    def resolve(self, engine: Any, plan: StepPlan, ids: torch.Tensor | None, on_token: Any) -> tuple[dict[RequestId, None], list[RequestId]]:
        """The last step's ids read (this step is queued behind it), taken by their requests and told to the
        scheduler; this step's samples, as ``on_output`` takes them ahead of their ids."""
        prev, self.pending = self.pending, None
        if prev is not None:
            self._take(engine, *prev, on_token)
        live = tuple(rid for rid in plan.samples if rid in engine.state.seqs)  # (one that stopped since: dropped)
        self.pending = (plan, live, None if ids is None else Readback(ids)) if live else None  # (copied behind it)
        return {rid: None for rid in live}, []

    def _take(self, engine: Any, plan: StepPlan, live: tuple[RequestId, ...], ids: Readback | None, on_token: Any) -> None:
        tokens: list[int] = [] if ids is None else ids.tolist()  # (waits for that step's copy, not this step)
        keep = set(live)
        kept = [t for rid, t in zip(plan.samples, tokens) if rid in keep]
        sampled, stop = engine.outcomes.take(replace(plan, samples=live), kept, on_token, engine.requests, engine.stats)
        running = {rid: tok for rid, tok in sampled.items() if rid in engine.state.seqs}
        stops = [rid for rid in stop if rid in engine.state.seqs]
        engine.state, ended = on_tokens(engine.state, running, stops).unwrap()
        after = engine.state  # (the recorder may write later: the state this event led to, bound now)
        engine.outcomes.record(lambda r: r.tokens(running, stops, after, ended))
        engine.worker.remove([rid for rid, _ in ended])
        closing, self.closing = [*self.closing, *(rid for rid, _ in ended)], []
        engine.outcomes.finished(engine.requests, closing)

    def abandon(self, engine: Any, message: str) -> list[RequestId]:
        """A step failed with the last one's ids unread: they are lost. The requests still awaiting one (to be
        ended with ``error`` by the caller) and those that ended awaiting it (ended here, as ``error``)."""
        self.pending = None
        for rid in self.closing:
            comp = engine.requests[rid].completion
            comp.finish_reason, comp.error = "error", message
            engine.outcomes.outbox.append(comp)
        self.closing = []
        return [rid for rid in engine.state.awaiting if rid in engine.state.seqs]

    @staticmethod
    def gather(rows: Any, last: tuple[tuple[RequestId, ...], torch.Tensor], requests: Any, device: torch.device) -> torch.Tensor:
        """A decode batch's input ids: the last step's, taken on the device, for the rows it sampled; the others'
        last ids (known) from the host."""
        where = {rid: i for i, rid in enumerate(last[0])}
        out = to_device([0 if rid in where else requests[rid].completion.token_ids[-1] for rid in rows], torch.int64,
                        device)  # fmt: skip
        dst = [k for k, rid in enumerate(rows) if rid in where]
        src = to_device([where[rows[k]] for k in dst], torch.int64, device)
        out[to_device(dst, torch.int64, device)] = last[1][src]
        return out
