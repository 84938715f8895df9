"""Moved to ``pagedkv.core.verify`` (``trace``: replay; ``trace_ops``: each op; ``record``:
writing a run); this module keeps the import path engines and tools used."""

from pagedkv.core.verify.record import output_event, scheduler_header, submit_event
from pagedkv.core.verify.trace import (
    SCHEDULER_KEYS, TRACE_VERSION, EventResult, TraceHeaderError, first_mismatch, parse_trace_header, replay, run_line,
)  # fmt: skip
from pagedkv.core.verify.trace_ops import OPS, SCHEDULER_OPS, plan_json

__all__ = [
    "OPS", "SCHEDULER_KEYS", "SCHEDULER_OPS", "TRACE_VERSION", "EventResult", "TraceHeaderError", "first_mismatch",
    "output_event", "parse_trace_header", "plan_json", "replay", "run_line", "scheduler_header", "submit_event",
]  # fmt: skip
