"""Issue 65: structured outputs on SmolLM2 (JSON schemas, choices, regexes, grammars) through ``LLM``, the engine
with overlap and n-gram drafts, the trace, and the server with OpenAI's client; every answer parses and validates
against its schema (jsonschema), every choice and regex matches."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

xgrammar = pytest.importorskip("xgrammar", reason="structured outputs need the structured extra (xgrammar)")
jsonschema = pytest.importorskip("jsonschema", reason="the schemas' oracle")

from pagedkv import LLM, SamplingParams, VLLMValidationError  # noqa: E402
from pagedkv.sampling_params import StructuredOutputsParams  # noqa: E402

pytestmark = pytest.mark.slow

SCHEMAS: list[dict[str, Any]] = [
    {  # optional fields, a bounded integer
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 40},
        },
        "required": ["name", "age"],
    },
    {  # a nested object
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
                },
                "required": ["name", "population"],
            },
            "country": {"type": "string", "maxLength": 40},
        },
        "required": ["city", "country"],
    },
    {  # an array with bounds
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3}
        },
        "required": ["colors"],
    },
    {  # an enum and a bounded number
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["sentiment", "confidence"],
    },
    {  # an array of enums, an optional number
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "genres": {
                "type": "array",
                "items": {"enum": ["drama", "comedy", "action", "science fiction"]},
                "maxItems": 4,
            },
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["title", "year", "genres"],
    },
]
ASKS = [
    "Describe a famous scientist as JSON.",
    "Tell me about a big city as JSON.",
    "List some colors of the rainbow as JSON.",
    "Is the review 'I loved every minute of it' positive? Answer as JSON.",
    "Describe a well known movie as JSON.",
]


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def llm(smollm2: tuple[Any, dict[str, Any]]) -> LLM:
    from pagedkv.models.tokenizer import Tokenizer

    model, meta = smollm2
    return LLM(model, Tokenizer(meta), threads=2, max_num_seqs=16)  # type: ignore[arg-type]


def test_every_answer_parses_and_validates_against_its_schema_greedy_and_sampled(llm: LLM) -> None:
    convs, params, schemas = [], [], []
    for schema, ask in zip(SCHEMAS, ASKS):
        for temperature, seed in ((0.0, None), (0.8, 1), (0.8, 2)):
            convs.append(chat(ask))
            params.append(
                SamplingParams(
                    temperature=temperature,
                    seed=seed,
                    max_tokens=160,
                    structured_outputs=StructuredOutputsParams(json=schema),
                )
            )
            schemas.append(schema)
    outs = llm.chat(convs, params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_choices_regexes_grammars_and_any_json_object_match(llm: LLM) -> None:
    cases = [
        (
            chat("Is 'what a waste of time' positive or negative?"),
            StructuredOutputsParams(choice=["positive", "negative"]),
        ),
        (chat("Give me a phone number."), StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}")),
        (chat("What is 12 times 12?"), StructuredOutputsParams(grammar='root ::= "The answer is " [0-9]+ "."')),
        (chat("Describe a dog as JSON."), StructuredOutputsParams(json_object=True)),
        (chat("Describe a cat as JSON."), StructuredOutputsParams(json=SCHEMAS[0], disable_any_whitespace=True)),
    ]
    outs = llm.chat([c for c, _ in cases], [SamplingParams(temperature=0, max_tokens=96, structured_outputs=s)
                                            for _, s in cases], use_tqdm=False)  # fmt: skip
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("positive", "negative")
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", texts[1]), texts[1]
    assert re.fullmatch(r"The answer is [0-9]+\.", texts[2]), texts[2]
    assert isinstance(json.loads(texts[3]), dict)
    assert " " not in texts[4].replace(json.loads(texts[4])["name"], "") and "\n" not in texts[4]
    jsonschema.validate(json.loads(texts[4]), SCHEMAS[0])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_a_grammar_the_model_cannot_finish_ends_with_length(llm: LLM) -> None:
    so = StructuredOutputsParams(regex=r"[0-9]{40}")  # (SmolLM2 spells a number a digit a token)
    (out,) = llm.generate("Count:", SamplingParams(temperature=0, max_tokens=6, structured_outputs=so), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 6 and re.fullmatch(r"[0-9]{6}", c.text), c.text


def test_a_constraint_that_cannot_compile_is_refused_before_anything_runs(llm: LLM) -> None:
    for bad, why in (
        (StructuredOutputsParams(regex="(a"), "regex cannot be compiled"),
        (StructuredOutputsParams(grammar="root ::= missing"), "grammar cannot be compiled"),
        (StructuredOutputsParams(json='{"type": "object", "properties": 3}'), "json cannot be compiled"),
    ):
        with pytest.raises(VLLMValidationError, match=why):
            llm.generate(["a", "b"], SamplingParams(structured_outputs=bad), use_tqdm=False)
        assert not llm.engine.has_unfinished() and not llm.engine.requests
    with pytest.raises(VLLMValidationError, match="one kind of constraint"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(VLLMValidationError, match="no field"):
        SamplingParams(structured_outputs={"jsonn": {}})
    with pytest.raises(VLLMValidationError, match="whitespace_pattern is not served"):
        StructuredOutputsParams(json={}, whitespace_pattern=r"\s*")


def test_overlap_and_ngram_drafts_give_the_same_tokens_and_the_trace_records_the_constraint(
    smollm2: tuple[Any, dict[str, Any]],
) -> None:
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.engine import Engine

    model, meta = smollm2
    tok = Tokenizer(meta)
    schemas = SCHEMAS[:3]  # (three of the five: the three runs of this test are the module's longest)
    prompts = [tok.apply_chat_template(chat(a), True) for a in ASKS[: len(schemas)]]
    params = [
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=s))
        for s in schemas
    ] + [SamplingParams(temperature=0, max_tokens=32)]  # (one unconstrained beside them)
    prompts.append(prompts[0])

    engines = []

    def run(**kw: Any) -> list[list[int]]:
        eng = Engine(model, tok, kv_cache_memory_bytes=32 << 20, max_num_seqs=8, **kw)
        out = [c.token_ids for c in eng.generate([(p, tok.encode(p), q) for p, q in zip(prompts, params)])]
        eng.finish_trace()
        engines.append(eng)
        return out

    trace = io.StringIO()
    plain = run(trace=trace)
    assert run(async_scheduling=True) == plain
    assert run(speculative_config={"method": "ngram", "num_speculative_tokens": 3}) == plain
    assert engines[-1].stats.accepted_tokens > 0  # (drafts the grammar let through were verified and taken)
    submits = [json.loads(line) for line in trace.getvalue().splitlines() if '"submit"' in line]
    recorded = {s["request"]: s.get("structured_outputs") for s in submits}  # (a held request enters once compiled)
    assert [recorded[f"req-{i}"] for i in range(len(params))] == [{"json": s} for s in schemas] + [None]

    from pagedkv.core.verify.trace import replay

    assert all(ev.divergence is None and ev.result["ok"] for ev in replay(trace.getvalue().splitlines()))


# -- the server ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(smollm2: tuple[Any, dict[str, Any]]) -> Iterator[Any]:
    from pagedkv.models.tokenizer import Tokenizer
    from tests.app.test_serve import Served

    model, meta = smollm2
    s = Served(model, Tokenizer(meta))
    yield s
    assert s.settled()
    s.close()


def test_the_server_keeps_to_response_format_and_structured_outputs_streamed_too(served: Any) -> None:
    client = served.client()
    for schema, ask in zip(SCHEMAS, ASKS):
        got = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=chat(ask),
            max_tokens=160,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
        )
        jsonschema.validate(json.loads(got.choices[0].message.content), schema)
        assert got.choices[0].finish_reason == "stop"
    pieces = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=chat("Describe a dog as JSON."),
        max_tokens=96,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in pieces if c.choices)), dict)
    got = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="The weather today is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
    )
    assert got.choices[0].text in ("sunny", "rainy")


def test_the_server_answers_400_for_a_constraint_that_cannot_compile(served: Any) -> None:
    import openai

    client = served.client()
    for body in (
        {"structured_outputs": {"regex": "(a"}},
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}},
            }
        },
        {"response_format": {"type": "xml"}},
    ):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="SmolLM2-135M-Instruct", prompt="a", max_tokens=4, extra_body=body)


def test_compiled_grammars_are_kept_by_text_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's clients may send a new schema with every request: the compiled ones kept are bounded, the least
    recently asked going first; one asked again is ready at once."""
    import pagedkv.shell.structured as structured
    from pagedkv.models.gguf import load_tokenizer_meta
    from pagedkv.models.tokenizer import Tokenizer

    monkeypatch.setattr(structured, "KEPT", 3)
    grammars = structured.Grammars(Tokenizer(load_tokenizer_meta()), 49152)
    for n in range(1, 7):
        grammars.compile(StructuredOutputsParams(regex=f"a{{{n}}}")).result()
        grammars.compile(StructuredOutputsParams(regex="a{1}")).result()  # (kept: asked again each time)
    assert sorted(key[1] for key in grammars._compiled) == ["a{1}", "a{5}", "a{6}"]
    assert grammars.compile(StructuredOutputsParams(regex="a{6}")).done()
