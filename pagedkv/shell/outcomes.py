"""What the engine gives back of each request and records of the run: the ``Completion`` a caller reads,
the ``Live`` request behind it, the completions kept until ``step()`` hands them out (``Outcomes.outbox``),
their text (a detokenizer's fault never costs the tokens), and the trace (a write that fails stops the
recording, ``trace_error``, never the run)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from pagedkv.core.errors import RequestId
from pagedkv.core.outputs.metadata import Phase
from pagedkv.core.scheduler import FinishReason, StepPlan
from pagedkv.shell.detok import TextSoFar
from pagedkv.shell.recorder import Recorder
from pagedkv.shell.structured import Constrained
from pagedkv.shell.engine_args import EngineStats
from pagedkv.shell.sampling import Logprob, SamplingParams, cut_at_stop
from pagedkv.shell.speculative import Speculation


@dataclass(slots=True)
class Completion:
    request_id: RequestId
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated (a stop token included, as HF does)
    text: str = ""
    finish_reason: str | None = None  # stop | length | cancelled | error | UNSCHEDULABLE ...
    cached_tokens: int = 0
    error: str | None = None  # why it ended unserved: a failed step's exception (finish_reason "error"), or the
    # core's refusal (UNSCHEDULABLE, INVALID: "request 'req-0' needs 600 blocks; the pool has 363 ..."), one line
    # SamplingParams(logprobs=k): each token's own and the k most likely ids' logprobs (vLLM's shape), and their sum
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None  # the stop string or stop id that ended it (None: the model's eos token)
    # SamplingParams(prompt_logprobs=k): each prompt token's logprobs given those before it (vLLM's shape: the
    # first token's None), filled as the prompt's chunks are computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(slots=True)
class Live:
    """A request the engine serves: what it gives back, how it samples, its seed, its text so far. Tokens in
    flight (overlapped scheduling) and completions on their way out hold this record, never its id: an id
    is taken again as soon as its request has ended."""

    completion: Completion
    params: SamplingParams
    seed: int
    text: TextSoFar | None  # kept only for a request with stop strings
    started: bool = False  # its first prefill ran: its cached tokens are known, and an end by the plan is "length"
    handed_out: bool = False  # its completion left the engine (step's return, or cancel's): nothing more joins it
    stop_from: int = 0  # the text before it is exempt from stop strings (what came before min_tokens)
    constraint: Constrained | None = None  # its grammar's matcher (structured outputs), advanced by each token


class Outcomes:
    """The engine's completions on their way out, and its trace (module docstring)."""

    def __init__(self, tokenizer: Any, recorder: Recorder | None) -> None:
        self.tokenizer, self.recorder = tokenizer, recorder
        self.trace_error: Exception | None = None  # why the trace stopped being written, if it did
        self.outbox: list[Completion] = []  # ended, not yet handed out by step()
        self.before: dict[RequestId, int] = {}  # tokens each sampled request had before this step's (a failed
        # step drops what it took)
        self.cancels = 0  # completions the caller's cancels gave back (a callback's, inside ``take``, included)

    @staticmethod
    def note_prefills(plan: StepPlan, requests: Mapping[RequestId, Live]) -> None:
        """A request's first prefill starts where its prefix-cache hit ended: its cached tokens."""
        for meta in plan.metadata:
            if meta.phase is Phase.PREFILL:
                for row in meta.rows:
                    live = requests[row.request_id]
                    if not live.started:
                        live.started = True
                        live.completion.cached_tokens = row.kv_start_pos

    def take(
        self,
        plan: StepPlan,
        bound: Sequence[Live],
        tokens: list[int],
        on_token: Callable[[RequestId, int], None] | None,
        stats: EngineStats,
        logprobs: list[list[float]] | None = None,
    ) -> tuple[dict[RequestId, Any], list[RequestId]]:
        """The step's sampled ``tokens`` (one a sampled request, one a position of a request that verified drafts,
        in ``plan.samples``' order; ``bound``: the requests they were sampled for, in that order) and, where any
        request asked them, their ``logprobs`` rows (``sampling.token_logprobs``): each request's token kept
        (verifying: the drafts it accepted, then its next token, as a list), and the requests that stopped on
        one (a stop token, or a stop string in the text so far, once it has ``min_tokens``; a list is cut after
        it). A request whose completion was handed out (cancelled, even by ``on_token`` in this loop) takes
        nothing and is left out of both. ``stats`` counts them."""
        verify = dict(plan.verify)
        got = stats.verified(plan.verify, Speculation.tokens(plan.samples, tokens, verify))
        self.before = {rid: len(live.completion.token_ids) for rid, live in zip(plan.samples, bound)}
        sampled: dict[RequestId, Any] = {}
        stop: list[RequestId] = []
        stop_ids, eos = self.tokenizer.stop_token_ids, getattr(self.tokenizer, "eos_token_id", None)
        cancels, row = self.cancels, 0
        for rid, live in zip(plan.samples, bound):
            first, row = row, row + 1 + len(verify.get(rid, ()))  # (its logprob rows: one a position)
            if live.handed_out:
                continue
            toks = got[rid]
            n = 0
            for tok in (toks,) if type(toks) is int else toks:
                n += 1
                live.completion.token_ids.append(tok)
                if logprobs is not None and live.params.logprobs is not None:
                    self._logprob(live, tok, logprobs[first + n - 1])
                if on_token is not None:
                    on_token(rid, tok)
                extra = cast("tuple[int, ...]", live.params.stop_token_ids)  # (a tuple once made)
                stop_id = tok in stop_ids or (bool(extra) and tok in extra)
                if (stop_id or live.text is not None) and self._stopped(live, tok, stop_id, eos):
                    live.completion.finish_reason = "stop"
                    stop.append(rid)
                    break
                if live.constraint is not None and live.constraint.accept(tok):  # (its grammar ends with it)
                    live.completion.finish_reason = "stop"
                    stop.append(rid)
                    break
            sampled[rid] = toks if type(toks) is int else list(toks[:n])  # (a list cut after its stop)
            stats.generated_tokens += n
        if self.cancels != cancels:  # a callback cancelled a request it had already taken: it takes nothing
            kept = {rid for rid, live in zip(plan.samples, bound) if not live.handed_out}
            sampled = {rid: t for rid, t in sampled.items() if rid in kept}
            stop = [rid for rid in stop if rid in kept]
        return sampled, stop

    @staticmethod
    def _stopped(live: Live, tok: int, stop_id: bool, eos: int | None) -> bool:
        """Does ``tok`` end ``live``: a stop id (unless ``ignore_eos``) or a stop string in the text it added,
        once the completion holds ``min_tokens`` (the text before is exempt); ``stop_reason`` says which."""
        p, text, comp = live.params, live.text, live.completion
        stops = cast("tuple[str, ...]", p.stop)  # (a tuple once made)
        hit = text is not None and text.holds(stops, text.push(tok))
        if len(comp.token_ids) < p.min_tokens:
            live.stop_from = len(text.text) if text is not None else 0
            return False
        if stop_id and (not p.ignore_eos or tok in cast("tuple[int, ...]", p.stop_token_ids)):
            comp.stop_reason = None if tok == eos else tok
            return True
        if hit and text is not None:
            comp.stop_reason = next((s for s in stops if s in text.text[live.stop_from :]), None)
        return hit

    def _logprob(self, live: Live, tok: int, values: list[float]) -> None:
        comp, k = live.completion, live.params.logprobs or 0
        entry = Logprob.rows(values, tok, k, self.tokenizer.decode)
        if comp.logprobs is None:
            comp.logprobs = []
        comp.logprobs.append(entry)
        comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + entry[tok].logprob

    def hand_out(self) -> list[Completion]:
        """The completions kept since the last step that returned, in the order they ended."""
        done, self.outbox = self.outbox, []
        return done

    def record(self, write: Callable[[Recorder], object]) -> None:
        """Trace lines, unless the trace cannot be written: then the recording stops (``trace_error`` says why)
        and the engine serves on; a trace is a record of the run, never a reason to lose one."""
        if self.recorder is None:
            return
        try:
            write(self.recorder)
        except Exception as e:  # noqa: BLE001 - a full disk, a closed stream: the run goes on without its trace
            self.recorder, self.trace_error = None, e

    def out(self, live: Live) -> Completion:
        """``live``'s completion leaves the engine: into the outbox, or (``cancelled``) to the caller. Once."""
        live.handed_out = True
        return live.completion

    def finished(self, lives: Iterable[Live]) -> None:
        """Requests that ended (a stop token, else ``max_tokens`` or the length the pool or model allows): their
        completions out, with their text."""
        for live in lives:
            live.completion.finish_reason = live.completion.finish_reason or "length"
            self.write_text(live)
            self.outbox.append(self.out(live))

    def failed(self, lives: Iterable[Live], message: str) -> None:
        """Requests a failed step ended: the tokens they took in it dropped, ``error`` with the fault's line."""
        for live in lives:
            comp = live.completion
            keep = self.before.get(comp.request_id, len(comp.token_ids))
            del comp.token_ids[keep:]
            if comp.logprobs is not None:
                del comp.logprobs[keep:]
                comp.cumulative_logprob = sum(d[t].logprob for d, t in zip(comp.logprobs, comp.token_ids))
            self.write_text(live)
            comp.finish_reason, comp.error = "error", message
            self.outbox.append(self.out(live))

    def cancelled(self, live: Live) -> Completion:
        """A request the caller cancelled: its completion as it stands, reason ``cancelled``, given back now."""
        live.completion.finish_reason = "cancelled"
        self.write_text(live)
        self.cancels += 1
        return self.out(live)

    def write_text(self, live: Live) -> None:
        """A completion's text, cut at its stop string; a detokenizer that fails leaves it empty and says so in
        ``error`` (its tokens stand)."""
        comp = live.completion
        try:
            p = live.params
            if not p.detokenize:  # (vLLM's detokenize=False: the ids alone)
                comp.text = ""
                return
            comp.text = cut_at_stop(
                self.tokenizer.decode(comp.token_ids, skip_special_tokens=p.skip_special_tokens),
                cast("tuple[str, ...]", p.stop),
                live.stop_from,
                p.include_stop_str_in_output,
            )
        except Exception as e:  # noqa: BLE001 - the tokens are the result; the text is a courtesy
            comp.text, comp.error = "", f"the detokenizer failed: {one_line(e)}"

    def refused(self, live: Live, how: FinishReason, why: str | None) -> None:
        """A request ``schedule`` ended before it ran: refused for good by admission (``how``: the code, ``why``:
        the refusal with its numbers). One that ran and then could not grow is ``finished`` (``length``)."""
        comp = live.completion
        comp.finish_reason, comp.text, comp.error = str(how), "", why
        self.outbox.append(self.out(live))


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and message (a message that cannot be shown is said so)."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises
        text = "(its message could not be read)"
    text = " ".join(text.split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
