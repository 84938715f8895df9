"""The engine's own thread for a server (``pagedkv serve``): the one thread that calls the engine (its
single-threaded contract kept), fed through a queue. Handlers on the server's event loop ``submit`` requests and
``cancel`` them; this thread takes what is queued between steps, steps while anything is live, and hands each
request's text back to its handler as it grows (``Sequence.events``, an ``asyncio.Queue`` fed thread-safely).

A request is one or more ``Sequence``s (``n``, several prompts), admitted together or not at all. What a handler
reads from a sequence, in order: ``("accepted",)`` or ``("refused", message)``; then ``("text", delta)`` as tokens
arrive (the text held back by the longest stop string's length less one, so that what was sent is never taken
back); then ``("done", completion, rest)``, ``rest`` the end of the completion's text not yet sent. A request
cancelled (its client gone) is ended at the next pass between steps: its blocks go back then. A step that fails
ends only its own requests (the engine's fault rule: their completions say ``error``) and the loop serves on.

``Metrics`` keeps what ``/metrics`` shows under vLLM's names; only this thread writes it."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, cast

from pagedkv.shell.detok import TextSoFar
from pagedkv.shell.errors import ShellError
from pagedkv.shell.outcomes import Completion
from pagedkv.shell.sampling import SamplingParams

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py) for time to first token and inter-token latency, seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class QueueFull(Exception):
    """More requests are waiting than the server takes (``max_waiting``): answered 503 with a retry hint."""


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket (not cumulative), the last one past every bound
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.buckets, v)] += 1
        self.total += v
        self.count += 1


@dataclass
class Metrics:
    """What the engine thread counts for ``/metrics`` (gauges refreshed after every pass)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock)  # (the histograms are read from another thread)


