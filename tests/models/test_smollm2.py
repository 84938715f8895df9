"""SmolLM2 through pagedkv against transformers, an implementation nobody here wrote.

transformers loads the same GGUF file (about a minute here): one load per test session.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="the reference needs transformers (pip install -e '.[test]')")
from pagedkv.models.gguf import SMOLLM2_FILE, smollm2_path  # noqa: E402

try:
    MODEL_FILE = smollm2_path()
except FileNotFoundError as e:  # pragma: no cover - CI installs it
    pytest.skip(str(e), allow_module_level=True)

from pagedkv.models.llama import Llama  # noqa: E402
from pagedkv.models.tokenizer import Tokenizer  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams

SYSTEM = "You are a concise assistant. Answer in one or two sentences."
PROMPTS = [
    ("What is the capital of France?", None),
    ("Name three primary colors.", SYSTEM),
    ("Write a haiku about the sea.", None),
    ("The history of paged memory begins", "raw"),
]
NEW = 32


@pytest.fixture(scope="session")
def hf() -> tuple[object, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = os.path.dirname(MODEL_FILE)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_FILE)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def ours(smollm2: tuple[Llama, dict[str, object]]) -> tuple[Llama, Tokenizer]:
    model, meta = smollm2
    return model, Tokenizer(meta)  # type: ignore[arg-type]


def prompt_text(tok: Tokenizer, prompt: str, system: str | None) -> str:
    if system == "raw":
        return prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tok.apply_chat_template(messages)


@pytest.fixture(scope="session")
def reference(hf: tuple[object, object], ours: tuple[Llama, Tokenizer]) -> list[list[int]]:
    model, _ = hf
    _, tok = ours
    out = []
    for prompt, system in PROMPTS:
        ids = torch.tensor([tok.encode(prompt_text(tok, prompt, system))])
        with torch.no_grad():
            gen = model.generate(
                ids,
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
                pad_token_id=tok.eos_token_id,
            )
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def engine(ours: tuple[Llama, Tokenizer], **kw: object) -> Engine:
    model, tok = ours
    return Engine(model, tok, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
def test_tokenizer_matches_transformers(hf: tuple[object, object], ours: tuple[Llama, Tokenizer]) -> None:
    _, ref = hf
    _, tok = ours
    for text in [
        "Hello, world!",
        "  spaces  and\ttabs\n",
        "1234567 + 89 = ?",
        "naïve café — ünïcödé ✓",
        "<|im_start|>user\nhi<|im_end|>",
        prompt_text(tok, "What is 12 times 12?", SYSTEM),
    ]:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text  # type: ignore[attr-defined]


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_one_at_a_time_and_batched_with_preemption(
    ours: tuple[Llama, Tokenizer], reference: list[list[int]]
) -> None:
    _, tok = ours
    requests = [
        (t, tok.encode(t), SamplingParams(temperature=0.0, max_tokens=NEW))
        for t in (prompt_text(tok, p, s) for p, s in PROMPTS)
    ]
    for req, ref in zip(requests, reference):
        (c,) = engine(ours, kv_cache_memory_bytes=16 << 20).generate([req])
        assert c.token_ids == ref, (req[0], tok.decode(c.token_ids), tok.decode(ref))
    # all together in a pool of 9 usable 16-token blocks: 4 requests of up to 5 blocks each must preempt
    e = engine(ours, kv_cache_memory_bytes=10 * 737280, enable_prefix_caching=True)
    done = e.generate(requests)
    assert e.stats.preemptions > 0
    assert [c.token_ids for c in done] == reference


@pytest.mark.slow
def test_a_cached_system_prompt_hits_and_gives_the_same_tokens(
    ours: tuple[Llama, Tokenizer], reference: list[list[int]]
) -> None:
    _, tok = ours
    e = engine(ours, kv_cache_memory_bytes=32 << 20)
    first = prompt_text(tok, "How many legs does a spider have?", SYSTEM)
    e.generate([(first, tok.encode(first), SamplingParams(temperature=0.0, max_tokens=4))])
    text = prompt_text(tok, *PROMPTS[1])
    (c,) = e.generate([(text, tok.encode(text), SamplingParams(temperature=0.0, max_tokens=NEW))])
    assert c.cached_tokens >= 16 and e.state.kv.prefix_hits >= 16  # the shared system prompt's blocks
    assert c.token_ids == reference[1]


@pytest.mark.slow
def test_generate_json_contract(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    from pathlib import Path

    from pagedkv.app.cli import main

    p = Path(str(tmp_path)) / "p.jsonl"
    p.write_text(json.dumps({"prompt": "What is the capital of France?", "max_tokens": 12}) + "\n")
    assert main(["generate", "--chat", "--json", "--prompts", str(p), "--max-tokens", "4"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    out = json.loads(line)
    assert set(out) == {"prompt", "text", "token_ids", "finish_reason"}
    assert out["text"].strip() == "The capital of France is Paris." and out["finish_reason"] == "stop"
    assert main(["generate"]) == 2
    capsys.readouterr()
    for flags, says in ((["--kv-cache-memory", "0.5"], "blocks"), (["--block-size", "4096"], "blocks")):  # the model's
        # geometry sizes these: checked once it is loaded, and said the same way
        assert main(["generate", *flags, "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("pagedkv generate: ") and says in err and "\n" not in err, err


@pytest.mark.slow
def test_llm_api_and_a_hugging_face_state_dict(hf: tuple[object, object], ours: tuple[Llama, Tokenizer]) -> None:
    """The whole-request API; and a model built from transformers' own state dict and config gives the same tokens."""
    from pagedkv.app.llm import LLM
    from pagedkv.models.gguf import LlamaConfig

    model, tok = ours
    question = [{"role": "user", "content": "What is the capital of France?"}]
    (r,) = LLM(model, tok, threads=1).chat(question, SamplingParams(temperature=0.0, max_tokens=12))
    (c,) = r.outputs
    assert c.text.strip() == "The capital of France is Paris."
    ref_model, _ = hf
    cfg = LlamaConfig.from_hf_config(ref_model.config.to_dict())  # type: ignore[attr-defined]
    from_hf = Llama(cfg, {k: v.detach() for k, v in ref_model.state_dict().items()})  # type: ignore[attr-defined]
    (r2,) = LLM(from_hf, tok, threads=1).chat(question, SamplingParams(temperature=0.0, max_tokens=12))
    assert r2.outputs[0].token_ids == c.token_ids


