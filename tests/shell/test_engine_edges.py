"""Issue 45: no wrong token at the edges. A request id taken again while the old request's last id is still on
the device, a prompt that fills the pool or the model's length exactly, an engine that served many requests,
and two threads in one engine: each case failed before its fix. Every completion is handed out exactly once,
with the tokens a fresh engine gives it, with and without overlap and speculation."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import pytest
import torch

from pagedkv.core.scheduler import sched_canonical
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.models.llama import IdTokenizer, random_llama
from pagedkv.shell.engine import Engine
from pagedkv.shell.errors import EngineBusy
from pagedkv.shell.sampling import SamplingParams
from tests.shell.test_speculative import CFG, NGRAM, _prompts

MODES = [dict(), dict(async_scheduling=True), dict(speculative_config=NGRAM)]
MODE_IDS = ["waiting", "overlap", "speculation"]


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    return random_llama(CFG)


def engine(model: Any, **kw: Any) -> Engine:
    return Engine(model, IdTokenizer(), **{"block_size": 4, "kv_cache_memory_bytes": 1 << 20, **kw})


def alone(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens a fresh engine gives ``prompt`` (greedy)."""
    (c,) = engine(model).generate([("", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))])
    return c.token_ids


def drain(eng: Engine, out: list[Any]) -> None:
    while eng.has_unfinished():
        out += eng.step()


def whole(eng: Engine) -> None:
    """Nothing held: every block and buffer row back, no live request anywhere."""
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks and not eng.worker.rows
    assert not eng.requests and not eng.state.live and check_invariants(eng.state.kv) == []


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_an_id_cancelled_and_taken_again_at_once_starts_clean(model: Any, mode: dict[str, Any]) -> None:
    """Overlap once gave the new ``x`` the old one's token still on the device: 6 tokens for max_tokens 5,
    the first not the model's; and the cancelled completion was never handed out."""
    old, new = _prompts(2, seed=1)
    eng, out = engine(model, **mode), []
    eng.add_request("x", "", old, SamplingParams(temperature=0.0, max_tokens=5))
    for _ in range(3):
        out += eng.step()
    cancelled = eng.cancel("x")
    eng.add_request("x", "", new, SamplingParams(temperature=0.0, max_tokens=5))
    drain(eng, out)
    assert (
        cancelled.finish_reason == "cancelled"
        and cancelled.token_ids == alone(model, old, 5)[: len(cancelled.token_ids)]
    )
    (got,) = out
    assert got is not cancelled and got.token_ids == alone(model, new, 5) and got.finish_reason == "length"
    whole(eng)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_an_id_taken_again_before_its_last_id_is_read_hands_out_both_once(model: Any, mode: dict[str, Any]) -> None:
    """Overlap once lost the old completion (finish_reason None) and handed out the new one twice, the old
    request's last token at its head."""
    old, new = _prompts(2, seed=3)
    eng, out = engine(model, **mode), []
    eng.add_request("y", "", old, SamplingParams(temperature=0.0, max_tokens=2))
    for _ in range(50):  # until the scheduler ended it (overlap: its last id still on the device)
        out += eng.step()
        if "y" not in eng.state.live:
            break
    eng.add_request("y", "", new, SamplingParams(temperature=0.0, max_tokens=3))
    drain(eng, out)
    assert [(c.token_ids, c.finish_reason) for c in out] == [
        (alone(model, old, 2), "length"),
        (alone(model, new, 3), "length"),
    ]
    assert len({id(c) for c in out}) == 2
    whole(eng)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_prompt_that_fills_the_pool_exactly_gives_its_token_and_ends_as_length(
    model: Any, mode: dict[str, Any]
) -> None:
    """It was prefilled, sampled a token, was preempted, then refused UNSCHEDULABLE ("not served") with its
    token counted; now its one token is a length end, as at max_model_len, and nobody is preempted for it."""
    eng = engine(replace_model(model, 4096), kv_cache_memory_bytes=1 << 16, **mode)
    n = 4 * eng.cache.usable_blocks
    prompt = [(7 * i) % 60 + 1 for i in range(n)]
    (c,) = eng.generate([("", prompt, SamplingParams(temperature=0.0, max_tokens=5))])
    assert (c.finish_reason, len(c.token_ids), c.error) == ("length", 1, None) and c.text == str(c.token_ids[0])
    assert eng.stats.preemptions == 0
    (over,) = eng.generate(
        [("", prompt + [1], SamplingParams(temperature=0.0, max_tokens=5))]
    )  # one more: refused before it runs
    assert over.finish_reason == "UNSCHEDULABLE" and over.token_ids == [] and "usable blocks" in (over.error or "")
    whole(eng)


def replace_model(model: Any, max_position: int) -> Any:
    return random_llama(replace(CFG, max_position=max_position))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_prompt_of_exactly_max_model_len_ends_as_length_with_its_text(model: Any, mode: dict[str, Any]) -> None:
    """Overlap once ended it with the scheduler's enum ``FinishReason.INVALID`` and empty text."""
    short = replace_model(model, 32)
    eng = engine(short, **mode)
    prompt = [(3 * i) % 60 + 1 for i in range(32)]
    (c,) = eng.generate([("", prompt, SamplingParams(temperature=0.0, max_tokens=5))])
    (ref,) = engine(short).generate([("", prompt, SamplingParams(temperature=0.0, max_tokens=5))])
    assert type(c.finish_reason) is str and c.finish_reason == "length" and c.error is None
    assert c.token_ids == ref.token_ids and len(c.token_ids) == 1 and c.text == str(c.token_ids[0])
    whole(eng)


