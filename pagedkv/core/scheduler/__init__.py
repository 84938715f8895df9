"""The pure scheduler above the cache: continuous batching, chunked prefill, preemption by
recompute, diffusion requests at request level.

``lifecycle`` (a request's stages and the table of their moves), ``records`` (config,
requests, state, plans), ``inputs`` (submit, cancel), ``policy`` (schedule), ``results``
(on_output), ``tokens`` (what each request generated).
"""

from pagedkv.core.scheduler.digest import sched_canonical, sched_digest
from pagedkv.core.scheduler.inputs import cancel, submit
from pagedkv.core.scheduler.lifecycle import Event, FinishReason, Stage
from pagedkv.core.scheduler.policy import schedule
from pagedkv.core.scheduler.records import (
    DiffusionRun, Kind, Prefilled, Requests, SchedState, SchedulerConfig, Scheduled, SeqRequest, StepPlan,
    new_scheduler,
)  # fmt: skip
from pagedkv.core.scheduler.results import on_output

__all__ = [
    "DiffusionRun", "Event", "FinishReason", "Kind", "Stage", "Prefilled", "Requests", "SchedState", "SchedulerConfig",
    "Scheduled", "SeqRequest", "StepPlan", "cancel", "new_scheduler", "on_output", "sched_canonical", "sched_digest",
    "schedule", "submit",
]  # fmt: skip
