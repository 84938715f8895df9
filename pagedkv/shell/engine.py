"""The engine: the imperative loop a serving engine runs around pagedkv.

A step is three calls: ``schedule`` (pure: the plan) -> ``ModelRunner.run`` (shell/runner.py: install each
snapshot, forward, sample) -> the output (the ids taken by their requests, ``on_output``: pure), releasing
finished and preempted requests' rows in the worker. Speculation, the host tier's copies, overlap and the
recorder are parts that exist only when configured. Continuous batching, chunked
prefill, prefix caching and preemption by recompute come from the scheduler.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import FIRST_COMPLETED, Future, wait
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TextIO

import torch
from returns.result import Failure

from pagedkv.core.config import InvalidConfig
from pagedkv.core.errors import ErrorCode, RequestId, shown
from pagedkv.core.scheduler import (
    SchedulerConfig,
    SeqRequest,
    StepPlan,
    cancel,
    forget_host,
    new_scheduler,
    on_output,
    on_tokens,
    schedule,
    submit,
)
from pagedkv.shell.host_pages import HostPages
from pagedkv.shell.detok import TextSoFar
from pagedkv.shell.engine_args import EngineArgs, EngineStats
from pagedkv.shell.errors import EngineBusy, ShellError, refuse
from pagedkv.shell.kv_scales import calibration_ids
from pagedkv.shell.outcomes import Completion, Live, Outcomes, one_line
from pagedkv.shell.overlap import Overlap
from pagedkv.shell.rank import Rank
from pagedkv.shell.recorder import Recorder
from pagedkv.shell.runner import ModelRunner
from pagedkv.shell.sampling import SamplingError, SamplingParams, params_problem, request_seed
from pagedkv.shell.speculative import Speculation, SpeculativeConfig
from pagedkv.shell.structured import Grammars

__all__ = ["Engine"]


class Engine:
    """One rank's engine over a model with ``forward(tokens, batch, pool, backend, layout[, logits_at])``.

    ``args`` (``EngineArgs``, any field also as a keyword) size it. Its KV side is ``rank`` (``shell.rank``;
    its buffers must hold the batches ``args`` allow), or the one ``args`` give the model. ``trace``: record
    the run there (``shell.recorder``; ``trace_expect=False`` leaves out the expect fields, whose digest costs
    O(pool blocks) an event: 0.6 ms at 4,096 blocks). ``on_kv_events``: called with each step's core KV
    events, in order, when there are any (``integrations.vllm.publish.hook`` sends them to a ZMQ publisher in
    vLLM's format). ``keep_history``: the core's snapshot after every step in ``kv_history``; ``time_steps``:
    (decode rows, prefill tokens, seconds) of every step in ``step_times``, the device synchronised first.

    Single-threaded by contract: ``step``, ``generate``, ``add_request``, ``cancel`` and ``finish_trace`` refuse a
    second thread while one is inside (``EngineBusy``, nothing done); callbacks run on the engine's thread and may
    call them. ``requests`` holds the live requests only: a request leaves it when it ends, and its completion
    is the caller's once handed out (an engine that served a million requests holds what one that served ten
    does); a request id may be taken again as soon as its request ended."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        args: EngineArgs | None = None,
        *,
        trace: TextIO | None = None,
        rank: Rank | None = None,
        keep_history: bool = False,
        time_steps: bool = False,
        trace_expect: bool = True,
        on_kv_events: Callable[[tuple[Any, ...]], None] | None = None,
        **fields: Any,
    ) -> None:
        args = replace(args or EngineArgs(), **fields)
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.backend = args.attention(model)
        if rank is None:
            rank = args.rank_for(model, self.backend, calibration_ids(tokenizer))
        elif rank.worker.max_rows < args.max_num_seqs or rank.worker.max_tokens < args.step_tokens(model):
            raise InvalidConfig(
                f"the rank's buffers hold {rank.worker.max_rows} rows and {rank.worker.max_tokens} "
                f"tokens; the scheduler may batch {args.max_num_seqs} and "
                f"{args.step_tokens(model)}"
            )
        elif args.batch_invariant and rank.worker.token_rows < args.step_tokens(model):
            raise InvalidConfig(
                f"batch_invariant lays every query token out as a row: the rank's buffers hold "
                f"{rank.worker.token_rows} such rows, a step may carry {args.step_tokens(model)} tokens"
            )
        self.rank, self.cache, self.pool, self.worker, self.layout = (
            rank,
            rank.cache,
            rank.pool,
            rank.worker,
            rank.layout,
        )
        self.sizing = rank.sizing
        tier = self.cache.host_blocks  # (the prefix cache's host tier: its pages and copies, shell/host_pages.py)
        self.host_pages = HostPages(self.pool, tier) if tier else None
        sched = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            chunked_prefill=args.chunked_prefill,
            grow_prefill=args.grow_prefill,
            long_prefill_token_threshold=args.prefill_chunk_cap(model, self.backend),
        )
        self.state = new_scheduler(self.cache, sched)
        spec = SpeculativeConfig.of(args.speculative_config)
        self.speculation = None if spec is None else Speculation(spec)  # n-gram drafts, verified each step
        self.overlap = Overlap() if args.async_scheduling else None  # the next step planned before ids are read
        self.requests: dict[RequestId, Live] = {}  # live requests (waiting or running in the scheduler)
        self._next_id = 0  # generate()'s ids: req-0, req-1, ... skipping any a live request holds
        self._grammars: Grammars | None = None  # structured outputs' compiler, made for the first constrained request
        self._held: dict[RequestId, tuple[Future[Any], Live, SeqRequest]] = {}  # constrained requests whose grammar
        # is compiling: out of the scheduler until it is ready (``_release_held``)
        self.runner = ModelRunner(  # (the device's side of a step: install, forward, sampling)
            model,
            tokenizer,
            rank,
            self.backend,
            self.requests,
            graphs=args.graphs_for(model, self.backend),
            graph_rows=args.max_num_seqs,
            overlapped=args.async_scheduling,
            batch_invariant=args.batch_invariant,
        )
        self.stats = EngineStats()
        self._longest: int | None = None  # longest_request(), once asked
        self.outcomes = Outcomes(
            tokenizer, None if trace is None else Recorder(trace, self.cache, sched, expect=trace_expect)
        )
        self.on_kv_events = on_kv_events  # each step's core KV events, in order (pagedkv.integrations.vllm)
        self.kv_history: list[Any] | None = [] if keep_history else None
        self.step_times: list[tuple[int, int, float]] | None = [] if time_steps else None
        self._lock = threading.RLock()  # the one thread inside (its callbacks may enter again)

    @contextlib.contextmanager
    def _entered(self, what: str) -> Iterator[None]:
        """The calling thread inside the engine, or ``EngineBusy`` at once when another thread is."""
        if not self._lock.acquire(blocking=False):
            raise EngineBusy(
                f"Engine.{what} from a second thread while another is inside the engine: an engine is "
                "single-threaded (serve it from one thread, or hand it requests through a queue)"
            )
        try:
            yield
        finally:
            self._lock.release()

    # -- step-level API ----------------------------------------------------------
    def add_request(self, rid: RequestId, prompt: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; refused (``ShellError``: ``DUPLICATE_REQUEST`` while a live request holds ``rid``,
        ``INVALID`` for what the core or the sampler cannot take) with nothing changed."""
        with self._entered("add_request"):
            self._add(rid, prompt, prompt_ids, params)

    def _add(
        self, rid: RequestId, prompt: str, prompt_ids: list[int], params: SamplingParams, checked: bool = False
    ) -> Live:
        """``checked``: ``params`` are ``_checked``'s copy already (``generate``'s)."""
        if not checked:  # (a checked copy: later changes to the caller's params reach nothing)
            params = self._checked(rid, params)
        if rid in self._held:
            raise refuse(
                ErrorCode.DUPLICATE_REQUEST, f"request {shown(rid)} is live (its grammar compiles)", request=rid
            )
        prompt_ids = self.served_prompt(params, prompt_ids)
        req = self._request(rid, prompt_ids, params)
        so = params.structured_outputs
        compiled = None if so is None else self.grammars().compile(so)
        state = self._submitted(self.state, req, params)  # (refused now, whether it enters now or once compiled)
        text = TextSoFar(self.tokenizer) if params.stop else None  # the text only where stop strings need it
        live = Live(Completion(rid, prompt, list(prompt_ids)), params, request_seed(rid, params), text)
        self.stats.prompt_tokens += len(prompt_ids)
        if compiled is not None and not compiled.done():  # held out of the scheduler until its grammar is ready
            self._held[rid] = (compiled, live, req)
            return live
        if compiled is not None:
            live.constraint = self.grammars().matcher(compiled.result())
        self.state = state
        self._entered_scheduler(live, req)
        return live

    def _entered_scheduler(self, live: Live, req: SeqRequest) -> None:
        """``live`` is submitted (``req``): live in the engine, its submit recorded."""
        rid = req.request_id
        if live.params.prompt_logprobs is not None:  # (the first token has none: vLLM's shape)
            live.completion.prompt_logprobs = [None]
            self.runner.scorers.add(rid)
        self.requests[rid] = live
        so = live.params.structured_outputs
        self.outcomes.record(lambda r: r.submit(req, self.state, None if so is None else so.as_dict()))

    def grammars(self) -> Grammars:
        """The engine's grammar compiler (structured outputs), over its tokenizer's vocabulary: made once."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size)
        return self._grammars

    def _release_held(self) -> None:
        """Constrained requests whose grammar is ready submitted to the scheduler, in the order they were added
        (waiting for the first when nothing else could run); one whose grammar failed ends with ``error``."""
        if not self.state.live and (self.overlap is None or self.overlap.pending is None):
            wait([f for f, _, _ in self._held.values()], return_when=FIRST_COMPLETED)
        for rid, (compiled, live, req) in list(self._held.items()):
            if not compiled.done():
                continue
            del self._held[rid]
            error = compiled.exception()
            if error is not None:
                self.outcomes.failed([live], f"structured_outputs could not be compiled: {one_line(error)}")
                continue
            live.constraint = self.grammars().matcher(compiled.result())
            self.state = self._submitted(self.state, req, live.params)
            self._entered_scheduler(live, req)

    def _checked(self, rid: RequestId, params: SamplingParams) -> SamplingParams:
        """A checked copy of ``params``, or ``ShellError`` (``INVALID``): sampling parameters it cannot sample with
        (``params_problem``: the params may have been changed in place since they were built), or more than one
        sequence (``n``: ``LLM.generate`` fans them out)."""
        problem = params_problem(params)
        if problem is None and params.n != 1:  # (LLM.generate fans n out into requests of one sequence each)
            problem = f"n={params.n}: a request here is one sequence (LLM.generate serves n of them a prompt)"
        if problem is None and params.structured_outputs is not None:  # (a constraint that cannot compile: now; its
            try:  # compile starts off the step, and ``_add`` finds it on its way)
                self.grammars().compile(params.structured_outputs)
            except SamplingError as e:
                problem = str(e)
        if problem is not None:  # refused here, not by the step that would sample with it
            raise refuse(ErrorCode.INVALID, f"request {shown(rid)}: {problem}", request=rid)
        return params.clone()

    def _request(self, rid: RequestId, prompt_ids: list[int], params: SamplingParams) -> SeqRequest:
        """What the scheduler keeps of a request (a checked ``params``): a request scoring its prompt
        (``prompt_logprobs``) reads no prefix cache, for every position of it is computed (vLLM's rule)."""
        return SeqRequest(
            rid,
            tuple(prompt_ids),
            max_tokens=self._max_tokens(params, prompt_ids),
            max_hit=None if params.prompt_logprobs is None else 0,
        )

    def served_prompt(self, params: SamplingParams, prompt_ids: list[int]) -> list[int]:
        """The prompt's ids a request with ``params`` is served: its last ``truncate_prompt_tokens`` (vLLM's; -1: as
        many as the longest request holds), or all of them."""
        keep = params.truncate_prompt_tokens
        if keep is None or not isinstance(prompt_ids, (list, tuple)):
            return prompt_ids
        if keep == -1:
            keep = self.longest_request()
        return list(prompt_ids[-keep:]) if len(prompt_ids) > keep else prompt_ids

    def _max_tokens(self, params: SamplingParams, prompt_ids: Sequence[int]) -> int:
        """``max_tokens``, or (None, vLLM's) as many as the longest request leaves after the prompt (at least one: a
        prompt of the whole length is refused by its length, not here)."""
        if params.max_tokens is not None:
            return params.max_tokens
        return max(1, self.longest_request() - len(prompt_ids))

    def _submitted(self, state: Any, req: SeqRequest, params: SamplingParams) -> Any:
        """``state`` with ``req`` submitted, or ``ShellError`` (the core's refusal, or a token id the model's
        vocabulary does not have) and nothing changed; ``params``: ``_checked``'s."""
        vocab = self.model.config.vocab_size
        bad = next(
            (t for t in req.prompt or () if type(t) is int and not 0 <= t < vocab), None
        )  # the core checks types
        where = "token id"
        if bad is None and params.logit_bias:
            bad, where = next((t for t in params.logit_bias if t >= vocab), None), "logit_bias' token id"
        if bad is None and params.allowed_token_ids:
            bad, where = next((t for t in params.allowed_token_ids if t >= vocab), None), "allowed_token_ids' id"
        if bad is not None:
            raise refuse(
                ErrorCode.INVALID,
                f"request {req.request_id!r}: {where} {bad} is outside the model's vocabulary [0, {vocab})",
                request=req.request_id,
            )
        submitted = submit(state, req)
        if isinstance(submitted, Failure):  # a bad request: typed, and the engine as it was
            raise ShellError(submitted.failure())
        return submitted.unwrap()

    def cancel(self, rid: RequestId) -> Completion:
        """End a live request: its blocks and buffer rows back, its completion (reason ``cancelled``, what it
        generated so far) given back here, and never by ``step`` (a token of it still on the device is dropped).
        ``ShellError`` (``UNKNOWN_REQUEST``) for an id no live request holds."""
        with self._entered("cancel"):
            held = self._held.pop(rid, None)
            if held is not None:  # (its grammar still compiling: it never entered the scheduler)
                return self.outcomes.cancelled(held[1])
            cancelled = cancel(self.state, rid)
            if isinstance(cancelled, Failure):  # an unknown or ended request
                raise ShellError(cancelled.failure())
            self.state = cancelled.unwrap()
            self.worker.remove([rid])
            done = self.outcomes.cancelled(self.requests.pop(rid))
            self.outcomes.record(lambda r: r.cancel(rid, self.state))
            self._kv_events(self.state.kv_events)  # (a listener's fault raises here, the engine consistent)
            return done

    def finish_trace(self) -> None:
        """End the trace being recorded (its end record: replay then knows it whole) and stop recording; the
        engine serves on. A trace without its end record replays as cut short."""
        with self._entered("finish_trace"):
            self.outcomes.record(lambda r: r.end())
            self.outcomes.recorder = None

    @property
    def trace_error(self) -> Exception | None:  # why the trace stopped being written, if it did (the run went on)
        return self.outcomes.trace_error

    def longest_request(self) -> int:
        """The most tokens (prompt and generated) one request may hold: ``max_model_len``, or less where the pool
        cannot hold that many for one request alone (its prompt taken whole, or under ``grow_prefill`` a token at a
        time: ``CacheConfig.held_growing``). What a server advertises and checks prompts against (vLLM refuses to
        start where its pool cannot hold ``max_model_len``; pagedkv serve does where it was asked for). Found once (the
        pool's geometry never changes)."""
        if self._longest is not None:
            return self._longest
        cfg, usable = self.cache, self.cache.usable_blocks
        holds = (lambda n: cfg.held_growing(n, 1) <= usable) if self.state.config.grow_prefill else None
        fits, over = 0, cfg.length_limit + 1  # (fits holds; over does not)
        while over - fits > 1:
            mid = (fits + over) // 2
            ok = holds(mid) if holds is not None else cfg.row_blocks(mid) <= usable
            fits, over = (mid, over) if ok else (fits, mid)
        self._longest = fits
        return fits

    def has_unfinished(self) -> bool:
        """Is there anything left for ``step()`` to do: a live request, ids in flight, or a completion a step that
        raised kept back (the next ``step()`` hands it out), so that ``while has_unfinished(): step()`` loses
        nothing."""
        return (
            bool(self.state.live)
            or (self.overlap is not None and self.overlap.pending is not None)
            or bool(self.outcomes.outbox)
            or bool(self._held)
        )

    def step(self, on_token: Callable[[RequestId, int], None] | None = None) -> list[Completion]:
        """One engine step; the completions that finished in it (and any a hook's fault kept back before).

        A step that does not complete, whatever stops it between the plan and its output (an exception in
        install, forward, sampling or an ``on_token`` callback, or a ``KeyboardInterrupt``), ends its live
        requests with ``finish_reason="error"`` in one change of the state (blocks cached ahead of the
        forward are taken back, tokens of this step dropped); a ``BaseException`` that is not an
        ``Exception`` is raised again once the engine is consistent, an ``Exception`` is kept in the
        requests' ``Completion.error`` and the engine serves on. Hooks run once the engine is consistent
        and the step's completions are kept (the trace writer, then ``on_kv_events``): a hook that raises
        makes ``step`` raise, and those completions come with the next call (``has_unfinished()`` is true until
        then); so does a fault after the output (the host tier's copies). A failed trace write stops the recording
        (``trace_error``).

        Every completion is handed out once: here (finished, refused, failed), or by ``cancel``."""
        with self._entered("step"):
            return self._step(on_token)

    def _step(self, on_token: Callable[[RequestId, int], None] | None) -> list[Completion]:
        if self._held:
            self._release_held()
        if not self.state.live and (self.overlap is None or self.overlap.pending is None):
            if self.host_pages is not None:  # (idle: the last stores' copies issued, nothing left waiting)
                self.host_pages.send()
            return self.outcomes.hand_out()  # (only completions kept back: handed out, no step planned)
        t0 = time.perf_counter()
        plan, drafts, bound, scheduled_events = self._schedule()
        self.outcomes.before, recorded = {}, False
        try:
            if self.host_pages is not None:  # the host tier's copies, in order, before the forward reads a block
                self.host_pages.apply(scheduled_events)  # (one that fails fails the step: its requests end)
            if self.overlap is not None and self.overlap.pending is not None and any(x.constraint for x in bound):
                # a constrained row's mask needs its last token: the last step's ids read now (the same tokens)
                self.outcomes.record(lambda r: r.schedule(self.state, plan, drafts))
                recorded = True
                read = self.overlap.land()
                if read is not None:
                    self._take_read(*read, on_token)
            ids, lps = self.runner.run(plan, bound, self.state, self._grammars)  # (queued on the device)
            if self.host_pages is not None:  # (the stores' copies to the host issued once the forward is queued)
                self.host_pages.send()
            # while the device runs them: the host's work that does not wait for this step's tokens
            if not recorded:
                self.outcomes.record(lambda r: r.schedule(self.state, plan, drafts))
                recorded = True
            self.outcomes.note_prefills(plan, self.requests)
            stop: list[RequestId]
            if self.overlap is not None:  # the last step's ids read while this one runs; this one's come next
                sampled, stop = self._overlapped(self.overlap, plan, bound, ids, lps, on_token), []
            else:
                tokens: list[int] = [] if ids is None else ids.tolist()  # the step's one device-to-host copy
                rows = None if lps is None else lps.tolist()  # (asked by a request: read behind the ids)
                sampled, stop = self.outcomes.take(plan, bound, tokens, on_token, self.stats, rows)
        except BaseException as e:  # noqa: BLE001 - any fault of the step ends the step's requests, not the engine
            events = self._fail(plan, e, recorded, drafts) + self._forget_unwritten()
            if not isinstance(e, Exception):  # (KeyboardInterrupt, SystemExit: the caller must see them)
                with contextlib.suppress(Exception):
                    self._kv_events(scheduled_events + events)
                raise
            self._kv_events(scheduled_events + events)  # what the plan did to the cache happened; the cancels follow
            return self.outcomes.hand_out()
        return self._output(plan, sampled, stop, scheduled_events, t0)

    def _schedule(self) -> tuple[StepPlan, Any, list[Live], tuple[Any, ...]]:
        """The step's plan (the scheduler's, with the drafts speculation proposes): the requests it preempted or
        ended out of the worker and handed out; the plan, its drafts, the requests it samples for (``Live``, in
        ``plan.samples``' order) and the KV events of the scheduling."""
        st, spec = self.state, self.speculation
        drafts = None if spec is None else spec.drafts(st.running, st.prefilling, self.requests)
        if drafts and self._grammars is not None:  # (a constrained request's drafts cut where its grammar refuses)
            drafts = {
                rid: d if (c := self.requests[rid].constraint) is None else c.drafts_kept(d)
                for rid, d in drafts.items()
            }
        self.state, plan = schedule(st, drafts).unwrap()
        scheduled_events = self.state.kv_events
        self.stats.steps += 1 if self.overlap is None or not plan.is_empty else 0
        if plan.preempted or plan.finished:  # their buffer rows go back before this step's installs
            self.worker.remove([*plan.preempted, *(rid for rid, _ in plan.finished)])
        if plan.finished:
            self._ended_by_plan(plan)
        bound = [self.requests[rid] for rid in plan.samples]  # (the requests this step samples for, not their ids)
        return plan, drafts, bound, scheduled_events

    def _output(
        self,
        plan: StepPlan,
        sampled: dict[RequestId, Any],
        stop: list[RequestId],
        scheduled_events: tuple[Any, ...],
        t0: float,
    ) -> list[Completion]:
        """The step's sampled ids told to the scheduler (``on_output``), the requests it ended out of the worker and
        kept, the output recorded, the host tier's stores of the blocks its growth evicted, the KV events sent;
        the completions handed out."""
        self.stats.preemptions += len(plan.preempted)
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.cache.usable_blocks - self.state.kv.free_blocks)
        self.state, ended = on_output(self.state, sampled, stop).unwrap()
        output_events = self.state.kv_events
        if plan.verify:  # (rows that verified drafts: cut back; a plan verifies only where speculation is on)
            Speculation.cut(self.worker, self.state.kv, plan.verify)
        if ended:  # the engine consistent and the completions kept before anything that may raise
            self.worker.remove([rid for rid, _ in ended])
            gone = [self.requests.pop(rid) for rid, _ in ended]
            if self.overlap is None:  # (overlapped: their last id is read with the next step, which hands them out)
                self.outcomes.finished(gone)
        if self.kv_history is not None:  # (the core's snapshot after every step)
            self.kv_history.append(self.state.kv)
        after = self.state
        self.outcomes.record(lambda r: r.output(sampled, stop, after, ended))
        try:
            if self.host_pages is not None:  # (blocks its growth evicted: saved before the next forward writes them)
                self.host_pages.apply(output_events)
        except BaseException:  # a store that failed after the output: no hit may load what it did not write
            with contextlib.suppress(Exception):
                self._kv_events(scheduled_events + output_events + self._forget_unwritten())
            raise  # (the step's completions kept: has_unfinished() says so until a step hands them out)
        if self.step_times is not None:
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
            self.step_times.append((len(plan.decode), sum(q for _, q in plan.prefill), time.perf_counter() - t0))
        self._kv_events(scheduled_events + output_events + self._forget_unwritten())  # (stores shed: forgotten)
        return self.outcomes.hand_out()

    def _overlapped(
        self,
        overlap: Overlap,
        plan: StepPlan,
        bound: list[Live],
        ids: torch.Tensor | None,
        lps: torch.Tensor | None,
        on_token: Callable[[RequestId, int], None] | None,
    ) -> dict[RequestId, None]:
        """Overlapped: the last step's ids read (this step is queued behind it) and taken; this step's ids left
        in flight, and its samples as ``on_output`` takes them ahead of their ids (those still live)."""
        read = overlap.land()
        if read is not None:
            self._take_read(*read, on_token)
        requests = self.requests
        live = {rid: None for rid, x in zip(plan.samples, bound) if not x.handed_out and requests.get(rid) is x}
        if live and ids is not None:
            overlap.launch(plan, bound, ids, lps)
        return live

    def _take_read(
        self,
        plan: StepPlan,
        bound: tuple[Live, ...],
        tokens: list[int],
        rows: list[Any] | None,
        on_token: Callable[[RequestId, int], None] | None,
    ) -> None:
        """A step's ids, read a step late: taken by the requests still live, told to the scheduler
        (``on_tokens``, which ends those that stopped on them); the completions of those that stopped, and
        of those that ended while these ids were on the device, handed out."""
        sampled, stop = self.outcomes.take(plan, bound, tokens, on_token, self.stats, rows)
        requests = self.requests
        live = {rid: x for rid, x in zip(plan.samples, bound) if requests.get(rid) is x}  # (not ended since)
        running = {rid: tok for rid, tok in sampled.items() if rid in live}
        stops = [rid for rid in stop if rid in live]
        self.state, ended = on_tokens(self.state, running, stops).unwrap()
        after = self.state  # (the recorder may write later: the state this event led to, bound now)
        self.outcomes.record(lambda r: r.tokens(running, stops, after, ended))
        self.worker.remove([rid for rid, _ in ended])
        for rid, _ in ended:
            del requests[rid]
        self.outcomes.finished(x for x in bound if not x.handed_out and requests.get(x.completion.request_id) is not x)
        if self.host_pages is not None:  # (after the ended are out: a store that fails fails this step's requests)
            self.host_pages.apply(after.kv_events)

    def _ended_by_plan(self, plan: StepPlan) -> None:
        """The requests ``schedule`` ended: refused before they ran (the refusal's code and numbers), or, having
        run, unable to grow (past ``max_model_len``, or more than the whole pool holds): ``length``, with their
        text, handed out once their last id is read (overlapped: with the step in flight)."""
        why = {err.request: err.message for err in plan.refusals}
        for rid, how in plan.finished:
            live = self.requests.pop(rid)
            if not live.started:
                self.outcomes.refused(live, how, why.get(rid))
            elif self.overlap is None or not self.overlap.holds(live):
                self.outcomes.finished([live])
            # (else the step in flight holds its last id: handed out when that id is read)

    def _kv_events(self, events: tuple[Any, ...]) -> None:
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)

    def _fail(self, plan: StepPlan, error: BaseException, recorded: bool, drafts: Any = None) -> tuple[Any, ...]:
        """A step that did not complete: each of its requests still live is ended with reason ``error`` (their
        blocks and buffer rows back, blocks cached ahead of the forward taken back; the trace records an
        ``error`` event each), in one change of the state; the tokens they took this step are dropped, the
        fault is in their ``Completion.error``. Never raises on its own account (a request already ended, say
        by a callback's cancel, is left as it is). Returns the cancels' KV events."""
        plan_rids = [*plan.decode, *(rid for rid, _ in plan.prefill), *(rid for rid, _ in plan.verify)]
        lost = [] if self.overlap is None else self.overlap.abandon()  # (sampled for, ids unread)
        ended_unread = [x for x in lost if self.requests.get(x.completion.request_id) is not x]  # (ended meanwhile)
        lost_rids = [x.completion.request_id for x in lost if self.requests.get(x.completion.request_id) is x]
        running = set(self.state.running)  # (a plan's request cancelled, its id taken again by a callback: waiting)
        failed = list(dict.fromkeys([*(rid for rid in plan_rids if rid in running), *lost_rids]))
        state, after, events = self.state, [], []  # type: tuple[Any, list[Any], list[Any]]
        for rid in failed:
            state = cancel(state, rid, "error").unwrap()  # a live request of the pending step: always known
            after.append(state)
            events.extend(state.kv_events)
        planned, self.state = self.state, state
        self.worker.remove([*plan_rids, *failed])
        self.runner.last = None
        self.outcomes.failed([*(self.requests.pop(rid) for rid in failed), *ended_unread], one_line(error))
        if not recorded:
            self.outcomes.record(lambda r: r.schedule(planned, plan, drafts))

        def errors(r: Recorder) -> None:
            for rid, s in zip(failed, after):
                r.error(rid, s)

        self.outcomes.record(errors)
        return tuple(events)

    def _forget_unwritten(self) -> tuple[Any, ...]:
        """The host tier's entries whose store failed, dropped by the core (``forget_host``: no hit loads them);
        their events. Nothing without such slots."""
        pages = self.host_pages
        if pages is None or not pages.unwritten:
            return ()
        slots = sorted(pages.unwritten)
        self.state = forget_host(self.state, slots).unwrap()  # (slots the tier handed out: always taken)
        pages.unwritten.clear()
        after = self.state
        self.outcomes.record(lambda r: r.forget_host(slots, after))
        return self.state.kv_events

    def _fresh_id(self) -> RequestId:
        """``req-N`` for the next N that no live request holds (ids given to ``add_request`` included)."""
        while f"req-{self._next_id}" in self.requests:
            self._next_id += 1
        self._next_id += 1
        return f"req-{self._next_id - 1}"

    # -- the whole-request API -------------------------------------------------------
    def generate(
        self,
        prompts: Iterable[tuple[str, list[int], SamplingParams]],
        on_finish: Callable[[Completion], None] | None = None,
        on_token: Callable[[RequestId, int], None] | None = None,
    ) -> list[Completion]:
        """Serve ``prompts`` (text, ids, params) to the end: their completions, in order (``on_finish`` is called
        with each as it ends, and with any other request's the steps hand out; ``on_token`` with each token as
        ``step``'s is). The requests are named
        ``req-N``, N counting up from the engine's last (a fresh engine: req-0, req-1, ... in order), skipping
        ids live requests hold; all of them are taken, or none (``ShellError``, the engine as it was)."""
        with self._entered("generate"):
            fresh = [(self._fresh_id(), text, ids, params) for text, ids, params in prompts]
            items = [(rid, text, ids, self._checked(rid, params)) for rid, text, ids, params in fresh]
            state = self.state
            for rid, _, ids, params in items:  # all of them are taken, or none (the engine as it was)
                state = self._submitted(state, self._request(rid, self.served_prompt(params, ids), params), params)
            lives = [self._add(rid, text, ids, params, checked=True) for rid, text, ids, params in items]
            while self.has_unfinished():
                for comp in self._step(on_token):
                    if on_finish is not None:
                        on_finish(comp)
            return [x.completion for x in lives]
