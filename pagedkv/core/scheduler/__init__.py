"""The pure scheduler above the cache: continuous batching, chunked prefill, preemption by
recompute, diffusion requests at request level.

``lifecycle`` (a request's stages and the table of their moves), ``records`` (config,
requests, state, plans), ``inputs`` (submit, cancel), ``policy`` (schedule), ``results``
(on_output), ``tokens`` (what each request generated).
"""

from pagedkv.core.scheduler.digest import sched_canonical, sched_digest
from pagedkv.core.scheduler.inputs import cancel, forget_host, submit
from pagedkv.core.scheduler.lifecycle import FinishReason, Move, Stage
from pagedkv.core.scheduler.policy import schedule
from pagedkv.core.scheduler.records import (
    DiffusionRun,
    LiveRequests,
    Prefilled,
    SchedState,
    SchedulerConfig,
    SeqRequest,
    StepPlan,
    new_scheduler,
    query_ids,
)
from pagedkv.core.scheduler.results import on_output, on_tokens

__all__ = [
    "forget_host",
    "DiffusionRun",
    "Move",
    "FinishReason",
    "LiveRequests",
    "Prefilled",
    "SchedState",
    "SchedulerConfig",
    "SeqRequest",
    "Stage",
    "StepPlan",
    "cancel",
    "new_scheduler",
    "on_output",
    "on_tokens",
    "query_ids",
    "sched_canonical",
    "sched_digest",
    "schedule",
    "submit",
]
