"""Issue 29: no fault leaves a wrong token behind. Every place a step can stop (the forward, an interrupt, a
callback that cancels and then raises, the detokenizer, the KV event listener, the trace writer) is held to
one rule: the core's invariants hold, nothing is leaked, every request the fault did not end gives exactly
its fault-free tokens, and a later request with the same prompt is served as by a clean engine."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from pagedkv.core.verify.invariants import check_invariants
from pagedkv.core.verify.trace import replay
from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams
from tests.shell.handed import keep_handed
from tests.shell.test_engine_edges import FailingAt

CFG = replace(
    SMOLLM2_SHAPES,
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position=48,
)
ARGS = dict(kv_cache_memory_bytes=24 * 1024, max_num_seqs=3, block_size=4, max_num_batched_tokens=16)
PROMPTS = [
    (f"p{i}", [(7 * i + j) % 300 for j in range(5 + 4 * i)], SamplingParams(temperature=0.0, max_tokens=5 + i % 3))
    for i in range(5)
]
AGAIN = [(7 * 4 + j) % 300 for j in range(21)]  # p4's prompt: its blocks were cached ahead when it failed


@pytest.fixture(scope="module")
def tiny() -> Any:
    return random_llama(CFG, seed=11)


class Boom(Exception):
    pass


class Tokenizer(IdTokenizer):
    """Decodes as IdTokenizer, and raises at its ``at``-th decode (0: never)."""

    def __init__(self) -> None:
        self.at, self.calls = 0, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        if self.calls == self.at:
            raise Boom(f"decode {self.at}")
        return super().decode(ids, skip_special_tokens)


def engine(model: Any, tokenizer: Any = None, **kw: Any) -> Engine:
    return keep_handed(Engine(model, tokenizer or IdTokenizer(), caching_point="schedule", **ARGS, **kw))


def run(eng: Engine, on_token: Callable[[Any, int], None] | None = None, prompts: list[Any] = PROMPTS) -> list[Any]:
    """Serve ``prompts`` step by step; whatever a step raises is caught and the loop goes on (a serving loop
    that survives its hooks); the completions handed out, and the exceptions raised."""
    for rid, ids, p in prompts:
        eng.add_request(rid, "", ids, p)
    raised = []
    while eng.has_unfinished() or eng.outcomes.outbox:
        try:
            eng.step(on_token)
        except BaseException as e:  # noqa: BLE001
            raised.append(e)
    return raised


def check(eng: Engine, clean: Engine, model: Any) -> None:
    """The issue's rule: invariants, nothing leaked, untouched requests exact, and the same prompt again
    equal to a clean engine's (tokens and the prefix hit)."""
    assert check_invariants(eng.state.kv) == []
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks and not eng.worker.rows
    assert len(eng.worker.free_rows) == eng.worker.max_rows
    for rid, _, _ in PROMPTS:
        got, want = eng.handed[rid], clean.handed[rid]
        if got.finish_reason in ("error", "cancelled"):
            assert got.token_ids == want.token_ids[: len(got.token_ids)], rid
        else:
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, rid
    (mine,) = eng.generate([("again", AGAIN, SamplingParams(temperature=0.0, max_tokens=6))])
    (theirs,) = clean.generate([("again", AGAIN, SamplingParams(temperature=0.0, max_tokens=6))])
    assert mine.token_ids == theirs.token_ids
    assert mine.cached_tokens <= theirs.cached_tokens


@pytest.fixture(scope="module")
def clean(tiny: Any) -> Engine:
    eng = engine(tiny)
    assert run(eng) == []
    return eng


