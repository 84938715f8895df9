"""Recording an engine's run as a scheduler trace (contract v1, DESIGN.md): one JSON line per input,
so that ``pagedkv replay`` gives the same plans and digests."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from pagedkv.core import CacheConfig
from pagedkv.core.errors import RequestId
from pagedkv.core.scheduler import SchedulerConfig, SeqRequest
from pagedkv.core.verify.record import output_event, scheduler_header, submit_event


class Recorder:
    """Writes the header at once, then each input the engine gives the scheduler, in order."""

    def __init__(self, out: TextIO, cache: CacheConfig, sched: SchedulerConfig) -> None:
        self.out = out
        self._line(scheduler_header(cache, sched))

    def _line(self, event: dict[str, Any]) -> None:
        self.out.write(json.dumps(event) + "\n")

    def submit(self, req: SeqRequest) -> None:
        self._line(submit_event(req))

    def cancel(self, rid: RequestId) -> None:
        self._line({"op": "cancel", "request": rid})

    def error(self, rid: RequestId) -> None:
        """A request the engine ended with reason ``error`` (a failed step): the scheduler's cancel with that reason."""
        self._line({"op": "error", "request": rid})

    def schedule(self) -> None:
        self.out.write('{"op": "schedule"}\n')

    def output(self, sampled: Mapping[RequestId, int], finished: Iterable[RequestId]) -> None:
        self._line(output_event(sampled, finished))