@pytest.mark.slow
def test_a_refused_request_leaves_the_engine_as_it_was(ours: tuple[Llama, Tokenizer]) -> None:
    from pagedkv.core import digest
    from pagedkv.shell.errors import ShellError

    model, tok = ours
    eng = Engine(model, tok, kv_cache_memory_bytes=16 << 20)
    before = digest(eng.state.kv)
    bad = SamplingParams(temperature=0.0, max_tokens=4)
    bad.max_tokens = 0  # (refused when built; set in place, refused when added)
    with pytest.raises(ShellError, match="max_tokens"):
        eng.generate([("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4)), ("b", [4], bad)])
    assert not eng.requests and not eng.state.live and digest(eng.state.kv) == before
    with pytest.raises(ShellError, match="UNKNOWN_REQUEST|not"):
        eng.cancel("nobody")
    (done,) = eng.generate([("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))])  # and it still serves
    assert len(done.token_ids) == 4


@pytest.mark.slow
def test_the_incremental_text_is_the_whole_decode(ours: tuple[Llama, Tokenizer], reference: list[list[int]]) -> None:
    """Stop strings are looked for in text grown a token at a time: it equals decoding the whole sequence
    (multi-byte characters split over tokens included), and a stop string ends a request where it appears."""
    from pagedkv.shell.detok import TextSoFar

    _, tok = ours
    for ids in [*reference, tok.encode("café — naïve 日本語 🎉 done.\n\n  x")]:
        text = TextSoFar(tok)
        for t in ids:
            text.push(t)
        assert text.text == tok.decode(ids)
    eng = engine(ours)
    text = prompt_text(tok, *PROMPTS[0])
    (c,) = eng.generate([(text, tok.encode(text), SamplingParams(temperature=0.0, max_tokens=NEW, stop=("Paris",)))])
    assert c.finish_reason == "stop" and "Paris" not in c.text and "Paris" in tok.decode(c.token_ids)


@pytest.mark.slow
def test_llm_takes_a_vllm_scripts_arguments(ours: tuple[Llama, Tokenizer], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46: a single string is one prompt; a params list of another length is a clear error; ``n`` gives n
    sequences seeded ``seed + i``; ``stop`` takes a string; vLLM's prompt dicts; the CLI's thread policy."""
    import pagedkv.app.llm as llm_module
    from pagedkv.app.llm import LLM, RequestOutput

    model, tok = ours
    threads = torch.get_num_threads()
    monkeypatch.setattr(llm_module, "auto_threads", lambda: 1)
    llm = LLM(model, tok)
    assert torch.get_num_threads() == 1  # (threads="auto": the idle CPUs, as `pagedkv generate --threads auto`)
    torch.set_num_threads(threads)
    (one,) = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=3))
    assert isinstance(one, RequestOutput) and one.prompt == "Hello" and len(one.outputs) == 1
    assert len(one.outputs[0].token_ids) == 3 and one.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="1 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(temperature=0.0, max_tokens=2)])
    assert len(llm.generate(["a", "b", "c"], [SamplingParams(temperature=0.0, max_tokens=2)] * 3)) == 3
    (ids,) = llm.generate({"prompt_token_ids": tok.encode("Hello")}, SamplingParams(temperature=0.0, max_tokens=3))
    assert ids.outputs[0].token_ids == one.outputs[0].token_ids
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8)
    (r,) = llm.generate("Once upon a time", params)
    assert [o.index for o in r.outputs] == [0, 1, 2] and len({tuple(o.token_ids) for o in r.outputs}) > 1
    for i, o in enumerate(r.outputs):  # vLLM's rule: the i-th of n draws with seed + i
        (alone,) = llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=5 + i, max_tokens=8))
        assert alone.outputs[0].token_ids == o.token_ids
    (s,) = llm.generate(
        "Count from one to ten: one, two, three,", SamplingParams(temperature=0.0, max_tokens=24, stop="six")
    )
    assert s.outputs[0].finish_reason == "stop" and s.outputs[0].stop_reason == "six" and "six" not in s.outputs[0].text
    assert (
        llm.get_default_sampling_params() == SamplingParams()
    )  # (the GGUF file has no generation_config.json: vLLM's)


@pytest.mark.slow
def test_llm_chat_takes_a_system_prompt_and_earlier_turns(ours: tuple[Llama, Tokenizer]) -> None:
    from pagedkv.app.llm import LLM

    model, tok = ours
    llm = LLM(model, tok, threads=1)
    conv = [
        {"role": "system", "content": "You answer with the name of a city."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And the capital of Italy?"},
    ]
    (c,) = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=12))
    rendered = tok.apply_chat_template(conv)
    assert all(m["content"] in rendered for m in conv) and c.prompt == rendered
    assert c.prompt_token_ids == tok.encode(rendered) and "Rome" in c.outputs[0].text
    both = llm.chat([conv, conv[:2]], SamplingParams(temperature=0.0, max_tokens=12))  # a batch of conversations
    assert both[0].outputs[0].token_ids == c.outputs[0].token_ids and "Paris" in both[1].outputs[0].text


@pytest.mark.slow
def test_repetition_penalty_and_logprobs_equal_transformers(
    hf: tuple[object, object], ours: tuple[Llama, Tokenizer]
) -> None:
    """vLLM's repetition penalty is transformers' (over the prompt's and the output's ids): greedy tokens equal
    token for token; and the logprobs of each token are transformers' raw scores' log-softmax."""
    ref_model, _ = hf
    _, tok = ours
    text = prompt_text(tok, "List the days of the week, then list them again.", None)
    ids = tok.encode(text)
    with torch.no_grad():
        gen = ref_model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW,
            do_sample=False,
            repetition_penalty=1.3,  # type: ignore[attr-defined]
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    want = gen.sequences[0, len(ids) :].tolist()
    raw = [torch.log_softmax(x[0].float(), -1) for x in gen.logits]
    (c,) = engine(ours, kv_cache_memory_bytes=16 << 20).generate(
        [(text, ids, SamplingParams(temperature=0.0, max_tokens=NEW, repetition_penalty=1.3, logprobs=2))]
    )
    assert c.token_ids == want
    plain = engine(ours, kv_cache_memory_bytes=16 << 20).generate(
        [(text, ids, SamplingParams(temperature=0.0, max_tokens=NEW))]
    )[0]
    assert plain.token_ids != want  # (the penalty changed them)
    got = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs or [])]
    assert got == pytest.approx([float(r[t]) for r, t in zip(raw, want)], abs=2e-3)


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers_in_chunks_overlapped_and_beside_a_cached_prefix(
    hf: tuple[object, object], ours: tuple[Llama, Tokenizer]
) -> None:
    """Issue 64: ``prompt_logprobs`` were refused. Each prompt token's logprob given the tokens before it (and the k
    likeliest ids there) is transformers' log-softmax of its logits at the position before, whether the prompt runs
    whole or in 16-token chunks beside other requests, waiting or overlapped; the first token's is None; such a
    request reads no prefix cache (every position computed) and scores each token once; the trace records it
    (``max_hit``) and replays."""
    import io

    from pagedkv.core.verify.trace import replay

    ref_model, _ = hf
    _, tok = ours
    text = prompt_text(tok, "Name three rivers of Europe and say where each one rises.", None)
    ids = tok.encode(text)
    with torch.no_grad():
        logits = ref_model(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]
    want = torch.log_softmax(logits, -1)
    ask = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    for kw in ({}, {"max_num_batched_tokens": 16}, {"max_num_batched_tokens": 16, "async_scheduling": True}):
        trace = io.StringIO()
        eng = engine(ours, kv_cache_memory_bytes=16 << 20, **kw)
        warm = eng.generate([(text, ids, SamplingParams(temperature=0.0, max_tokens=2))])[0]  # (its prefix cached)
        c, other = eng.generate([(text, ids, ask), ("", tok.encode("Hello there"), ask)])
        assert warm.token_ids and c.cached_tokens == 0 and c.prompt_logprobs is not None, kw
        assert len(c.prompt_logprobs) == len(ids) and c.prompt_logprobs[0] is None, kw
        got = [entry[t].logprob for t, entry in zip(ids[1:], c.prompt_logprobs[1:])]  # type: ignore[index]
        assert got == pytest.approx([float(want[p, t]) for p, t in enumerate(ids[1:])], abs=2e-3), kw
        for p, entry in enumerate(c.prompt_logprobs[1:]):  # (the two likeliest ids there, ranked)
            top = sorted((e for e in entry.values() if e.rank <= 2), key=lambda e: e.rank)  # type: ignore[union-attr]
            assert [e.logprob for e in top] == pytest.approx(want[p].topk(2).values.tolist(), abs=2e-3)
        assert other.prompt_logprobs is not None and len(other.prompt_logprobs) == len(other.prompt_token_ids)
    eng = engine(ours, kv_cache_memory_bytes=16 << 20, trace=trace)
    eng.generate([(text, ids, ask)])
    eng.finish_trace()
    assert '"max_hit": 0' in trace.getvalue()
    events = list(replay(trace.getvalue().splitlines(), check=True))
    assert events and all(ev.divergence is None and ev.result["ok"] and not ev.violations for ev in events)
