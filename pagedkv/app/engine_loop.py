"""The engine in a process of its own for a server (``pagedkv serve``), as vLLM's server keeps its engine core apart
from its API server: the server's process holds an ``EngineLoop`` (requests in, text out, metrics); the engine's
process (spawned by ``start``: ``build(*args)`` makes the engine there) is the one thread that calls the engine,
its single-threaded contract kept. They share a pipe and nothing else, so the HTTP side's work (reading requests,
writing a chunk a stream a step) never takes the interpreter from the step loop.

What crosses the pipe, in order. To the engine: ``("add", [(rid, prompt_ids, params), ...])`` (one client
request's sequences), ``("cancel", [rid, ...])``, ``("stop", None)``. Back, first ``("ready", tokenizer, info)`` or
``("failed", message)``, then a message a flush (before a step when requests were taken or cancelled, and after
each step): ``("pass", events, gauges)``, the events in the order they happened: ``("accepted", rids)``,
``("refused", rids, message)``, ``("tokens", [(rid, token, logprob entry or None), ...])`` (a step's, in order), ``("done", completion,
stepped)`` (``stepped``: it ended in a step, not by a cancel); last ``("closed",)``. The engine's side sends ids;
the text is made here (vLLM's split too: the front end detokenizes), so a request with stop strings is
detokenized on both sides (the engine's stop rule needs its text).

A request is one or more ``Sequence``s (``n``, several prompts), admitted together or not at all. What a handler
reads from a sequence, in order: ``("accepted",)`` or ``("refused", message)``; then ``("text", delta)`` as tokens
arrive (the text held back by the longest stop string's length less one, so that what was sent is never taken
back); then ``("done", completion, rest)``, ``rest`` the end of the completion's text not yet sent. A request
cancelled (its client gone) is ended at the next pass between steps: its blocks go back then. A step that fails
ends only its own requests (the engine's fault rule: their completions say ``error``) and the loop serves on. An
engine process that ends (killed, out of memory) ends every live request with ``error``; ``dead`` says why, and
``submit`` then raises ``EngineDead``.

``Metrics`` keeps what ``/metrics`` shows under vLLM's names: the engine's gauges and counters as its last pass
left them, the latencies as this side saw the tokens arrive."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from pagedkv.shell.detok import TextSoFar
from pagedkv.shell.errors import ShellError
from pagedkv.shell.outcomes import Completion, one_line
from pagedkv.shell.sampling import SamplingParams

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py) for time to first token and inter-token latency, seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISHED_LABELS = {"stop": "stop", "length": "length", "error": "error"}  # vLLM's finished_reason; the rest abort
STOP_WAIT_S = 60  # how long ``close`` waits for the engine's process to end its step and stop


class QueueFull(Exception):
    """More requests are waiting than the server takes (``max_waiting``): answered 503 with a retry hint."""


class NeverTaken(Exception):
    """A request of more sequences than may ever wait (``max_waiting``): answered 400, never worth a retry."""


class EngineDead(Exception):
    """The engine's process could not start (its build failed: the message says why) or has ended."""


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
    """What ``/metrics`` shows: the engine's figures after its last pass, and the latencies seen here."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0  # requests the engine holds (running, waiting, or ending)
    held_blocks: int = 0  # blocks its requests hold
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock)  # (the histograms are read from another thread)


class Sequence:
    """One engine request of a client's request: its prompt ids and parameters, and the events its handler reads
    (posted onto the handler's event loop)."""

    def __init__(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.rid, self.prompt_ids, self.params, self.loop = rid, prompt_ids, params, loop
        self.events: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.stops = cast("tuple[str, ...]", params.stop)  # (a tuple once made)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text: TextSoFar | None = None  # (made once the engine has taken it; its ids: the tokens that came)
        self.sent = 0  # characters of the text handed out
        self.token_lps: list[tuple[int, Any]] = []  # each token's logprob entry, where its params ask them
        self.lps_sent = 0  # entries a stream handed out
        self.arrived = time.perf_counter()
        self.last: float | None = None  # when its last token arrived


def _deliver(batch: list[tuple[Sequence, tuple[Any, ...]]]) -> None:
    """A pass's events into their sequences' queues (on the handlers' event loop: one wake-up a pass)."""
    for s, event in batch:
        s.events.put_nowait(event)


class EngineLoop:
    """The engine that ``build(*args)`` makes (a picklable callable: it runs in the engine's process), served
    from a process of its own once ``start``ed; ``max_waiting``: sequences that would wait in the scheduler (those
    it holds or is sent beyond its ``max_num_seqs`` seats) past which ``submit`` raises ``QueueFull``;
    ``tokenizer``: the one the server encodes and decodes with (default: the engine's, sent back when it is
    ready). ``max_model_len``: the most tokens a request may hold, what the engine's pool holds for one alone
    (``Engine.longest_request``)."""

    def __init__(self, build: Callable[..., Any], *args: Any, max_waiting: int = 1024, tokenizer: Any = None) -> None:
        ctx = multiprocessing.get_context("spawn")  # (never fork: CUDA and OpenMP do not survive it)
        self._conn, self._child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(self._child, build, args), name="pagedkv-engine")
        self._proc.daemon = True  # (ended with this process, whatever happens to it)
        self.tokenizer, self.max_waiting = tokenizer, max_waiting
        self.max_model_len: int | None = None
        self.max_num_seqs = 0  # (the scheduler's seats, told when the engine is ready: none before)
        self.live: dict[str, Sequence] = {}  # submitted and not yet ended
        self.queued = 0  # sequences submitted and not yet taken or refused by the engine
        self._lock = threading.Lock()  # (``queued``: counted up by handlers, down by the reader)
        self._send_lock = threading.Lock()  # (one message at a time on the pipe)
        self.metrics = Metrics()
        self.faults = 0  # steps that raised out of the engine (a hook's fault); the loop serves on
        self.dead: str | None = None  # why the engine's process ended, once it has
        self.on_dead: Callable[[str], None] | None = None  # told once, from the reader's thread
        self._reader = threading.Thread(target=self._read, name="pagedkv-engine-reader", daemon=True)
        self._closed = False

    def start(self) -> EngineLoop:
        """Spawn the engine's process and wait until its engine is built; ``EngineDead`` with the build's error."""
        self._proc.start()
        self._child.close()  # (the child's end is the child's: its exit is then our end of file)
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join()
            raise EngineDead(f"the engine's process ended while starting (exit code {self._proc.exitcode})") from None
        if msg[0] == "failed":
            self._proc.join()
            raise EngineDead(msg[1])
        _, tokenizer, info = msg
        self.tokenizer = self.tokenizer if self.tokenizer is not None else tokenizer
        self.max_model_len, self.max_num_seqs = info["max_model_len"], info["max_num_seqs"]
        self._reader.start()
        return self

    @property
    def pid(self) -> int | None:
        """The engine's process id (None before ``start``)."""
        return self._proc.pid

    def close(self) -> None:
        """Stop the engine after its current step (what was live is cancelled) and wait for its process to end."""
        if self._closed:
            return
        self._closed = True
        if self._proc.pid is not None and self.dead is None:
            try:
                self._send(("stop", None))
            except OSError:
                pass
            self._reader.join(timeout=STOP_WAIT_S)
        if self._proc.pid is not None:
            self._proc.join(timeout=STOP_WAIT_S)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        else:
            self._child.close()  # (never started: the child's end is still ours)
        self._conn.close()

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue ``seqs`` (one client request) for the engine; ``QueueFull`` when more would wait than the server
        takes, ``NeverTaken`` for more sequences than may ever wait, ``EngineDead`` once the engine's process has
        ended."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        if len(seqs) > self.max_waiting:
            raise NeverTaken(f"{len(seqs)} sequences are more than the server ever lets wait ({self.max_waiting})")
        with self._lock:
            m = self.metrics  # (as the engine's last pass left them; those sent since count as they will be)
            waiting = max(0, m.running + m.waiting + self.queued - self.max_num_seqs)  # (past the seats: they wait)
            if waiting + len(seqs) > self.max_waiting:
                raise QueueFull(f"{waiting} requests would wait (the most: {self.max_waiting})")
            self.queued += len(seqs)
        for s in seqs:
            self.live[s.rid] = s
        try:
            self._send(("add", [(s.rid, s.prompt_ids, s.params) for s in seqs]))
        except OSError:  # (the engine's process went between the check and the send: nothing taken)
            for s in seqs:
                self.live.pop(s.rid, None)
            with self._lock:
                self.queued -= len(seqs)
            raise EngineDead(self.dead or "the engine's process has ended") from None

    def cancel(self, rids: list[str]) -> None:
        """End these requests at the next pass (a client gone); unknown or ended ones are passed over."""
        if self.dead is None and not self._closed:
            try:
                self._send(("cancel", rids))
            except OSError:  # (the engine's process gone: its requests end with it)
                pass

    def _send(self, msg: tuple[str, Any]) -> None:
        with self._send_lock:
            self._conn.send(msg)

    # -- the reader: the engine's passes made into events for the handlers ----------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                self._died()
                return
            if msg[0] == "closed":
                return
            self._apply(msg[1], msg[2])

    def _apply(self, events: list[tuple[Any, ...]], gauges: dict[str, Any]) -> None:
        out: list[tuple[Sequence, tuple[Any, ...]]] = []
        now = time.perf_counter()
        for ev in events:
            kind = ev[0]
            if kind == "tokens":
                for rid, token, entry in ev[1]:
                    s = self.live.get(rid)
                    if s is not None and s.text is not None:
                        if entry is not None:
                            s.token_lps.append((token, entry))
                        self._token(s, s.text, token, now, out)
            elif kind == "done":
                self._done(ev[1], ev[2], now, out)
            elif kind == "accepted":
                for rid in ev[1]:
                    s = self.live[rid]
                    s.text = TextSoFar(self.tokenizer)
                    out.append((s, ("accepted",)))
                with self._lock:
                    self.queued -= len(ev[1])
            else:  # refused
                for rid in ev[1]:
                    out.append((self.live.pop(rid), ("refused", ev[2])))
                with self._lock:
                    self.queued -= len(ev[1])
        self.faults = gauges.pop("faults")
        for name, value in gauges.items():  # (``_Core.gauges``: the engine's figures, under Metrics' names)
            setattr(self.metrics, name, value)
        _post(out)

    def _token(
        self, s: Sequence, so_far: TextSoFar, token: int, now: float, out: list[tuple[Sequence, tuple[Any, ...]]]
    ) -> None:
        with self.metrics.lock:
            if s.last is None:
                self.metrics.ttft.observe(now - s.arrived)
            else:
                self.metrics.itl.observe(now - s.last)
        s.last = now
        so_far.push(token)
        text = so_far.text
        ready = len(text) - s.holdback
        keep = s.params.include_stop_str_in_output
        for stop in s.stops:  # (a stop string this token completed: nothing from its start, or past its end, is sent)
            at = text.find(stop, max(0, s.sent - len(stop) + 1))
            if at >= 0:
                ready = min(ready, at + len(stop) if keep else at)
        if ready > s.sent:
            out.append((s, ("text", text[s.sent : ready])))
            s.sent = ready

    def _done(self, c: Completion, stepped: bool, now: float, out: list[tuple[Sequence, tuple[Any, ...]]]) -> None:
        s = self.live.pop(str(c.request_id), None)
        if s is None:
            return
        m = self.metrics
        reason = FINISHED_LABELS.get(c.finish_reason or "", "abort")  # (vLLM's label: a refusal, a cancel: abort)
        with m.lock:
            m.finished[reason] = m.finished.get(reason, 0) + 1
            if stepped:
                m.e2e.observe(now - s.arrived)
        sent = s.text.text[: s.sent] if s.text is not None else ""
        out.append((s, ("done", c, c.text[len(sent) :] if c.text.startswith(sent) else "")))

    def _died(self) -> None:
        """The engine's process ended without being stopped: every live request ends with ``error``."""
        self._proc.join(timeout=5)
        self.dead = f"the engine's process ended (exit code {self._proc.exitcode})"
        out: list[tuple[Sequence, tuple[Any, ...]]] = []
        now = time.perf_counter()
        for rid, s in list(self.live.items()):
            if s.text is None:  # (not taken yet: its handler waits to hear it was)
                s.text = TextSoFar(self.tokenizer)
                out.append((s, ("accepted",)))
            # what it generated is what came before the end: its tokens and the text sent of them
            c = Completion(rid, "", s.prompt_ids, list(s.text.ids), s.text.text[: s.sent], "error", error=self.dead)
            self._done(c, False, now, out)
        with self._lock:
            self.queued = 0
        _post(out)
        if self.on_dead is not None and not self._closed:
            self.on_dead(self.dead)


def _post(out: list[tuple[Sequence, tuple[Any, ...]]]) -> None:
    """Events handed to their handlers, in order: one call onto each event loop they came from."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sequence, tuple[Any, ...]]]] = {}
    for s, event in out:
        by_loop.setdefault(s.loop, []).append((s, event))
    for loop, batch in by_loop.items():
        if not loop.is_closed():
            loop.call_soon_threadsafe(_deliver, batch)


# -- the engine's process --------------------------------------------------------------------------------------------
def _engine_main(conn: Any, build: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """The engine's process: build the engine, say so, serve the pipe until told to stop (or the server is gone)."""
    from pagedkv.app.args import UsageError
    from pagedkv.shell.engine_args import freeze_startup

    try:
        engine = build(*args)
    except Exception as e:  # noqa: BLE001 - whatever stops the build is the server's to say, in one line
        conn.send(("failed", str(e) if isinstance(e, UsageError) else one_line(e)))
        return
    freeze_startup()  # (as vLLM's engine core: start-up's objects out of every collection)
    info = {"max_model_len": engine.longest_request(), "max_num_seqs": engine.args.max_num_seqs}
    conn.send(("ready", engine.tokenizer, info))
    _Core(engine, conn).run()


class _Core:
    """The step loop of the engine's process: what arrived taken between steps, a step while anything is live, a
    pass's events sent as one message."""

    def __init__(self, engine: Any, conn: Any) -> None:
        self.engine, self.conn = engine, conn
        self.inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.live: set[str] = set()
        self.events: list[tuple[Any, ...]] = []
        self.tokens: list[tuple[str, int, Any]] = []  # (rid, token, its logprob entry where asked)
        self.faults = 0
        threading.Thread(target=self._listen, name="pagedkv-engine-inbox", daemon=True).start()

    def _listen(self) -> None:
        """The pipe read as messages arrive (so that a sender never waits on a step): into the inbox."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # (the server's process gone: stop)
                msg = ("stop", None)
            self.inbox.put(msg)
            self.wake.set()
            if msg[0] == "stop":
                return

    def run(self) -> None:
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
                    eng.finish_trace()  # (a trace being recorded: its end record, so it replays whole)
                    self._send(("closed",))
                    return
                if what == "add":
                    self._add(arg)
                else:
                    for rid in arg:
                        self._cancel(rid)
            if self.events:
                self._flush()  # (taken or refused before the step runs)
            if eng.has_unfinished():
                try:
                    done = eng.step(self._on_token)
                except Exception:  # noqa: BLE001 - a hook's fault: the engine is consistent, its requests ended
                    self.faults += 1
                    done = []
                if self.tokens:
                    self.events.append(("tokens", self.tokens))
                    self.tokens = []
                for c in done:
                    self.live.discard(str(c.request_id))
                    self.events.append(("done", c, True))
            self._flush()

    def _add(self, items: list[tuple[str, list[int], SamplingParams]]) -> None:
        added: list[str] = []
        for rid, ids, params in items:
            try:
                self.engine.add_request(rid, "", ids, params)
            except (ShellError, ValueError, TypeError) as e:
                for a in added:  # (a request's sequences: all of them, or none)
                    self.engine.cancel(a)
                    self.live.discard(a)
                self.events.append(("refused", [r for r, _, _ in items], str(e)))
                return
            self.live.add(rid)
            added.append(rid)
        self.events.append(("accepted", added))

    def _cancel(self, rid: str) -> None:
        if rid not in self.live:
            return
        self.live.discard(rid)
        try:
            c = self.engine.cancel(rid)
        except ShellError:  # (it ended meanwhile: its completion went out by step)
            return
        self.events.append(("done", c, False))

    def _on_token(self, rid: Any, token: int) -> None:
        live = self.engine.requests.get(rid)  # (its logprob entry, where asked: taken before the callback)
        lps = live.completion.logprobs if live is not None and live.params.logprobs is not None else None
        self.tokens.append((rid, token, lps[-1] if lps else None))

    def _flush(self) -> None:
        events, self.events = self.events, []
        self._send(("pass", events, self.gauges()))

    def _send(self, msg: tuple[Any, ...]) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # (the server's process gone: the listener stops the loop)
            pass

    def gauges(self) -> dict[str, Any]:
        """The engine's figures for ``/metrics`` (``Metrics``' names), and the steps that raised."""
        eng = self.engine
        st, kv, stats = eng.state, eng.state.kv, eng.stats
        usable = kv.config.usable_blocks
        return {
            "running": len(st.running),
            "waiting": len(st.waiting),
            "kv_usage": (usable - kv.free_blocks) / usable,
            "prefix_queries": kv.prefix_queries,
            "prefix_hits": kv.prefix_hits,
            "preemptions": stats.preemptions,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generated_tokens,
            "requests": len(eng.requests),
            "held_blocks": usable - kv.free_blocks,
            "faults": self.faults,
        }
