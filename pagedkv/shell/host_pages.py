"""The host tier's pages (``EngineArgs(kv_offloading_size=GiB)``): the shell's side of core/host.py. Host tensors
shaped like the device pages (pinned where the pages are on CUDA), and the copies a step's transitions recorded
(``BlockOffloaded``: a device block to a host slot; ``BlockOnloaded``: a slot to a device block), carried out in
the order recorded, before the step's forward: consecutive copies of one direction go as one batched
``index_copy_`` a layer and side (a run cut where a copy writes what the run already writes)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagedkv.core.events import BlockOffloaded, BlockOnloaded
from pagedkv.shell.pool import PagePool


class HostPages:
    """``blocks`` host slots for every layer's K and V pages of ``pool``."""

    def __init__(self, pool: PagePool, blocks: int) -> None:
        self.pool = pool
        pin = pool.device.type == "cuda"
        shape = (blocks, *pool.k[0].shape[1:]) if pool.k else (blocks,)
        self.k = [torch.zeros(shape, dtype=t.dtype, pin_memory=pin) for t in pool.k]
        self.v = [torch.zeros(shape, dtype=t.dtype, pin_memory=pin) for t in pool.v]
        self.stored = 0  # blocks copied to the host, and back, since start-up
        self.loaded = 0

    def apply(self, events: Iterable[Any]) -> None:
        """The copies among ``events`` (a step's core events, in order)."""
        run: list[tuple[int, int]] = []  # (from, to) of one direction: device blocks and host slots never alias
        kind: type | None = None
        writes: set[int] = set()
        k: type
        for e in events:
            if isinstance(e, BlockOffloaded):
                pair, k = (e.block_id, e.host_slot), BlockOffloaded
            elif isinstance(e, BlockOnloaded):
                pair, k = (e.host_slot, e.block_id), BlockOnloaded
            else:
                continue
            if run and (k is not kind or pair[1] in writes):
                self._copy(kind, run)
                run, writes = [], set()
            kind = k
            run.append(pair)
            writes.add(pair[1])
        if run:
            self._copy(kind, run)

    def _copy(self, kind: type | None, run: list[tuple[int, int]]) -> None:
        src = torch.tensor([a for a, _ in run], dtype=torch.long)
        dst = torch.tensor([b for _, b in run], dtype=torch.long)
        if kind is BlockOffloaded:  # device pages -> host slots
            for dev, host in ((self.pool.k, self.k), (self.pool.v, self.v)):
                for d, h in zip(dev, host):
                    h.index_copy_(0, dst, d.index_select(0, src.to(d.device)).to("cpu"))
            self.stored += len(run)
        else:  # host slots -> device pages
            for dev, host in ((self.pool.k, self.k), (self.pool.v, self.v)):
                for d, h in zip(dev, host):
                    d.index_copy_(0, dst.to(d.device), h.index_select(0, src).to(d.device, non_blocking=True))
            self.loaded += len(run)