@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
def test_an_engine_holds_its_live_requests_only(model: Any, mode: dict[str, Any]) -> None:
    """Engine.requests, the scheduler's record of how each request ended and the engine's prefilled set kept
    every request ever served, and a trace digest sorted all of them at every event. Now an engine that
    served 120 requests holds what a fresh one holds, and the digest's canonical form is a fresh one's."""
    eng = engine(model, max_num_seqs=8, **mode)
    fresh = repr(sched_canonical(eng.state))
    prompts = _prompts(6, seed=9)
    for wave in range(20):
        eng.generate([("", p, SamplingParams(temperature=0.0, max_tokens=3)) for p in prompts])
        if wave == 0:
            after_one = (len(eng.requests), len(eng.state.seqs), len(eng.state.log.slot_of))
    assert after_one == (0, 0, 0) and (len(eng.requests), len(eng.state.seqs), len(eng.state.log.slot_of)) == (0, 0, 0)
    assert not hasattr(eng.state, "finished") and not hasattr(eng.outcomes, "prefilled")
    bare = repr(sched_canonical(eng.state))
    assert len(bare) < len(fresh) + 2000  # (the pool's order and counters differ; no request's history is there)
    assert "req-0" not in bare and "req-119" not in bare


def test_a_second_thread_is_refused_at_once_and_the_first_finishes(model: Any) -> None:
    """Two threads in Engine.generate once gave one an empty UnwrapFailedError and finished its completions
    in the other's loop. Now the second gets EngineBusy at once (nothing of it done), the first completes."""
    eng = engine(model)
    inside, release, results, errors = threading.Event(), threading.Event(), [], []
    prompts = [("", p, SamplingParams(temperature=0.0, max_tokens=4)) for p in _prompts(3, seed=2)]

    def on_finish(_: Any) -> None:
        inside.set()
        release.wait(10)

    def first() -> None:
        results.extend(eng.generate(prompts, on_finish=on_finish))

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    for call in (
        lambda: eng.generate(prompts),
        lambda: eng.step(),
        lambda: eng.add_request("z", "", [1, 2], SamplingParams(temperature=0.0, max_tokens=64)),
        lambda: eng.cancel("req-0"),
    ):
        with pytest.raises(EngineBusy, match="single-threaded"):
            call()
        errors.append(call)
    release.set()
    t.join(30)
    assert len(errors) == 4 and [c.token_ids for c in results] == [alone(model, p, 4) for _, p, _ in prompts]
    assert "z" not in eng.requests
    whole(eng)


def test_a_callback_may_cancel_and_take_the_id_again_on_the_engine_thread(model: Any) -> None:
    """The engine's own thread enters again from a callback (a client that disconnects and retries): the
    cancelled completion is given back by cancel, its token of this step is not the new request's."""
    old, new = _prompts(2, seed=4)
    for mode in MODES[:2]:
        eng, out, given = engine(model, **mode), [], []

        def on_token(rid: Any, tok: int) -> None:
            if rid == "x" and not given:
                given.append(eng.cancel("x"))
                eng.add_request("x", "", new, SamplingParams(temperature=0.0, max_tokens=4))

        eng.add_request("x", "", old, SamplingParams(temperature=0.0, max_tokens=4))
        while eng.has_unfinished():
            out += eng.step(on_token)
        (cancelled,) = given
        assert cancelled.finish_reason == "cancelled" and cancelled.token_ids == alone(model, old, 4)[:1]
        assert [c.token_ids for c in out] == [alone(model, new, 4)], mode
        whole(eng)


class FailingAt:
    """A model whose ``at``-th forward raises ``error`` (0: never); ``calls`` counts them."""

    def __init__(self, model: Any, at: int, error: type[BaseException] = RuntimeError) -> None:
        self.model, self.at, self.calls, self.error = model, at, 0, error
        for name in ("config", "device", "dtype", "kv_layers"):
            setattr(self, name, getattr(model, name))

    def forward(self, *a: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise self.error(f"injected at forward {self.at}")
        return self.model.forward(*a)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_fault_at_every_forward_hands_out_every_completion_once(model: Any, mode: dict[str, Any]) -> None:
    """A fault at each forward of a run that preempts and stops (overlap: with ids in flight; speculation: in
    verify steps): every request is handed out exactly once, one the fault did not end with exactly its
    fault-free tokens, one it ended with a prefix of them; nothing is left held."""
    prompts = [
        (f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=6 + i % 5)) for i, p in enumerate(_prompts(7, seed=12))
    ]
    kw = dict(
        kv_cache_memory_bytes=28 << 10, max_num_seqs=4, max_num_batched_tokens=32, **mode
    )  # (14 blocks: it preempts)

    def serve(at: int) -> tuple[Engine, FailingAt, list[Any]]:
        faulty = FailingAt(model, at)
        eng, out = engine(faulty, **kw), []
        for rid, ids, p in prompts:
            eng.add_request(rid, "", ids, p)
        drain(eng, out)
        return eng, faulty, out

    clean, counted, want = serve(0)
    want_tokens = {c.request_id: c.token_ids for c in want}
    assert clean.stats.preemptions > 0 and sorted(want_tokens) == sorted(r for r, _, _ in prompts)
    for at in range(1, counted.calls + 1):
        eng, _, out = serve(at)
        ids = [c.request_id for c in out]
        assert sorted(ids) == sorted(want_tokens) and len(set(map(id, out))) == len(out), (at, ids)
        failed = [c for c in out if c.finish_reason == "error"]
        assert failed and all(f"injected at forward {at}" in (c.error or "") for c in failed), at
        for c in out:
            want_c = want_tokens[c.request_id]
            assert c.token_ids == (want_c[: len(c.token_ids)] if c.finish_reason == "error" else want_c), (at, c)
        whole(eng)
