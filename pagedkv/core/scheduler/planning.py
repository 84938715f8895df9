"""A ``schedule`` call's working copy of the scheduler state (``Planning``): the lists it grows, the core state it
moves through transitions, and the lifecycle moves (an end, a preemption) every part of the policy shares.
It never escapes the call."""

from __future__ import annotations

from typing import Any

from immutables import Map, MapMutation
from pyrsistent import PDeque

from pagedkv.core.outputs.effects import events_of
from pagedkv.core.errors import KVError, RequestId
from pagedkv.core.outputs.events import KVEvent
from pagedkv.core.rules.release import release
from pagedkv.core.scheduler.lifecycle import FinishReason, Move, Stage, advance
from pagedkv.core.scheduler.records import DiffusionRun, SchedState, SeqRequest
from pagedkv.core.scheduler.tokens import TokenLog, TokenLogEdit
from pagedkv.core.store.state import KVState, Step


class Planning:
    """One ``schedule`` call's working copy of the scheduler state; it never escapes the call."""

    __slots__ = (
        "state",
        "kv",
        "budget",
        "running",
        "waiting",
        "stages",
        "seqs",
        "log",
        "log_edit",
        "decode",
        "verify",
        "prefill",
        "diffusion",
        "preempted",
        "ended",
        "refusals",
        "prefilling",
        "events",
        "awaiting",
    )

    def __init__(self, state: SchedState) -> None:
        self.state = state
        self.kv: KVState = state.kv
        self.budget = state.config.max_num_batched_tokens
        self.running = list(state.running)
        self.waiting: PDeque[RequestId] = state.waiting
        self.stages: MapMutation[RequestId, Stage] = state.stages.mutate()
        self.seqs: Map[RequestId, SeqRequest] = state.seqs
        self.log: TokenLog = state.log
        self.log_edit: TokenLogEdit | None = None  # opened only when a request ends here
        self.decode: list[RequestId] = []
        self.verify: list[tuple[RequestId, tuple[int, ...]]] = []  # decodes with drafts (speculative decoding)
        self.prefill: list[tuple[RequestId, int]] = []
        self.diffusion: list[DiffusionRun] = []
        self.preempted: list[RequestId] = []
        self.ended: list[tuple[RequestId, FinishReason]] = []
        self.refusals: list[KVError] = []  # why each request this step ended did end
        stages = state.stages
        self.prefilling = {rid for rid in self.running if stages[rid] is Stage.PREFILLING}  # (one scan a step)
        self.events: list[KVEvent] = []  # the core's KV events of this step, in order
        self.awaiting = state.awaiting  # requests whose last token's id is not known yet

    def output(self, rid: RequestId) -> tuple[int, ...]:
        """What ``rid`` generated so far (before a preemption), as this draft sees it."""
        return (self.log if self.log_edit is None else self.log_edit).tokens(rid)

    def apply(self, step: Step[Any]) -> None:
        """Take a core transition's new state, and keep its events."""
        self.kv = step.state
        evs = events_of(step.effect)
        if evs:
            self.events.extend(evs)

    def move(self, rid: RequestId, move: Move) -> None:
        """A lifecycle transition (the table's), and what leaving the phase map means."""
        phase = advance(self.stages.get(rid), move)
        if phase is None:
            del self.stages[rid]
        else:
            self.stages[rid] = phase

    def end(self, rid: RequestId, move: Move, why: KVError) -> None:
        """``rid`` ends in this step, refused (a permanent refusal, an overrun) with ``why``: out of the state,
        into the plan's ``finished`` with the refusal's code."""
        how = FinishReason(why.code.value)
        self.refusals.append(why)
        self.move(rid, move)
        self.seqs = self.seqs.delete(rid)
        self.log_edit = self.log_edit or self.log.edit()
        self.log_edit.drop(rid)
        self.awaiting = self.awaiting - {rid} if rid in self.awaiting else self.awaiting
        self.ended.append((rid, how))

    def preempt(self, victim: RequestId) -> None:
        self.apply(release(self.kv, victim, "preempted").unwrap())
        self.move(victim, Move.PREEMPT)
        self.running.remove(victim)
        self.waiting = self.waiting.appendleft(victim)
        self.preempted.append(victim)
        if victim in self.decode:
            self.decode.remove(victim)
        self.verify = [v for v in self.verify if v[0] != victim]
        self.prefill = [p for p in self.prefill if p[0] != victim]  # (an older request's chunk planned this step)
