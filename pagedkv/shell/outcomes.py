"""What the engine gives back of each request and records of the run: the ``Completion`` a caller reads,
the ``Live`` request behind it, the completions kept until ``step()`` hands them out (``Outcomes.outbox``),
their text (a detokenizer's fault never costs the tokens), and the trace (a write that fails stops the
recording, ``trace_error``, never the run)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.errors import RequestId
from pagedkv.core.metadata import Phase
from pagedkv.core.scheduler import FinishReason, StepPlan
from pagedkv.shell.detok import TextSoFar
from pagedkv.shell.recorder import Recorder
from pagedkv.shell.engine_args import EngineStats
from pagedkv.shell.sampling import SamplingParams, cut_at_stop
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


@dataclass(slots=True)
class Live:
    """A request the engine serves: what it gives back, how it samples, its seed, its text so far."""

    completion: Completion
    params: SamplingParams
    seed: int
    text: TextSoFar | None  # kept only for a request with stop strings


class Outcomes:
    """The engine's completions on their way out, and its trace (module docstring)."""

    def __init__(self, tokenizer: Any, recorder: Recorder | None) -> None:
        self.tokenizer, self.recorder = tokenizer, recorder
        self.trace_error: Exception | None = None  # why the trace stopped being written, if it did
        self.outbox: list[Completion] = []  # ended, not yet handed out by step()
        self.before: dict[RequestId, int] = {}  # tokens each sampled request had before this step's (a failed
        # step drops what it took)
        self.prefilled: set[RequestId] = set()  # requests whose first prefill ran (cached_tokens is known)

    def note_prefills(self, plan: StepPlan, requests: Mapping[RequestId, Live]) -> None:
        """A request's first prefill starts where its prefix-cache hit ended: its cached tokens."""
        for meta in plan.metadata:
            if meta.phase is Phase.PREFILL:
                for row in meta.rows:
                    if row.request_id not in self.prefilled:
                        self.prefilled.add(row.request_id)
                        requests[row.request_id].completion.cached_tokens = row.kv_start_pos

    def take(self, plan: StepPlan, tokens: list[int], on_token: Callable[[RequestId, int], None] | None,
             requests: Mapping[RequestId, Live], stats: EngineStats) -> tuple[dict[RequestId, Any], list[RequestId]]:  # fmt: skip
        """The step's sampled ``tokens`` (one a sampled request, one a position of a request that verified drafts,
        in ``plan.samples``' order): each request's token kept (verifying: the drafts it accepted, then its
        next token, as a list), and the requests that stopped on one (a stop token, or a stop string in the
        text so far; a list is cut after it). ``stats`` counts them."""
        got = stats.verified(plan.verify, Speculation.tokens(plan.samples, tokens, dict(plan.verify)))
        self.before = {rid: len(requests[rid].completion.token_ids) for rid in got}
        sampled: dict[RequestId, Any] = {}
        stop: list[RequestId] = []
        stop_ids = self.tokenizer.stop_token_ids
        for rid, toks in got.items():
            live = requests[rid]
            n = 0
            for tok in (toks,) if type(toks) is int else toks:
                n += 1
                live.completion.token_ids.append(tok)
                if on_token is not None:
                    on_token(rid, tok)
                if tok in stop_ids or (live.text is not None and live.text.holds(live.params.stop, live.text.push(tok))):
                    live.completion.finish_reason = "stop"
                    stop.append(rid)
                    break
            sampled[rid] = toks if type(toks) is int else list(toks[:n])  # (a list cut after its stop)
            stats.generated_tokens += n
        return sampled, stop

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

    def finished(self, requests: Mapping[RequestId, Live], rids: list[RequestId]) -> None:
        """Requests that ended (a stop token, else ``max_tokens``): their completions out, with their text."""
        for rid in rids:
            live = requests[rid]
            live.completion.finish_reason = live.completion.finish_reason or "length"
            self.outbox.append(live.completion)
            self.write_text(live)

    def failed(self, requests: Mapping[RequestId, Live], rids: list[RequestId], message: str) -> None:
        """Requests a failed step ended: the tokens they took in it dropped, ``error`` with the fault's line."""
        for rid in rids:
            live = requests[rid]
            comp = live.completion
            del comp.token_ids[self.before.get(rid, len(comp.token_ids)) :]
            self.write_text(live)
            comp.finish_reason, comp.error = "error", message
            self.outbox.append(comp)

    def write_text(self, live: Live) -> None:
        """A completion's text, cut at its stop string; a detokenizer that fails leaves it empty and says so in
        ``error`` (its tokens stand)."""
        comp = live.completion
        try:
            comp.text = cut_at_stop(self.tokenizer.decode(comp.token_ids), live.params.stop)
        except Exception as e:  # noqa: BLE001 - the tokens are the result; the text is a courtesy
            comp.text, comp.error = "", f"the detokenizer failed: {one_line(e)}"

    def refused(self, plan: StepPlan, requests: Mapping[RequestId, Live]) -> None:
        """The requests ``schedule`` itself ended: refused for good by admission, or run into max_model_len."""
        why = {err.request: err.message for err in plan.refusals}
        for rid, how in plan.finished:
            live = requests[rid]
            comp = live.completion
            ran = how == FinishReason.INVALID and comp.token_ids  # an overrun ends a decoding request
            comp.finish_reason = "length" if ran else how  # (the trace keeps the core's reason; vLLM says length)
            if ran:
                self.write_text(live)
            else:  # the refusal that ended it, with its numbers
                comp.text, comp.error = "", why.get(rid)
            self.outbox.append(comp)

def one_line(error: BaseException) -> str:
    """An exception as one line: its type and message (a message that cannot be shown is said so)."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises
        text = "(its message could not be read)"
    text = " ".join(text.split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
