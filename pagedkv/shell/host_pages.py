"""The host tier's pages (``EngineArgs(kv_offloading_size=GiB)``): the shell's side of core/store/host.py. One host
tensor a side, every layer's slots in it (``(layers, slots, *page)``, pinned where the pages are on CUDA, shaped
like the pool's ``k_all`` and ``v_all``: a copy of some blocks in every layer is one index operation), and the
copies a step's transitions recorded (``BlockOffloaded``: a device block to a host slot; ``BlockOnloaded``: a slot
to a device block), carried out before the step's forward as few batched copies as their order allows: the stores
of a batch first, then its loads. That keeps the recorded order's meaning (a store reads its block before a load
overwrites it; a load reads a slot after the store that wrote it) as long as no store writes a slot, or reads a
block, that a load before it in the batch read or wrote, and no two copies write one place: a copy that would
break this closes the batch (the core makes such orders rare: a transition's loads pin their slots, and a loaded
block is its row's alone).

On CUDA the copies run on streams of their own and the host does not wait for them. A batch's stores, on the store
stream, gather their blocks into device staging (the blocks read: an event), then copy that into pinned staging,
scattered into the host slots once the copy has landed (checked at each ``apply``; waited for only where a load
reads a slot still on its way). A store only has to read its block before the block is overwritten, so the forward
waits for the gather, on the device and at device speed, never for the copy over the bus, which runs beside it.
A batch's loads, on the load stream, gather their slots into pinned staging on the host and copy them in; the
forward waits for them (it reads the loaded blocks). Both streams start behind the work queued before them (a
store reads what a forward wrote; a load may overwrite a block a forward read), and a load behind the gathers of
the stores before it. Back-pressure: while the stores on their way hold more device staging than
``max_in_flight_bytes``, a new store is shed (never waited for) unless this step loads its slot: its slot joins
``unwritten`` and the engine has the core forget its entry, a lost future hit and never a wrong token (``shed``
counts them). Elsewhere the copies are plain synchronous index copies.

A store that fails fails its step (the engine's fault rule) and leaves its slots in ``unwritten``: the engine has
the core forget their entries (``forget_host``) once the step's requests have ended, so no hit loads them; until
then a load that would read one fails its own step (``ShellError``): nothing unwritten is ever read."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagedkv.core.config import InvalidConfig
from pagedkv.core.errors import ErrorCode, InvariantError
from pagedkv.core.outputs.events import BlockOffloaded, BlockOnloaded
from pagedkv.shell.errors import refuse
from pagedkv.shell.pool import PagePool


class HostPages:
    """``blocks`` host slots for every layer's K and V pages of ``pool``."""

    def __init__(self, pool: PagePool, blocks: int, max_in_flight_bytes: int = 1 << 30) -> None:
        if pool.k_all is None or pool.v_all is None:
            raise InvalidConfig("the host tier keeps attention pages alone (a pool without Mamba states)")
        self.pool = pool
        cuda = pool.device.type == "cuda"
        self.sides = [(dev, torch.zeros((dev.shape[0], blocks, *dev.shape[2:]), dtype=dev.dtype, pin_memory=cuda))
                      for dev in (pool.k_all, pool.v_all)]  # fmt: skip
        self.stream = torch.cuda.Stream(pool.device) if cuda else None  # type: ignore[no-untyped-call] # the loads' (CUDA)
        self.store_stream = torch.cuda.Stream(pool.device) if cuda else None  # type: ignore[no-untyped-call]
        self.read: torch.cuda.Event | None = None  # the last store batch's gather: its blocks read
        self.max_in_flight_bytes = max_in_flight_bytes
        # store batches on their way to the host: (landed event, slots, pinned staging a side, device staging a
        # side), oldest first
        self.pending: list[tuple[torch.cuda.Event, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
        self.shed = 0  # stores shed under back-pressure
        self.in_flight: set[int] = set()  # the slots they write
        self.unwritten: set[int] = set()  # slots whose store failed (a later store to them writes them again)
        self.staging: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []  # load staging the copy stream reads
        self.loading: set[int] = set()  # the slots the events being applied load
        self.stored = 0  # blocks copied to the host, and back, since start-up
        self.loaded = 0

    def apply(self, events: Iterable[Any]) -> None:
        """The copies among ``events`` (a step's core events, in order)."""
        self.settle(wait=False)
        events = list(events)
        self.loading = {e.host_slot for e in events if isinstance(e, BlockOnloaded)}  # (never shed: read this step)
        stores: list[tuple[int, int]] = []  # (device block, slot)
        loads: list[tuple[int, int]] = []  # (slot, device block)
        slots_written: set[int] = set()
        loaded_slots: set[int] = set()
        loaded_blocks: set[int] = set()
        for e in events:
            if isinstance(e, BlockOffloaded):
                block, slot = e.block_id, e.host_slot
                if slot in slots_written or slot in loaded_slots or block in loaded_blocks:
                    self._batch(stores, loads)
                    stores, loads, slots_written, loaded_slots, loaded_blocks = [], [], set(), set(), set()
                stores.append((block, slot))
                slots_written.add(slot)
            elif isinstance(e, BlockOnloaded):
                slot, block = e.host_slot, e.block_id
                if block in loaded_blocks:
                    self._batch(stores, loads)
                    stores, loads, slots_written, loaded_slots, loaded_blocks = [], [], set(), set(), set()
                loads.append((slot, block))
                loaded_slots.add(slot)
                loaded_blocks.add(block)
        self._batch(stores, loads)

    def settle(self, wait: bool = True) -> None:
        """Store batches whose copies have landed scattered into their slots, in order (``wait``: every one, each
        waited for); load staging no longer read let go."""
        while self.pending:
            event, slots, staged, _ = self.pending[0]
            if not wait and not event.query():  # type: ignore[no-untyped-call]
                break
            event.synchronize()
            for (_, host), pinned in zip(self.sides, staged):
                host.index_copy_(1, slots, pinned)
            self.pending.pop(0)
        self.in_flight = {int(s) for _, slots, _, _ in self.pending for s in slots}
        self.staging = [x for x in self.staging if not x[0].query()]  # type: ignore[no-untyped-call]

    def _batch(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        if stores and self.store_stream is not None and self._in_flight_bytes() > self.max_in_flight_bytes:
            shed = [(b, s) for b, s in stores if s not in self.loading]  # (back-pressure: a lost hit, never a wait)
            stores = [(b, s) for b, s in stores if s in self.loading]
            self.unwritten.update(s for _, s in shed)
            self.shed += len(shed)
        if stores:
            slots = [s for _, s in stores]
            try:
                self._store([b for b, _ in stores], slots)
            except BaseException:
                self.unwritten.update(slots)  # (their entries stay in the core's tier: never read from here on)
                raise
            self.unwritten.difference_update(slots)
        if loads:
            slots = [s for s, _ in loads]
            bad = self.unwritten.intersection(slots)
            if bad:
                raise refuse(
                    ErrorCode.INVALID,
                    f"host slots {sorted(bad)} were never written (their store failed): the loads that read them "
                    "fail their step's requests",
                )
            self._load(slots, [b for _, b in loads])
        if self.stream is not None:  # (the forward overwrites stored blocks once read, reads loaded ones once in)
            compute = torch.cuda.current_stream(self.pool.device)
            if stores and self.read is not None:
                compute.wait_event(self.read)
            if loads:
                compute.wait_stream(self.stream)

    def _in_flight_bytes(self) -> int:
        """The device staging the stores on their way hold."""
        return sum(t.numel() * t.element_size() for *_, gathered in self.pending for t in gathered)

    def _store(self, blocks: list[int], slots: list[int]) -> None:
        self.stored += len(blocks)
        dst = torch.tensor(slots, dtype=torch.long)
        if self.stream is None:
            for dev, host in self.sides:
                at = torch.tensor(blocks, dtype=torch.long, device=dev.device)
                host.index_copy_(1, dst, dev.index_select(1, at).to("cpu"))
            return
        stream = self.store_stream
        if stream is None:
            raise InvariantError("a CUDA tier has its store stream")
        staged = []
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream(self.pool.device))  # (the compute stream's work)
            at = torch.tensor(blocks, dtype=torch.long).to(self.pool.device, non_blocking=True)
            gathered = [dev.index_select(1, at) for dev, _ in self.sides]  # (the blocks read, at device speed)
            read = torch.cuda.Event()  # type: ignore[no-untyped-call]
            read.record(stream)
            for on_device, (dev, host) in zip(gathered, self.sides):
                pinned = torch.empty((dev.shape[0], len(blocks), *host.shape[2:]), dtype=host.dtype, pin_memory=True)
                pinned.copy_(on_device, non_blocking=True)  # (over the bus, beside the forward)
                staged.append(pinned)
            landed = torch.cuda.Event()  # type: ignore[no-untyped-call]
            landed.record(stream)
        self.read = read
        self.pending.append((landed, dst, staged, gathered))  # (the device staging kept until the copy has landed)
        self.in_flight.update(slots)

    def _load(self, slots: list[int], blocks: list[int]) -> None:
        self.loaded += len(blocks)
        src = torch.tensor(slots, dtype=torch.long)
        if self.stream is None:
            for dev, host in self.sides:
                dev.index_copy_(
                    1,
                    torch.tensor(blocks, dtype=torch.long, device=dev.device),
                    host.index_select(1, src).to(dev.device),
                )
            return
        if self.in_flight.intersection(slots):  # (a slot a store batch is still bringing to the host)
            self.settle()
        held = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))  # (forwards may read these blocks)
            if self.read is not None:  # (a store before it reads its block before any load overwrites it)
                self.stream.wait_event(self.read)
            at = torch.tensor(blocks, dtype=torch.long).to(self.pool.device, non_blocking=True)
            for dev, host in self.sides:
                pinned = torch.empty((dev.shape[0], len(slots), *host.shape[2:]), dtype=host.dtype, pin_memory=True)
                torch.index_select(host, 1, src, out=pinned)
                dev.index_copy_(1, at, pinned.to(self.pool.device, non_blocking=True))
                held.append(pinned)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        self.staging.append((event, held))
