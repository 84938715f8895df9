"""Copies between the host and the device that never wait for the device's queued work.

A plain ``torch.tensor(values, device="cuda")`` or ``.to("cuda")`` from pageable memory synchronises the
stream: the host waits for every kernel queued before it, which undoes overlapped scheduling (the next step's
installs would wait for the step in flight). ``to_device`` copies through pinned memory without waiting (the
caching host allocator keeps the pinned block until the copy has run); ``Readback`` copies a device tensor to
pinned memory behind the work that made it and waits, when read, only for that work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, the host never waiting for it (on the CPU: the tensor itself)."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


class Readback:
    """A device tensor's values on the host, copied when made (queued behind the work that computes them), read
    with ``tolist`` (waiting for that copy only, not for work queued after it)."""

    __slots__ = ("host", "event")

    def __init__(self, t: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.event.record()
        else:
            self.host = t

    def tolist(self) -> list[Any]:
        if self.event is not None:
            self.event.synchronize()
        out: list[Any] = self.host.tolist()
        return out