class Sequence:
    """One engine request of a client's request: its prompt ids and parameters, and the events its handler reads
    (posted from the engine thread onto the handler's event loop)."""

    def __init__(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.rid, self.prompt_ids, self.params, self.loop = rid, prompt_ids, params, loop
        self.events: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.stops = cast("tuple[str, ...]", params.stop)  # (a tuple once made)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text: TextSoFar | None = None  # (the engine thread's)
        self.sent = 0  # characters of the text handed out
        self.arrived = time.perf_counter()
        self.last: float | None = None  # when its last token arrived


def _deliver(batch: list[tuple[Sequence, tuple[Any, ...]]]) -> None:
    """A pass's events into their sequences' queues (on the handlers' event loop: one wake-up a pass)."""
    for s, event in batch:
        s.events.put_nowait(event)


class EngineLoop:
    """``engine`` served from a thread of its own; ``max_waiting``: requests queued or waiting in the scheduler
    beyond which ``submit`` raises ``QueueFull``."""

    def __init__(self, engine: Any, tokenizer: Any, *, max_waiting: int = 1024) -> None:
        self.engine, self.tokenizer, self.max_waiting = engine, tokenizer, max_waiting
        self.inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.live: dict[str, Sequence] = {}  # (the engine thread's)
        self.queued = 0  # sequences submitted and not yet taken by the engine thread
        self._queued_lock = threading.Lock()  # (counted up by handlers, down by the engine thread)
        self.metrics = Metrics()
        self.faults = 0  # steps that raised out of the engine (a hook's fault); the loop serves on
        self._outbox: list[tuple[Sequence, tuple[Any, ...]]] = []  # (the engine thread's: a pass's events, in order)
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._closed = False

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread after its current step; what was live is cancelled."""
        if not self._closed:
            self._closed = True
            self.inbox.put(("stop", None))
            self.wake.set()
            self._thread.join(timeout=60)

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue ``seqs`` (one client request) for the engine; ``QueueFull`` when the server holds its most."""
        with self._queued_lock:
            waiting = self.queued + self.metrics.waiting
            if waiting + len(seqs) > self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting (the most: {self.max_waiting})")
            self.queued += len(seqs)
        self.inbox.put(("add", seqs))
        self.wake.set()

    def cancel(self, rids: list[str]) -> None:
        """End these requests at the next pass (a client gone); unknown or ended ones are passed over."""
        self.inbox.put(("cancel", rids))
        self.wake.set()

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            if not eng.has_unfinished():
                self.wake.wait()
            self.wake.clear()
            while True:
                try:
                    what, arg = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if what == "stop":
                    for rid in list(self.live):
                        self._cancel(rid)
                    self._flush()
                    return
                if what == "add":
                    with self._queued_lock:
                        self.queued -= len(arg)
                    self._add(arg)
                else:
                    for rid in arg:
                        self._cancel(rid)
            self._flush()  # (accepted or refused before the step runs)
            if eng.has_unfinished():
                try:
                    done = eng.step(self._on_token)
                except Exception:  # noqa: BLE001 - a hook's fault: the engine is consistent, its requests ended
                    self.faults += 1
                    done = []
                for c in done:
                    self._finish(c)
            self._flush()
            self._gauges()

    def _flush(self) -> None:
        """The events gathered since the last flush handed to their handlers, in order: one call onto each event loop
        they came from."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sequence, tuple[Any, ...]]]] = {}
        for s, event in self._outbox:
            by_loop.setdefault(s.loop, []).append((s, event))
        self._outbox = []
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_deliver, batch)

    def _add(self, seqs: list[Sequence]) -> None:
        added: list[Sequence] = []
        for s in seqs:
            try:
                self.engine.add_request(s.rid, "", s.prompt_ids, s.params)
            except (ShellError, ValueError, TypeError) as e:
                for a in added:  # (a request's sequences: all of them, or none)
                    self.engine.cancel(a.rid)
                    del self.live[a.rid]
                for x in seqs:
                    self._outbox.append((x, ("refused", str(e))))
                return
            self.live[s.rid] = s
            added.append(s)
        for s in seqs:
            s.text = TextSoFar(self.tokenizer)
            self._outbox.append((s, ("accepted",)))

    def _cancel(self, rid: str) -> None:
        s = self.live.pop(rid, None)
        if s is None:
            return
        try:
            c = self.engine.cancel(rid)
        except ShellError:  # (it ended meanwhile: its completion went out by step)
            return
        self._count(c)
        self._outbox.append((s, ("done", c, "")))

    def _on_token(self, rid: Any, token: int) -> None:
        s = self.live.get(rid)
        if s is None or s.text is None:
            return
        now = time.perf_counter()
        with self.metrics.lock:
            if s.last is None:
                self.metrics.ttft.observe(now - s.arrived)
            else:
                self.metrics.itl.observe(now - s.last)
        s.last = now
        s.text.push(token)
        text = s.text.text
        ready = len(text) - s.holdback
        for stop in s.stops:  # (a stop string this token completed: nothing from its start is sent)
            at = text.find(stop, max(0, s.sent - len(stop) + 1))
            if at >= 0:
                ready = min(ready, at)
        if ready > s.sent:
            self._outbox.append((s, ("text", text[s.sent : ready])))
            s.sent = ready

    def _finish(self, c: Completion) -> None:
        s = self.live.pop(str(c.request_id), None)
        if s is None:
            return
        self._count(c)
        with self.metrics.lock:
            self.metrics.e2e.observe(time.perf_counter() - s.arrived)
        sent = s.text.text[: s.sent] if s.text is not None else ""
        self._outbox.append((s, ("done", c, c.text[len(sent) :] if c.text.startswith(sent) else "")))

    def _count(self, c: Completion) -> None:
        m = self.metrics
        reason = c.finish_reason or "unknown"
        m.finished[reason] = m.finished.get(reason, 0) + 1

    def _gauges(self) -> None:
        eng, m = self.engine, self.metrics
        st, kv = eng.state, eng.state.kv
        m.running, m.waiting = len(st.running), len(st.waiting)
        m.kv_usage = (kv.config.usable_blocks - kv.free_blocks) / kv.config.usable_blocks
        m.prefix_queries, m.prefix_hits = kv.prefix_queries, kv.prefix_hits
        m.preemptions, m.prompt_tokens = eng.stats.preemptions, eng.stats.prompt_tokens
        m.generation_tokens = eng.stats.generated_tokens