def test_a_keyboard_interrupt_in_the_forward_leaves_a_consistent_engine_and_no_stale_cache(
    tiny: Any, clean: Engine
) -> None:
    """A KeyboardInterrupt in the forward was not caught: the engine wedged, and under vLLM's caching point the
    only way out (cancel) kept blocks cached ahead whose K/V were never written; a later request with the same
    prompt hit them and gave other tokens. Now the step's requests end with error, the blocks cached ahead are
    taken back, the interrupt is raised again, and the engine serves on."""

    stale = 0
    for at in range(1, 12):
        eng = engine(FailingAt(tiny, at, KeyboardInterrupt))
        for rid, ids, p in PROMPTS:
            eng.add_request(rid, "", ids, p)
        with pytest.raises(KeyboardInterrupt):
            while eng.has_unfinished():
                eng.step()
        eng.step()  # (the interrupted step's completions come out with the next)
        failed = [rid for rid, _, _ in PROMPTS if rid in eng.handed and eng.handed[rid].finish_reason == "error"]
        assert failed and all(eng.handed[r].error.startswith("KeyboardInterrupt") for r in failed)
        prompt = dict((rid, ids) for rid, ids, _ in PROMPTS)[failed[-1]]
        # at once, the interrupted request's prompt again: what the clean engine gives it
        (mine,) = eng.generate([("same", prompt, SamplingParams(temperature=0.0, max_tokens=6))])
        (theirs,) = engine(tiny).generate([("same", prompt, SamplingParams(temperature=0.0, max_tokens=6))])
        assert mine.token_ids == theirs.token_ids, at
        stale += mine.cached_tokens == 0 and len(prompt) > 8  # (a prompt that had blocks cached ahead)
        assert run(eng) == []  # the rest serve on
        check(eng, clean, tiny)
    assert stale > 3  # the cases where cached-ahead blocks would have been hit


def test_a_callback_that_cancels_a_request_of_its_step_and_raises(tiny: Any, clean: Engine) -> None:
    """A client disconnect: the on_token callback cancels its request, then raises. The fault handler once
    cancelled it again and every later step raised UnwrapFailedError."""
    for at in (1, 3, 7):
        eng = engine(tiny)
        seen = [0]

        def on_token(rid: Any, tok: int) -> None:
            seen[0] += 1
            if seen[0] == at:
                eng.cancel(rid)
                raise Boom("client went away")

        assert run(eng, on_token) == []
        ends = {eng.handed[rid].finish_reason for rid, _, _ in PROMPTS}
        assert "cancelled" in ends and "error" in ends or at == 1
        check(eng, clean, tiny)


@pytest.mark.parametrize("at", [1, 2, 5, 9, 14, 20, 30])
def test_a_detokenizer_fault_anywhere(tiny: Any, clean: Engine, at: int) -> None:
    """The detokenizer raising in a stop-string request's step, in the final text of a request, or in the
    fault handler's own decode: the tokens stand, the text says it failed, nothing wedges."""
    tok = Tokenizer()
    eng = engine(tiny, tok)
    prompts = [(rid, ids, replace(p, stop=("zz",))) for rid, ids, p in PROMPTS]  # incremental text on every step
    tok.at = at
    raised = run(eng, prompts=prompts)
    assert raised == []
    assert any("Boom" in (eng.handed[rid].error or "") for rid, _, _ in PROMPTS)
    tok.at = 0
    check(eng, clean, tiny)


def test_a_kv_event_listener_that_raises_loses_no_request(tiny: Any, clean: Engine) -> None:
    """A listener raising after the output once left the ended requests' worker rows held, their completions
    unfinished and never returned, and the trace without its output event. Now the step raises the listener's
    error once the engine is consistent, and its completions come with the next step; the trace replays."""
    for at in (1, 2, 4, 8):
        calls = [0]

        def listener(events: Any) -> None:
            calls[0] += 1
            if calls[0] == at:
                raise Boom("listener")

        trace = io.StringIO()
        eng = engine(tiny, on_kv_events=listener, trace=trace)
        handed: list[Any] = []
        for rid, ids, p in PROMPTS:
            eng.add_request(rid, "", ids, p)
        raised = 0
        while eng.has_unfinished() or eng.outcomes.outbox:
            try:
                handed += eng.step()
            except Boom:
                raised += 1
        assert raised == 1
        eng.finish_trace()
        assert sorted(c.request_id for c in handed) == sorted(rid for rid, _, _ in PROMPTS)
        assert all(c.finish_reason == clean.handed[c.request_id].finish_reason for c in handed)
        assert all(r.divergence is None and not r.violations for r in replay(trace.getvalue().splitlines(), check=True))
        check(eng, clean, tiny)


