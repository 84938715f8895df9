"""Recording an engine's run as a scheduler trace (contract v1, docs/trace.md): one JSON line per input,
each with an ``expect`` of what the core gave the engine (the digest of the scheduler's state after it,
the generation, the free blocks, a schedule's plan, an output's endings), so that ``pagedkv replay``
checks the run digest for digest and reports where a replay departs from it. ``end`` writes the last line, the
number of events before it: a trace without it (or with lines lost or added) replays as cut short."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

from pagedkv.core import CacheConfig
from pagedkv.core.errors import RequestId
from pagedkv.core.scheduler import SchedState, SchedulerConfig, SeqRequest, StepPlan, sched_digest
from pagedkv.core.verify.record import end_event, output_event, scheduler_header, submit_event
from pagedkv.core.verify.trace_ops import plan_json


class Recorder:
    """Writes the header at once, then each input the engine gives the scheduler, in order, with the state
    it led to (``expect``; the digest reads the whole pool, O(blocks) an event, paid only while recording)."""

    def __init__(self, out: TextIO, cache: CacheConfig, sched: SchedulerConfig, *, expect: bool = True) -> None:
        self.out, self.expect = out, expect
        self.out.write(json.dumps(scheduler_header(cache, sched)) + "\n")
        self.events = 0  # event lines written

    def _line(self, event: dict[str, Any], after: SchedState | None = None, **fields: Any) -> None:
        if after is not None and self.expect:
            kv = after.kv
            event["expect"] = {
                "ok": True,
                "generation": kv.generation,
                "free_blocks": kv.free_blocks,
                "digest": sched_digest(after),
                **fields,
            }
        self.out.write(json.dumps(event) + "\n")
        self.events += 1

    def end(self) -> None:
        """The trace's end record; nothing may be written after it."""
        self.out.write(json.dumps(end_event(self.events)) + "\n")
        self.out.flush()

    def submit(
        self, req: SeqRequest, after: SchedState | None = None, constraint: dict[str, Any] | None = None
    ) -> None:
        """A submitted request; ``constraint``: its structured outputs' constraint (written only when set: the
        scheduler replays without it, for the tokens it kept to are in the trace)."""
        ev = submit_event(req)
        if constraint is not None:
            ev["structured_outputs"] = constraint
        self._line(ev, after)

    def cancel(self, rid: RequestId, after: SchedState | None = None) -> None:
        self._line({"op": "cancel", "request": rid}, after)

    def forget_host(self, slots: list[int], after: SchedState | None = None) -> None:
        """Host-tier entries the engine could not write (a store that failed), dropped by the core."""
        self._line({"op": "forget_host", "slots": slots}, after, forgotten=len(after.kv_events) if after else 0)

    def error(self, rid: RequestId, after: SchedState | None = None) -> None:
        """A request the engine ended with reason ``error`` (a failed step): the scheduler's cancel with that reason."""
        self._line({"op": "error", "request": rid}, after)

    def schedule(
        self,
        after: SchedState | None = None,
        plan: StepPlan | None = None,
        drafts: Mapping[RequestId, Sequence[int]] | None = None,
    ) -> None:
        event: dict[str, Any] = {"op": "schedule"}
        if drafts:  # (written only when there are any: a run without drafts records as before)
            event["drafts"] = [[rid, list(ids)] for rid, ids in drafts.items()]
        self._line(event, after, **({"plan": plan_json(plan)} if plan is not None else {}))

    def tokens(
        self,
        sampled: Mapping[RequestId, int],
        finished: Iterable[RequestId],
        after: SchedState | None = None,
        ended: Iterable[tuple[RequestId, str]] = (),
    ) -> None:
        """The ids of an earlier output's ``None`` tokens (overlapped scheduling: ``on_tokens``)."""
        event = {**output_event(sampled, finished), "op": "tokens"}
        self._line(event, after, **({} if after is None else {"finished": [[r, str(h)] for r, h in ended]}))

    def output(
        self,
        sampled: Mapping[RequestId, int | Sequence[int] | None],
        finished: Iterable[RequestId],
        after: SchedState | None = None,
        ended: Iterable[tuple[RequestId, str]] = (),
    ) -> None:
        self._line(
            output_event(sampled, finished),
            after,
            **({} if after is None else {"finished": [[r, str(h)] for r, h in ended]}),
        )
