"""Overlapped scheduling (``EngineArgs(async_scheduling=True)``): the engine plans, installs and launches step N+1
before it reads step N's sampled ids, so the host's work for a step runs while the device computes the last one.

Step N+1's decode rows take step N's ids on the device (``gather``), and the scheduler is told of step N's tokens
as ``None`` (``on_output``: they count, the rows grow by placeholders) until the ids are read, one step later,
while step N+1 runs (``land``; the engine tells ``on_tokens``, which also ends the requests that stopped on them).

The step in flight holds the ``Live`` records it sampled for, never their ids: a request that ends while its last
id is on the device (``max_tokens`` at its output, the length the pool or the model allows) has left the engine's
live requests, and its completion is handed out when that id is read; a request cancelled meanwhile takes nothing
more. Its id may be taken by a new request at once: nothing of the old one reaches the new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedkv.core.errors import RequestId
from pagedkv.core.scheduler import StepPlan
from pagedkv.shell.outcomes import Live
from pagedkv.shell.transfer import Readback, to_device


class Overlap:
    """An engine's step in flight: its plan, the requests it sampled for (``Live``, in ``plan.samples``' order) and
    its ids on the device, read one step later. It holds that step only; the engine applies what it reads
    (``Engine._take_read``)."""

    def __init__(self) -> None:
        self.pending: tuple[StepPlan, tuple[Live, ...], Readback, Readback | None] | None = None

    def land(self) -> tuple[StepPlan, tuple[Live, ...], list[int], list[Any] | None] | None:
        """The step in flight read (waits for its copy, not for the step queued behind it): its plan, the requests
        it sampled for, its ids and its logprob rows (where asked); None when no step is in flight."""
        prev, self.pending = self.pending, None
        if prev is None:
            return None
        plan, bound, ids, logprobs = prev
        return plan, bound, ids.tolist(), None if logprobs is None else logprobs.tolist()

    def launch(self, plan: StepPlan, bound: Sequence[Live], ids: torch.Tensor, logprobs: torch.Tensor | None) -> None:
        """This step's ids (and logprob rows) copied to the host behind it, read by the next ``land``."""
        self.pending = (plan, tuple(bound), Readback(ids), None if logprobs is None else Readback(logprobs))

    def holds(self, live: Live) -> bool:
        """Is a token of ``live`` on the device, in the step in flight?"""
        return self.pending is not None and any(x is live for x in self.pending[1])

    def abandon(self) -> list[Live]:
        """A step failed with the last one's ids unread: they are lost. The requests they were sampled for and
        that are not handed out yet (the caller ends them with ``error``)."""
        pending, self.pending = self.pending, None
        return [] if pending is None else [x for x in pending[1] if not x.handed_out]

    @staticmethod
    def gather(
        rows: Any, last: tuple[tuple[RequestId, ...], torch.Tensor], requests: Any, device: torch.device
    ) -> torch.Tensor:
        """A decode batch's input ids: the last step's, taken on the device, for the rows it sampled; the others'
        last ids (known) from the host."""
        where = {rid: i for i, rid in enumerate(last[0])}
        out = to_device(
            [0 if rid in where else requests[rid].completion.token_ids[-1] for rid in rows], torch.int64, device
        )
        dst = [k for k, rid in enumerate(rows) if rid in where]
        src = to_device([where[rows[k]] for k in dst], torch.int64, device)
        out[to_device(dst, torch.int64, device)] = last[1][src]
        return out
