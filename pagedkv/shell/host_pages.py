"""The host tier's pages (``EngineArgs(kv_offloading_size=GiB)``): the shell's side of core/store/host.py. One host
tensor a side, every layer's slots in it (``(slots, layers, *page)``: a slot's bytes contiguous, pinned where the
pages are on CUDA), and the copies a step's transitions recorded (``BlockOffloaded``: a device block to a host slot;
``BlockOnloaded``: a slot to a device block), carried out before the step's forward as few batched copies as their
order allows: the stores of a batch first, then its loads. That keeps the recorded order's meaning (a store reads
its block before a load overwrites it; a load reads a slot after the store that wrote it) as long as no store writes
a slot, or reads a block, that a load before it in the batch read or wrote, and no two copies write one place: a copy
that would break this closes the batch (the core makes such orders rare: a transition's loads pin their slots, and a
loaded block is its row's alone).

On CUDA the copies run on streams of their own and the host waits for none of them. A batch's stores, on the store
stream, gather their blocks into device staging (the blocks read: an event); a copy stream then copies each run of
consecutive slots straight into the pinned host tensor. A store only has to read its block before the block is
overwritten, so the forward waits for the gather, on the device and at device speed, never for the copy over the
bus, which runs beside it (and the next gathers, on their own stream, never queue behind it); the host issues those
copies (a call a run of slots) only once the step's forward is launched (``send``, the engine's call after its
launch): before it, a step's stores cost the host one gather a side. A batch's loads, on the load stream, copy their
slots' runs into device staging and scatter them into the pages; the forward waits for them (it reads the loaded
blocks). Both streams start behind the work queued before them (a store reads what a forward wrote; a load may
overwrite a block a forward read); a load starts behind the gathers of the stores before it and behind the copies of
those still bringing its slots (issued first); a store behind the loads before it (a slot a load still reads is not
written over). Back-pressure: the device staging of the stores on their way never passes ``max_in_flight_bytes``: a
batch's stores go in order while their blocks fit what is left of it, and the rest are shed (never waited for),
except a store whose slot this step loads (it always goes): a shed store's slot joins ``unwritten`` and the engine
has the core forget its entry, a lost future hit and never a wrong token (``shed`` counts them). Elsewhere the
copies are plain synchronous index copies.

A store that fails fails its step (the engine's fault rule) and leaves its slots in ``unwritten``: the engine has
the core forget their entries (``forget_host``) once the step's requests have ended, so no hit loads them; until
then a load that would read one fails its own step (``ShellError``): nothing unwritten is ever read."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagedkv.core.errors import ErrorCode
from pagedkv.core.outputs.events import BlockOffloaded, BlockOnloaded
from pagedkv.shell.errors import refuse
from pagedkv.shell.pool import PagePool
from pagedkv.shell.transfer import to_device


class HostPages:
    """``blocks`` host slots for every layer's pages of ``pool`` (``pool.whole``: K and V; a hybrid pool's pages, a
    block's K and V or a Mamba layer's state): one host tensor a side, ``(slots, layers,
    *page)`` (a slot's bytes contiguous: one copy a run of consecutive slots, straight into pinned memory)."""

    def __init__(self, pool: PagePool, blocks: int, max_in_flight_bytes: int = 1 << 30) -> None:
        self.pool = pool
        cuda = pool.device.type == "cuda"
        self.sides = [(dev, torch.zeros((blocks, dev.shape[0], *dev.shape[2:]), dtype=dev.dtype, pin_memory=cuda))
                      for dev in pool.whole]  # fmt: skip
        self.stream = torch.cuda.Stream(pool.device) if cuda else None  # type: ignore[no-untyped-call] # the loads' (CUDA)
        self.store_stream = torch.cuda.Stream(pool.device) if cuda else None  # type: ignore[no-untyped-call]
        self.copy_stream = torch.cuda.Stream(pool.device) if cuda else None  # type: ignore[no-untyped-call] # to host
        self.read: torch.cuda.Event | None = None  # the last store batch's gather: its blocks read
        self.max_in_flight_bytes = max_in_flight_bytes
        self.block_bytes = sum(dev[:, 0].numel() * dev.element_size() for dev, _ in self.sides)  # a store's staging
        # store batches on their way to the host: (landed event, slots, device staging a side), oldest first
        self.pending: list[tuple[torch.cuda.Event, list[int], list[torch.Tensor]]] = []
        # store batches gathered whose copies to the host are not issued yet (``send``): (slots, staging, gathered
        # event), in order
        self.unsent: list[tuple[list[int], list[torch.Tensor], torch.cuda.Event]] = []
        self.shed = 0  # stores shed under back-pressure
        self.unwritten: set[int] = set()  # slots whose store failed (a later store to them writes them again)
        self.staging: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []  # load staging the load stream writes
        self.stored = 0  # blocks copied to the host, and back, since start-up
        self.loaded = 0

    def apply(self, events: Iterable[Any]) -> None:
        """The copies among ``events`` (a step's core events, in order)."""
        self.settle(wait=False)
        events = list(events)
        loading = {e.host_slot for e in events if isinstance(e, BlockOnloaded)}  # (never shed: read this step)
        stores: list[tuple[int, int]] = []  # (device block, slot)
        loads: list[tuple[int, int]] = []  # (slot, device block)
        slots_written: set[int] = set()
        loaded_slots: set[int] = set()
        loaded_blocks: set[int] = set()
        for e in events:
            if isinstance(e, BlockOffloaded):
                block, slot = e.block_id, e.host_slot
                if slot in slots_written or slot in loaded_slots or block in loaded_blocks:
                    self._batch(stores, loads, loading)
                    stores, loads, slots_written, loaded_slots, loaded_blocks = [], [], set(), set(), set()
                stores.append((block, slot))
                slots_written.add(slot)
            elif isinstance(e, BlockOnloaded):
                slot, block = e.host_slot, e.block_id
                if block in loaded_blocks:
                    self._batch(stores, loads, loading)
                    stores, loads, slots_written, loaded_slots, loaded_blocks = [], [], set(), set(), set()
                loads.append((slot, block))
                loaded_slots.add(slot)
                loaded_blocks.add(block)
        self._batch(stores, loads, loading)

    def send(self) -> None:
        """Issue the copies to the host of the store batches gathered so far, in their order (on the copy stream,
        each behind its gather): the engine calls it once a step's forward is launched, so the host's calls for them
        never delay a forward. A copy that fails to be issued leaves its batch's slots (and those after) in
        ``unwritten``."""
        unsent, self.unsent = self.unsent, []
        copy = self.copy_stream
        if not unsent or copy is None:
            return
        try:
            with torch.cuda.stream(copy):
                while unsent:
                    slots, gathered, read = unsent[0]
                    copy.wait_event(read)  # (behind its gather; the copies of the batches before it, in order)
                    for on_device, (_, host) in zip(gathered, self.sides):  # (over the bus, beside the forward)
                        for i, slot, n in _runs(slots):
                            host[slot : slot + n].copy_(on_device[i : i + n], non_blocking=True)
                    landed = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    landed.record(copy)
                    self.pending.append((landed, slots, gathered))  # (the staging kept until the copy has landed)
                    unsent.pop(0)
        except BaseException:
            for slots, _, _ in unsent:
                self.unwritten.update(slots)  # (their entries stay in the core's tier: never read from here on)
            raise

    def settle(self, wait: bool = True) -> None:
        """Store batches whose copies have landed let go of their device staging, in order (``wait``: every one
        issued first and each waited for); load staging no longer written let go."""
        if wait:
            self.send()
        while self.pending:
            landed = self.pending[0][0]
            if not wait and not landed.query():  # type: ignore[no-untyped-call]
                break
            landed.synchronize()
            self.pending.pop(0)
        self.staging = [x for x in self.staging if not x[0].query()]  # type: ignore[no-untyped-call]

    def _batch(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]], loading: set[int]) -> None:
        """A batch's stores, then its loads (``loading``: every slot the events being applied load)."""
        if stores and self.store_stream is not None:  # (back-pressure: a lost hit, never a wait)
            room = (self.max_in_flight_bytes - self._in_flight_bytes()) // self.block_bytes
            if room < len(stores):
                kept: list[tuple[int, int]] = []
                shed: list[tuple[int, int]] = []
                for store in stores:
                    if store[1] in loading or len(kept) < room:
                        kept.append(store)
                    else:
                        shed.append(store)
                stores = kept
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
        """The device staging the stores on their way hold (their copies issued or not)."""
        blocks = sum(len(slots) for _, slots, _ in self.pending) + sum(len(slots) for slots, _, _ in self.unsent)
        return blocks * self.block_bytes

    def _store(self, blocks: list[int], slots: list[int]) -> None:
        self.stored += len(blocks)
        if self.store_stream is None:
            dst = torch.tensor(slots, dtype=torch.long)
            for dev, host in self.sides:
                at = torch.tensor(blocks, dtype=torch.long, device=dev.device)
                host.index_copy_(0, dst, dev.index_select(1, at).transpose(0, 1).to("cpu"))
            return
        stream = self.store_stream
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream(self.pool.device))  # (the forwards wrote these blocks)
            if self.stream is not None:  # (a slot a load still reads is not written over)
                stream.wait_stream(self.stream)
            at = to_device(blocks, torch.long, self.pool.device)
            # the blocks read at device speed, a slot's bytes contiguous: (blocks, layers, *page), one gather a side
            # (shell.host_copy's kernel: each page's run copied as words)
            from pagedkv.shell.host_copy import gather_pages

            gathered = [gather_pages(dev, at) for dev, _ in self.sides]
            read = torch.cuda.Event()  # type: ignore[no-untyped-call]
            read.record(stream)
        self.read = read
        self.unsent.append((slots, gathered, read))  # (their copies to the host: ``send``, once the forward is queued)

    def _load(self, slots: list[int], blocks: list[int]) -> None:
        self.loaded += len(blocks)
        if self.stream is None:
            src = torch.tensor(slots, dtype=torch.long)
            for dev, host in self.sides:
                at = torch.tensor(blocks, dtype=torch.long, device=dev.device)
                dev.index_copy_(1, at, host.index_select(0, src).transpose(0, 1).to(dev.device))
            return
        self.send()  # (a slot a store before it writes: its copy issued, so the load can wait for it)
        held = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))  # (forwards may read these blocks)
            if self.read is not None:  # (a store before it reads its block before any load overwrites it)
                self.stream.wait_event(self.read)
            wanted = set(slots)
            for landed, written, _ in self.pending:  # (a slot a store is still bringing to the host: on the device)
                if wanted.intersection(written):
                    self.stream.wait_event(landed)
            at = to_device(blocks, torch.long, self.pool.device)
            for dev, host in self.sides:
                staged = torch.empty((len(slots), *host.shape[1:]), dtype=host.dtype, device=self.pool.device)
                for i, slot, n in _runs(slots):
                    staged[i : i + n].copy_(host[slot : slot + n], non_blocking=True)
                dev.index_copy_(1, at, staged.transpose(0, 1))
                held.append(staged)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        self.staging.append((event, held))


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive slots at consecutive places: (place, first slot, length) each."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            place, first, n = runs[-1]
            runs[-1] = (place, first, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs
