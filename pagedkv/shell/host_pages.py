"""The host tier's pages (``EngineArgs(kv_offloading_size=GiB)``): the shell's side of core/host.py. Host tensors
shaped like the device pages (pinned where the pages are on CUDA), and the copies a step's transitions recorded
(``BlockOffloaded``: a device block to a host slot; ``BlockOnloaded``: a slot to a device block), carried out in
the order recorded, before the step's forward: consecutive copies of one direction go as one batched copy a layer
and side (a run cut where a copy writes what the run already writes).

On CUDA the copies run on a stream of their own, and the host never waits for them: a run of stores gathers its
blocks on the device and copies them into pinned staging, scattered into the host slots once its event has passed
(at the next ``apply``, or before a load reads a slot); a run of loads gathers its slots into pinned staging on the
host and copies them in. The copy stream starts behind the work queued before it (a store reads a block a forward
wrote), and the compute stream waits for the copy stream before the forward (it reads the loaded blocks and may
overwrite the stored ones). Elsewhere the copies are plain synchronous ``index_copy_``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagedkv.core.events import BlockOffloaded, BlockOnloaded
from pagedkv.shell.pool import PagePool

Staged = list[tuple[torch.Tensor, torch.Tensor]]  # (host pages, pinned staging of a run) a layer and side


class HostPages:
    """``blocks`` host slots for every layer's K and V pages of ``pool``."""

    def __init__(self, pool: PagePool, blocks: int) -> None:
        self.pool = pool
        cuda = pool.device.type == "cuda"
        shape = (blocks, *pool.k[0].shape[1:]) if pool.k else (blocks,)
        self.k = [torch.zeros(shape, dtype=t.dtype, pin_memory=cuda) for t in pool.k]
        self.v = [torch.zeros(shape, dtype=t.dtype, pin_memory=cuda) for t in pool.v]
        self.stream = torch.cuda.Stream(pool.device) if cuda else None  # the copies' own stream (CUDA)
        self.stores: list[tuple[torch.cuda.Event, torch.Tensor, Staged]] = []  # runs of stores not yet scattered
        self.loads: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []  # runs of loads whose staging is in use
        self.stored = 0  # blocks copied to the host, and back, since start-up
        self.loaded = 0

    def apply(self, events: Iterable[Any]) -> None:
        """The copies among ``events`` (a step's core events, in order)."""
        self.settle()
        run: list[tuple[int, int]] = []  # (from, to) of one direction: device blocks and host slots never alias
        kind: type | None = None
        writes: set[int] = set()
        copied = False
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
            kind, copied = k, True
            run.append(pair)
            writes.add(pair[1])
        if run:
            self._copy(kind, run)
        if copied and self.stream is not None:  # (the forward reads loaded blocks and overwrites stored ones)
            torch.cuda.current_stream(self.pool.device).wait_stream(self.stream)

    def settle(self) -> None:
        """Every store run's bytes in its host slots (each waits for its event); load staging no longer in use let go."""
        for event, dst, staged in self.stores:
            event.synchronize()
            for host, pinned in staged:
                host.index_copy_(0, dst, pinned)
        self.stores = []
        self.loads = [x for x in self.loads if not x[0].query()]

    def _copy(self, kind: type | None, run: list[tuple[int, int]]) -> None:
        src = torch.tensor([a for a, _ in run], dtype=torch.long)
        dst = torch.tensor([b for _, b in run], dtype=torch.long)
        sides = [*zip(self.pool.k, self.k), *zip(self.pool.v, self.v)]
        if kind is BlockOffloaded:  # device pages -> host slots
            self.stored += len(run)
            if self.stream is None:
                for d, h in sides:
                    h.index_copy_(0, dst, d.index_select(0, src.to(d.device)).to("cpu"))
                return
            staged: Staged = []
            with torch.cuda.stream(self.stream):
                self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))  # (not the copy stream's)
                at = src.to(self.pool.device, non_blocking=True)
                for d, h in sides:
                    pinned = torch.empty((len(run), *d.shape[1:]), dtype=d.dtype, pin_memory=True)
                    pinned.copy_(d.index_select(0, at), non_blocking=True)
                    staged.append((h, pinned))
                event = torch.cuda.Event()
                event.record(self.stream)
            self.stores.append((event, dst, staged))
            return
        self.loaded += len(run)  # host slots -> device pages
        if self.stream is None:
            for d, h in sides:
                d.index_copy_(0, dst.to(d.device), h.index_select(0, src).to(d.device))
            return
        self.settle()  # (a slot a store of this step wrote: its bytes in place first)
        held: list[torch.Tensor] = []
        main = torch.cuda.current_stream(self.pool.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(main)  # (a forward queued before may still read the blocks loaded into)
            at = dst.to(self.pool.device, non_blocking=True)
            for d, h in sides:
                pinned = torch.empty((len(run), *h.shape[1:]), dtype=h.dtype, pin_memory=True)
                torch.index_select(h, 0, src, out=pinned)
                d.index_copy_(0, at, pinned.to(self.pool.device, non_blocking=True))
                held.append(pinned)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.loads.append((event, held))
