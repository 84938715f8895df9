"""Issue 46: vLLM's sampling parameters in the engine. Penalties, ``min_tokens``, ``ignore_eos`` and ``logprobs``
give the same tokens (and logprobs) waiting, overlapped and speculating, batched and alone; ``stop`` takes a
string or any sequence; a request is one sequence (``n`` is ``LLM``'s)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from pagedkv.models.llama import IdTokenizer, random_llama
from pagedkv.shell.engine import Engine
from pagedkv.shell.errors import ShellError
from pagedkv.shell.sampling import SamplingError, SamplingParams, params_problem
from tests.shell.test_speculative import CFG, NGRAM, _prompts

MODES = {"waiting": {}, "overlap": {"async_scheduling": True}, "speculation": {"speculative_config": NGRAM}}


class StopAt(IdTokenizer):  # stop ids the random model samples now and then
    stop_token_ids = frozenset({7, 19, 33})
    eos_token_id = 7


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    return random_llama(CFG)


def served(model: Any, params: list[SamplingParams], mode: str, tok: Any = None, alone: bool = False) -> list[Any]:
    prompts = _prompts(len(params), seed=21)
    items = [(f"p{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))]
    if alone:
        return [served_one(model, item, mode, tok) for item in items]
    eng = Engine(
        model, tok or IdTokenizer(), block_size=4, kv_cache_memory_bytes=1 << 20, max_num_seqs=8, **MODES[mode]
    )
    done = eng.generate(items)
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks and not eng.requests
    return done


def served_one(model: Any, item: Any, mode: str, tok: Any) -> Any:
    eng = Engine(model, tok or IdTokenizer(), block_size=4, kv_cache_memory_bytes=1 << 20, **MODES[mode])
    (c,) = eng.generate([item])
    return c


PENALIZED = [
    SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=2.5),
    SamplingParams(temperature=0.0, max_tokens=24, presence_penalty=1.2),
    SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.7),
    SamplingParams(max_tokens=24, temperature=0.8, seed=3, repetition_penalty=0.9, frequency_penalty=-0.5),
    SamplingParams(temperature=0.0, max_tokens=24),
    SamplingParams(max_tokens=24, temperature=1.1, seed=9, presence_penalty=-1.0),
]


def test_penalties_give_the_same_tokens_in_every_mode_batched_and_alone(model: Any) -> None:
    want = [c.token_ids for c in served(model, PENALIZED, "waiting")]
    plain = [
        c.token_ids
        for c in served(
            model, [SamplingParams(max_tokens=24, temperature=p.temperature, seed=p.seed) for p in PENALIZED], "waiting"
        )
    ]
    assert all(w != p for w, p, q in zip(want, plain, PENALIZED) if q.penalized)  # (they change the tokens)
    assert want[4] == plain[4]  # (a row without penalties beside them: as it was)
    for mode in MODES:
        assert [c.token_ids for c in served(model, PENALIZED, mode)] == want, mode
    assert [c.token_ids for c in served(model, PENALIZED, "overlap", alone=True)] == want


def test_min_tokens_holds_back_every_stop_and_ignore_eos_runs_to_max_tokens(model: Any) -> None:
    sampled = [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(6)]
    base = [c.token_ids for c in served(model, sampled, "waiting", StopAt())]
    early = [len(t) for t in base if len(t) < 30]
    assert early and min(early) < 6  # (the model stops early without them)
    params = [replace(p, min_tokens=6) for p in sampled[:3]] + [replace(p, ignore_eos=True) for p in sampled[3:]]
    for mode in MODES:
        done = served(model, params, mode, StopAt())
        for c, p in zip(done, params):
            assert not set(c.token_ids[: p.min_tokens]) & StopAt.stop_token_ids, (mode, c.token_ids)
            if p.ignore_eos:
                assert len(c.token_ids) == 30 and c.finish_reason == "length", (mode, c)
            else:
                assert len(c.token_ids) >= 6 and (
                    c.finish_reason == "length" or c.token_ids[-1] in StopAt.stop_token_ids
                )
        assert any(set(c.token_ids) & StopAt.stop_token_ids for c in done[3:])  # (ignored, and went on)
        if mode == "waiting":
            want = [c.token_ids for c in done]
        assert [c.token_ids for c in done] == want, mode


def test_stop_reason_names_the_stop_string_or_id(model: Any) -> None:
    (c,) = served(model, [SamplingParams(max_tokens=30, temperature=1.0, seed=0)], "waiting", StopAt())
    assert c.finish_reason == "stop" and c.stop_reason == (None if c.token_ids[-1] == 7 else c.token_ids[-1])
    text = IdTokenizer().decode(c.token_ids[:4])
    (s,) = served(model, [SamplingParams(max_tokens=30, temperature=1.0, seed=0, stop=text[-3:])], "waiting")
    assert s.finish_reason == "stop" and s.stop_reason == text[-3:] and text[-3:] not in s.text


def test_logprobs_of_each_token_in_every_mode(model: Any) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(max_tokens=12, temperature=0.9, seed=4, logprobs=0),
    ]
    got = {mode: served(model, params, mode) for mode in MODES}
    for mode, done in got.items():
        a, b, c = done
        assert b.logprobs is None and len(a.logprobs) == len(a.token_ids) and len(c.logprobs) == len(c.token_ids)
        for tok, entry in zip(a.token_ids, a.logprobs):
            assert entry[tok].rank == 1 and len(entry) == 3  # greedy: its token is the most likely (one of the 3)
            assert [x.rank for x in entry.values()] == [1, 2, 3] and entry[tok].decoded_token == str(tok)
        assert all(set(e) == {t} for t, e in zip(c.token_ids, c.logprobs))  # logprobs=0: the token's own only
        assert a.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(a.token_ids, a.logprobs)))
        for x, y in zip(done, got["waiting"]):
            assert x.token_ids == y.token_ids, mode
            if x.logprobs is not None:
                assert [e[t].logprob for t, e in zip(x.token_ids, x.logprobs)] == pytest.approx(
                    [e[t].logprob for t, e in zip(y.token_ids, y.logprobs)], abs=1e-4
                ), mode


def test_stop_takes_a_string_or_any_sequence_and_the_rest_is_checked(model: Any) -> None:
    assert SamplingParams(temperature=0.0, max_tokens=64, stop="five").stop == ("five",) and SamplingParams(
        temperature=0.0, max_tokens=64, stop=["a", "b"]
    ).stop == ("a", "b")
    assert (
        SamplingParams(temperature=0.0, max_tokens=64, stop=None).stop == ()
        and params_problem(SamplingParams(temperature=0.0, max_tokens=64, stop=["a", "b"])) is None
    )
    for fields, says in (
        (dict(temperature=0.0, max_tokens=64, stop={"a"}), "stop"),
        (dict(temperature=0.0, max_tokens=64, stop=[""]), "stop"),
        (dict(temperature=0.0, max_tokens=64, n=0), "n must"),
        (dict(temperature=0.0, max_tokens=64, repetition_penalty=0), "repetition_penalty"),
        (dict(temperature=0.0, max_tokens=64, presence_penalty=3), "presence_penalty"),
        (dict(temperature=0.0, max_tokens=64, frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(temperature=0.0, max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(temperature=0.0, max_tokens=64, ignore_eos=1), "ignore_eos"),
        (dict(temperature=0.0, max_tokens=64, logprobs=21), "logprobs"),
        (dict(temperature=0.0, max_tokens=64, logprobs=True), "logprobs"),
    ):
        with pytest.raises(SamplingError, match=says):  # (refused when built: vLLM's VLLMValidationError)
            SamplingParams(**fields)  # type: ignore[arg-type]
    eng = Engine(model, IdTokenizer(), block_size=4, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ShellError, match="n=2: a request here is one sequence"):
        eng.add_request("x", "", [1, 2], SamplingParams(temperature=0.0, max_tokens=64, n=2))
    assert not eng.requests and not eng.state.live


def test_logit_bias_stop_token_ids_and_the_stop_string_kept_in_every_mode(model: Any) -> None:
    """Issue 60: ``logit_bias``, ``stop_token_ids`` and ``include_stop_str_in_output`` were taken by the server and
    ignored. A +100 bias makes greedy pick its id; a request's own stop id ends it (``stop_reason`` the id, not
    before ``min_tokens``, whatever ``ignore_eos``); a stop string kept stays in the text; in every mode."""
    plains = served(
        model, [SamplingParams(temperature=0.0, max_tokens=8)] * 5, "waiting"
    )  # (each row's prompt: its tokens plain)
    other = next(t for t in range(5, 50) if all(t not in c.token_ids for c in plains))
    text = IdTokenizer().decode(plains[3].token_ids[:3])
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, logit_bias={other: 100.0}),
        SamplingParams(temperature=0.0, max_tokens=8, logit_bias={other: 100.0}, stop_token_ids=[other]),
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            logit_bias={other: 100.0},
            stop_token_ids=[other],
            min_tokens=3,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0.0, max_tokens=8, stop=text[-2:], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=8, logit_bias={other: 99.0, plains[4].token_ids[0]: 100.0}),
    ]
    for mode in MODES:
        biased, stopped, held, kept, two = served(model, params, mode)
        assert biased.token_ids == [other] * 8, mode
        assert stopped.token_ids == [other] and (stopped.finish_reason, stopped.stop_reason) == ("stop", other)
        assert len(held.token_ids) == 4 and other not in held.token_ids[:3] and held.token_ids[3] == other, mode
        assert kept.finish_reason == "stop" and kept.text.endswith(text[-2:]) and kept.stop_reason == text[-2:]
        assert two.token_ids == [plains[4].token_ids[0]] * 8, mode  # (the larger bias wins)
    for fields, says in (
        (dict(temperature=0.0, max_tokens=64, logit_bias={1: 101.0}), "logit_bias"),
        (dict(temperature=0.0, max_tokens=64, logit_bias={-1: 1.0}), "logit_bias"),
        (dict(temperature=0.0, max_tokens=64, stop_token_ids=[-3]), "stop_token_ids"),
        (dict(temperature=0.0, max_tokens=64, include_stop_str_in_output=1), "include_stop_str_in_output"),
    ):
        with pytest.raises(SamplingError, match=f"^{says}"):
            SamplingParams(**fields)  # type: ignore[arg-type]
    eng = Engine(model, IdTokenizer(), block_size=4, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ShellError, match="logit_bias' token id"):
        eng.add_request(
            "x", "", [1, 2], SamplingParams(temperature=0.0, max_tokens=64, logit_bias={CFG.vocab_size: 1.0})
        )