def test_a_listener_fault_inside_the_fault_handler(tiny: Any, clean: Engine) -> None:
    """A step fails (the forward raises) and the listener raises on the cancels' events: the step's requests
    end with the forward's error, the listener's error is raised, the engine serves on."""

    class Faulty:
        def __init__(self, model: Any) -> None:
            self.model, self.calls = model, 0
            for name in ("config", "device", "dtype", "kv_layers"):
                setattr(self, name, getattr(model, name))

        def forward(self, *a: Any) -> Any:
            self.calls += 1
            if self.calls == 4:
                raise Boom("forward")
            return self.model.forward(*a)

    armed = [False]

    def listener(events: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise Boom("listener")

    model = Faulty(tiny)
    eng = engine(model, on_kv_events=listener)
    original = eng._fail

    def fail(*a: Any) -> Any:
        armed[0] = True
        return original(*a)

    eng._fail = fail  # type: ignore[method-assign]
    raised = run(eng)
    assert [str(e) for e in raised] == ["listener"]
    assert any((eng.handed[rid].error or "").startswith("Boom: forward") for rid, _, _ in PROMPTS)
    check(eng, clean, tiny)


def test_a_trace_that_cannot_be_written_stops_and_the_run_goes_on(tiny: Any, clean: Engine) -> None:
    """A full disk under --trace once raised out of the step and every completion was lost; now the recording
    stops (trace_error says why) and the run completes."""

    class Full(io.StringIO):
        def __init__(self, room: int) -> None:
            super().__init__()
            self.room = room

        def write(self, s: str) -> int:
            self.room -= 1
            if self.room < 0:
                raise OSError(28, "No space left on device")
            return super().write(s)

    for room in (1, 3, 6, 12):
        eng = engine(tiny, trace=Full(room))
        assert run(eng) == []
        assert isinstance(eng.trace_error, OSError) and eng.outcomes.recorder is None
        check(eng, clean, tiny)


def test_sampling_parameters_it_cannot_sample_with_are_refused_at_the_door(tiny: Any) -> None:
    """A seed of 10**30 once reached the sampler and failed the step ("Overflow when unpacking long long"):
    the request ended with error and `generate` exited 0. Now such params are refused when built
    (SamplingError, vLLM's VLLMValidationError, a ValueError); set in place afterwards, as vLLM's params may be,
    they are a ShellError at add_request, and generate takes all of its prompts or none."""
    from pagedkv.core.scheduler import sched_digest
    from pagedkv.shell.errors import ShellError
    from pagedkv.shell.sampling import SamplingError

    eng = engine(tiny)
    before = sched_digest(eng.state)
    for field, value in (
        ("seed", 10**30),
        ("seed", -1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_k", -2),
        ("stop", ("",)),
        ("max_tokens", 10**5000),
        ("max_tokens", 0),
    ):
        with pytest.raises(SamplingError, match=field) as raised:
            SamplingParams(**{field: value})
        assert isinstance(raised.value, ValueError) and raised.value.parameter == field
        bad = SamplingParams(temperature=0.0, max_tokens=64)
        setattr(bad, field, value)  # (vLLM's params are settable in place: the engine checks them again)
        with pytest.raises(ShellError, match="INVALID"):
            eng.add_request("x", "", [1, 2], bad)
        with pytest.raises(ShellError, match="INVALID"):
            eng.generate([("ok", [1, 2], SamplingParams(temperature=0.0, max_tokens=64)), ("bad", [3], bad)])
        assert sched_digest(eng.state) == before and not eng.requests


def plain_loop(eng: Engine, handed: list[Any]) -> list[BaseException]:
    """vLLM's loop, ``while has_unfinished(): step()``, going on after whatever a step raises: what it raised."""
    raised: list[BaseException] = []
    while eng.has_unfinished():
        try:
            handed += eng.step()
        except BaseException as e:  # noqa: BLE001
            raised.append(e)
    return raised


LAST = [
    ("a", list(range(1, 10)), SamplingParams(temperature=0.0, max_tokens=8)),
    ("b", list(range(20, 25)), SamplingParams(temperature=0.0, max_tokens=8)),
]
# (both end on the same step, which fills a's fourth block: that step has KV events)


def kept_back_case(tiny: Any, cause: str, overlap: bool) -> tuple[Engine, type[BaseException]]:
    """Issue 60: the three ways a step raises once the engine has made itself consistent, each on the step that
    ends the last live requests (where ``has_unfinished()`` once said False with their completions kept back): an
    interrupt in the forward, a KV-event listener that raises, a fault after the output (the host tier's copies)."""
    if cause == "interrupt":
        counting = FailingAt(tiny, 0)
        engine(counting, async_scheduling=overlap).generate(LAST)
        return engine(
            FailingAt(tiny, counting.calls, KeyboardInterrupt), async_scheduling=overlap
        ), KeyboardInterrupt  # (the last)
    if cause == "listener":
        eng = engine(tiny, async_scheduling=overlap)

        def listener(events: Any) -> None:
            if not eng.state.live:
                raise Boom("listener")

        eng.on_kv_events = listener
        return eng, Boom
    eng = engine(tiny, enable_prefix_caching=True, kv_offloading_size=1e-5, async_scheduling=overlap)
    pages = eng.host_pages
    assert pages is not None
    real = pages.apply

    def apply(events: Any) -> None:
        if not eng.state.live:  # (the last step's copies after its output)
            raise Boom("a copy after the output")
        real(events)

    pages.apply = apply  # type: ignore[method-assign]
    return eng, Boom


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cause", ["interrupt", "listener", "after-output"])
def test_a_completion_kept_back_is_handed_out_by_the_plain_loop(tiny: Any, cause: str, overlap: bool) -> None:
    """Issue 60: a step that raised after the engine made itself consistent kept its completions "for the next
    call", but ``has_unfinished()`` was already False, so ``while has_unfinished(): step()`` ended without them.
    Now what a step keeps back keeps ``has_unfinished()`` true until a step hands it out: every request is handed
    out exactly once by that loop."""
    eng, error = kept_back_case(tiny, cause, overlap)
    for rid, ids, p in LAST:
        eng.add_request(rid, "", ids, p)
    handed: list[Any] = []
    raised = plain_loop(eng, handed)
    assert [type(e) for e in raised] == [error]
    assert sorted(c.request_id for c in handed) == ["a", "b"]
    assert not eng.has_unfinished() and not eng.outcomes.outbox and not eng.requests
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cause", ["interrupt", "listener", "after-output"])
def test_a_completion_kept_back_from_generate_is_handed_out_by_the_next_call(
    tiny: Any, cause: str, overlap: bool
) -> None:
    """``generate`` raises what its step raised; the completions that step kept back keep ``has_unfinished()`` true,
    and the next ``generate`` (or ``step``) hands them to its ``on_finish``."""
    eng, error = kept_back_case(tiny, cause, overlap)
    with pytest.raises(error):
        eng.generate(LAST)
    got: list[Any] = []
    assert eng.has_unfinished()
    eng.generate([], on_finish=got.append)
    assert sorted(c.request_id for c in got) == ["req-0", "req-1"]
    assert all(c.finish_reason is not None for c in got)
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks and not eng.requests
