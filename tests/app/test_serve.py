"""``pagedkv serve`` (issue 52): OpenAI's API over the engine, with the real ``openai`` client against a server on
loopback (SmolLM2 on the CPU): greedy text equals the engine's own (``pagedkv generate``'s path), streamed equals
not streamed, ``n`` and stop strings, a client gone frees its request's blocks, bad requests answer 400 with
OpenAI's error object, a full queue 503, an engine fault ends only its requests, ``/metrics`` parses."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("starlette", reason="pagedkv serve needs Starlette and uvicorn (pip install 'pagedkv[serve]')")
pytest.importorskip("uvicorn", reason="pagedkv serve needs Starlette and uvicorn (pip install 'pagedkv[serve]')")
openai = pytest.importorskip("openai", reason="the tests talk to the server with the openai client")
httpx = pytest.importorskip("httpx", reason="the tests talk to the server with httpx too")

import uvicorn  # noqa: E402

from pagedkv.app.connections import http_config  # noqa: E402
from pagedkv.app.engine_loop import EngineLoop, Sequence  # noqa: E402
from pagedkv.app.openai_api import OpenAIServer  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams  # noqa: E402

NAME = "SmolLM2-135M-Instruct"


def build_engine(fail_at: frozenset[int] = frozenset(), trace: str | None = None) -> Engine:
    """The served engine, made in the engine's process (``EngineLoop``'s build): SmolLM2 on the CPU; the launches
    numbered in ``fail_at`` raise (a device fault), ``trace`` records the scheduler's inputs."""
    import torch

    from pagedkv.models.llama import Llama
    from pagedkv.models.tokenizer import Tokenizer

    torch.set_num_threads(1)
    model, meta = Llama.smollm2()
    out = open(trace, "w", encoding="utf-8") if trace else None
    engine = Engine(model, Tokenizer(meta), kv_cache_memory_bytes=32 << 20, max_num_seqs=8, trace=out)
    if fail_at:
        real, launches = engine.runner.run, [0]

        def launch(*a: Any) -> Any:
            launches[0] += 1
            if launches[0] in fail_at:
                raise RuntimeError("a device fault")
            return real(*a)

        engine.runner.run = launch  # type: ignore[method-assign]
    return engine


class Served:
    """A server on loopback over an engine in its own process (``build_engine(**build)``); ``url`` its base."""

    def __init__(self, model: Any, tok: Any, *, loop: EngineLoop | None = None, **kw: Any) -> None:
        self.model, self.tok = model, tok
        self.own = loop is None  # (a second server over another's engine leaves it running)
        self.loop = loop or EngineLoop(build_engine, *kw.pop("build", ()), max_waiting=kw.pop("max_waiting", 64))
        if self.own:
            self.loop.start()
        http = {k: kw.pop(k) for k in ("max_connections", "timeout_keep_alive") if k in kw}
        http["read_timeout"] = kw.get("read_timeout", 30.0)
        self.api = OpenAIServer(self.loop, NAME, defaults=SamplingParams(temperature=0.0, max_tokens=16), **kw)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(http_config(self.api.app(), **http))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)

    def client(self, **kw: Any) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if self.own:
            self.loop.close()

    def held(self) -> int:
        """Blocks the engine's requests hold, as its last pass left them."""
        return self.loop.metrics.held_blocks

    def settled(self) -> bool:
        """Nothing live here, nothing held there (polled until so, or 20 s)."""
        deadline = time.time() + 20
        while (self.held() or self.loop.live or self.loop.metrics.requests) and time.time() < deadline:
            time.sleep(0.05)
        return self.held() == 0 and self.loop.live == {} and self.loop.metrics.requests == 0


@pytest.fixture(scope="module")
def served(smollm2: tuple[Any, dict[str, Any]]) -> Iterator[Served]:
    from pagedkv.models.tokenizer import Tokenizer

    model, meta = smollm2
    s = Served(model, Tokenizer(meta))  # type: ignore[arg-type]
    yield s
    assert s.settled()  # (nothing held once every test's requests ended)
    s.close()


def engine_text(served: Served, ids: list[int], params: SamplingParams) -> list[str]:
    """What the engine alone gives (``pagedkv generate``'s path): a fresh engine on the same weights, here."""
    eng = Engine(served.model, served.tok, kv_cache_memory_bytes=32 << 20, max_num_seqs=8)
    from pagedkv.shell.sampling import fan_out

    return [c.text for c in eng.generate([("", ids, p) for p in fan_out(params)])]


def test_greedy_text_is_the_engines_streamed_or_not(served: Served) -> None:
    tok = served.tok
    client = served.client()
    prompt = "The three primary colors are"
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
    want = engine_text(served, tok.encode(prompt), SamplingParams(temperature=0.0, max_tokens=20))
    assert [c.text for c in got.choices] == want and got.usage.prompt_tokens == len(tok.encode(prompt))
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True)
        if c.choices
    ]
    assert "".join(pieces) == want[0] and len([p for p in pieces if p]) > 3  # (incremental, not one piece)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    ids = tok.encode(tok.apply_chat_template(messages))
    assert (
        chat.choices[0].message.content == engine_text(served, ids, SamplingParams(temperature=0.0, max_tokens=24))[0]
    )
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is the "}, {"type": "text", "text": "capital of France?"}],
        }
    ]
    again = client.chat.completions.create(model=NAME, messages=parts, max_tokens=24, temperature=0)  # (text parts)
    assert again.choices[0].message.content == chat.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=24,
            stream=True,
            temperature=0,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens  # (the final usage chunk)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason
    # OpenAI's own streaming example reads chunk.choices[0] of every chunk: without include_usage, no usage chunk
    plain = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, stream=True))
    assert all(c.choices and c.usage is None for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == text


def test_n_seeded_sequences_and_stop_strings(served: Served) -> None:
    tok = served.tok
    client = served.client()
    prompt = "Once upon a time"
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0.9, seed=7, n=3)
    want = engine_text(served, tok.encode(prompt), SamplingParams(max_tokens=16, temperature=0.9, seed=7, n=3))
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want and len(set(want)) > 1
    streamed = ["", "", ""]
    for chunk in client.completions.create(
        model=NAME, prompt=prompt, max_tokens=16, temperature=0.9, seed=7, n=3, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want
    stopped = client.completions.create(model=NAME, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"])
    plain = engine_text(served, tok.encode("1, 2, 3, 4,"), SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert stopped.choices[0].finish_reason == "stop" and " 7" in plain
    assert stopped.choices[0].text == plain[: plain.index(" 7")]
    pieces = client.completions.create(
        model=NAME, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"], stream=True
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices) == stopped.choices[0].text


def test_a_client_gone_cancels_its_request_and_its_blocks_go_back(served: Served) -> None:
    before = served.loop.metrics.finished.get("abort", 0)  # (vLLM's label for a request its client left)
    body = {"model": NAME, "prompt": "Tell me a long story.", "max_tokens": 600, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(3)]  # (a few chunks arrived: the request runs)
        assert served.held() > 0
    assert served.settled()
    assert served.loop.metrics.finished.get("abort", 0) == before + 1
    body["stream"] = False  # (not streamed: the server sees the client gone while it waits)
    try:
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=1.0)
    except httpx.ReadTimeout:
        pass
    assert served.settled() and served.loop.metrics.finished.get("abort", 0) == before + 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "echo": True, "stream": True}, "echo"),  # (served, but not streamed)
        ({"prompt": [1, 2, 10**9]}, None),  # (an id outside the vocabulary: the engine's refusal)
    ],
)
def test_a_bad_request_is_a_400_with_openais_error_object(
    served: Served, body: dict[str, Any], param: str | None
) -> None:
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["param"] == param and err["message"]


def test_malformed_json_and_a_missing_key(served: Served) -> None:
    for raw in (b"{bad", b"[1, 2]", b'{"messages": []}'):
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        r = httpx.post(f"{served.url}{path}", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError, match="temperature must be a finite number >= 0"):
        served.client().completions.create(model=NAME, prompt="x", temperature=-1)
    locked = Served(served.model, served.tok, loop=served.loop, api_key="sesame")  # (the same engine)
    try:
        with pytest.raises(openai.AuthenticationError):
            locked.client(api_key="wrong").models.list()
        assert [m.id for m in locked.client(api_key="sesame").models.list()] == [NAME]
        assert httpx.get(f"{locked.url}/health").status_code == 200  # (health needs no key)
    finally:
        locked.close()


def test_a_full_queue_answers_503_with_a_retry_hint(smollm2: tuple[Any, dict[str, Any]]) -> None:
    """An engine loop not started: what is submitted stays queued; past ``max_waiting`` the answer is 503."""
    import asyncio

    from starlette.testclient import TestClient

    from pagedkv.models.tokenizer import Tokenizer

    loop = EngineLoop(build_engine, max_waiting=2, tokenizer=Tokenizer(smollm2[1]))  # type: ignore[arg-type]
    try:
        loop.submit(
            [
                Sequence(f"q{i}", [1, 2], SamplingParams(temperature=0.0, max_tokens=64), asyncio.new_event_loop())
                for i in range(2)
            ]
        )
        with TestClient(OpenAIServer(loop, NAME).app()) as http:
            r = http.post("/v1/completions", json={"prompt": "x"})
    finally:
        loop.close()
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "full" in r.json()["error"]["message"]
    assert loop.queued == 2  # (the refused request took no place)


@pytest.fixture(scope="module")
def faulty(smollm2: tuple[Any, dict[str, Any]]) -> Iterator[Served]:
    """A server whose engine's 1st and 12th launches raise, taking eight waiting requests at most."""
    from pagedkv.models.tokenizer import Tokenizer

    s = Served(smollm2[0], Tokenizer(smollm2[1]), build=(frozenset({1, 12}),), max_waiting=8)  # type: ignore[arg-type]
    yield s
    s.close()


def test_an_engine_fault_ends_its_requests_and_the_server_serves_on(faulty: Served) -> None:
    r = httpx.post(f"{faulty.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and "a device fault" in r.json()["error"]["message"]
    ok = faulty.client().completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length" and faulty.settled()


def test_metrics_parse_under_vllms_names(served: Served) -> None:
    parser = pytest.importorskip("prometheus_client.parser", reason="the metrics are read with prometheus_client")
    served.client().completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(f"{served.url}/metrics").text
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):  # fmt: skip
        assert name in families, (name, sorted(families))
    ttft = {s.name: s.value for s in families["vllm:time_to_first_token_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"] >= 1
    generated = families["vllm:generation_tokens"].samples[0].value
    assert generated >= 3 and json.loads(httpx.get(f"{served.url}/v1/models").text)["data"][0]["id"] == NAME


def test_the_command_says_a_port_it_cannot_take_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.app.cli import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    finally:
        taken.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pagedkv serve: cannot listen on 127.0.0.1:{port}")
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "two models given" in capsys.readouterr().err
    assert main(["serve", "/nowhere/model.gguf", "--port", "0"]) == 2  # (the engine's process cannot load it)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagedkv serve: ") and "/nowhere/model.gguf" in err[0], err


def test_no_request_lost_or_counted_twice_across_disconnects_faults_and_a_full_queue(faulty: Served) -> None:
    """Thirty clients at once on a server that takes eight waiting: some turned away (503, then tried again), some
    gone mid-stream, one step failed under some. Every request the server took ends exactly once (its finish counted
    once: served, cancelled or failed), every one served got all its tokens, and nothing is held or live after."""
    import asyncio

    s = faulty
    before = dict(s.loop.metrics.finished)
    outcomes: list[str] = []

    async def one(http: Any, k: int) -> None:
        for _ in range(40):  # (turned away: tried again after the hint, as a client would)
            if not await attempt(http, k):
                return
            await asyncio.sleep(0.25)

    async def attempt(http: Any, k: int) -> bool:
        """One try; whether it was turned away."""
        body = {"prompt": f"Count to {k}:", "max_tokens": 6, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with http.stream("POST", f"{s.url}/v1/completions", json=body) as r:
            if r.status_code == 503:
                outcomes.append("turned away")
                return True
            got, tokens = 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcomes.append("failed")
                    return False
                got += 1
                if k % 5 == 0 and got == 2:  # (this client goes away mid-stream)
                    outcomes.append("gone")
                    return False
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            outcomes.append("served" if tokens == 6 else f"short {tokens}")
            return False

    async def all_of_them() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(one(http, k) for k in range(30)))

    asyncio.run(all_of_them())
    assert s.settled()
    taken = sum(o != "turned away" for o in outcomes)
    finished = {k: v - before.get(k, 0) for k, v in s.loop.metrics.finished.items()}
    assert len(outcomes) - outcomes.count("turned away") == 30, outcomes  # (each client's last try was taken)
    assert not [o for o in outcomes if o.startswith("short")], outcomes
    assert {"turned away", "served", "gone", "failed"} <= set(outcomes), outcomes
    assert sum(finished.values()) == taken, (finished, outcomes)  # (each request the server took ended once)
    assert finished.get("length", 0) == outcomes.count("served")


def test_an_engine_process_gone_ends_its_requests_and_the_server_says_so(faulty: Served) -> None:
    """The engine's process killed mid-request (out of memory, say): the request ends with a 500, ``/health``
    answers 503, a new request 500; nothing is left live. The stream's usage counts the tokens it sent (issue 60:
    it said 0 after 22 chunks)."""
    import os
    import signal

    body = {"prompt": "Tell me a long story.", "max_tokens": 600, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream("POST", f"{faulty.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(8)]
        assert all(line.startswith("data: ") or not line for line in first)  # (it runs)
        pid = faulty.loop.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        rest = [line for line in [*first, *lines] if line.startswith("data: ") and line != "data: [DONE]"]
    assert any('"error"' in line and "engine's process ended" in line for line in rest), rest
    chunks = [json.loads(line[6:]) for line in rest if '"error"' not in line]
    sent = max(c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["text"])
    assert sent > 0 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == sent
    assert httpx.get(f"{faulty.url}/health").status_code == 503
    r = httpx.post(f"{faulty.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and "engine's process ended" in r.json()["error"]["message"]
    assert faulty.loop.live == {} and faulty.loop.dead is not None


def test_a_served_runs_trace_replays(smollm2: tuple[Any, dict[str, Any]], tmp_path: Any) -> None:
    """``pagedkv serve --trace``: what the scheduler was given while serving (requests arriving at once, streamed,
    one client gone) replays digest for digest once the server has stopped (its end record written then)."""
    from pagedkv.core.verify.trace import replay
    from pagedkv.models.tokenizer import Tokenizer

    path = str(tmp_path / "served.jsonl")
    s = Served(smollm2[0], Tokenizer(smollm2[1]), build=(frozenset(), path))  # type: ignore[arg-type]
    try:
        client = s.client()
        threads = [
            threading.Thread(target=client.completions.create, kwargs={"model": NAME, "prompt": f"Count to {k}:",
                             "max_tokens": 5, "temperature": 0, "n": 2, "seed": k})
            for k in range(4)
        ]  # fmt: skip
        for t in threads:
            t.start()
        with httpx.stream("POST", f"{s.url}/v1/completions", json={"prompt": "Go on", "max_tokens": 500,
                          "ignore_eos": True, "stream": True}, timeout=30) as r:  # fmt: skip
            next(r.iter_lines())  # (then gone)
        for t in threads:
            t.join()
    finally:
        s.close()
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert sum('"op": "submit"' in line for line in lines) == 9 and any('"op": "cancel"' in line for line in lines)
    events = list(replay(lines))
    assert all(ev.divergence is None for ev in events) and '"op": "end"' in lines[-1]


# -- issue 60: what hostile users and outside clients found ----------------------------------------------------------
def test_a_huge_body_is_a_413_unread_and_a_long_prompt_a_400_before_it_is_tokenized(served: Served) -> None:
    """A 50 MB prompt once stalled every client for ~157 s (parsed and tokenized on the event loop, no limit): now
    a body over the limit is a 413 unread (with a length or sent in chunks), a prompt longer than the longest request
    can be (vLLM's bound: characters over max_model_len times the longest token's) a 400 before it is tokenized."""
    huge = b'{"prompt": "' + b"a" * (50 << 20) + b'"}'
    r = httpx.post(f"{served.url}/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks() -> Iterator[bytes]:  # (no Content-Length: read until it passes the limit)
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * (1 << 20)

    assert httpx.post(f"{served.url}/v1/completions", content=chunks()).status_code == 413
    limit = served.loop.max_model_len
    assert limit is not None and served.api.max_token_chars > 1
    long = "word " * (limit * served.api.max_token_chars // 5 + 10)  # (under the body limit, over the bound)
    encoded: list[int] = []
    real = served.api.tokenizer.encode
    served.api.tokenizer.encode = lambda text: encoded.append(len(text)) or real(text)  # type: ignore[method-assign]
    try:
        r = httpx.post(f"{served.url}/v1/completions", json={"prompt": long}, timeout=30)
    finally:
        served.api.tokenizer.encode = real  # type: ignore[method-assign]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and encoded == []  # (never tokenized)
    assert "maximum context length" in r.json()["error"]["message"]
    r = httpx.post(f"{served.url}/v1/completions", json={"prompt": [1] * (limit + 1)}, timeout=30)
    assert r.status_code == 400 and "exceeds this limit" in r.json()["error"]["message"]
    card = httpx.get(f"{served.url}/v1/models").json()["data"][0]
    assert card["max_model_len"] == limit < 2048  # (what the 32 MiB pool holds for one request, not the model's 8192)
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_a_large_prompt_is_tokenized_off_the_event_loop(served: Served) -> None:
    """While one client's long prompts are tokenized (and refused as too many tokens), the others are answered: the
    tokenizer runs in a worker thread, never on the server's event loop."""
    import asyncio

    text = "the quick brown fox jumps over the lazy dog " * 900  # (39,600 characters: tokenized in a thread)
    threads: list[str] = []
    real = served.api.tokenizer.encode
    served.api.tokenizer.encode = lambda t: threads.append(threading.current_thread().name) or real(t)  # type: ignore[method-assign]
    answered = [0]

    async def both() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            big = asyncio.ensure_future(http.post(f"{served.url}/v1/completions", json={"prompt": [text] * 12}))
            while not big.done():
                assert (await http.get(f"{served.url}/health")).status_code == 200
                answered[0] += 1
                await asyncio.sleep(0.01)
            assert (await big).status_code == 400

    try:
        asyncio.run(both())
    finally:
        served.api.tokenizer.encode = real  # type: ignore[method-assign]
    assert threads and served.thread.name not in threads and answered[0] > 0, (threads, answered)


@pytest.mark.parametrize(
    ("raw", "path", "param"),
    [
        (b'{"prompt": "abc\\ud800def"}', "/v1/completions", "prompt"),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "/v1/chat/completions", "messages"),
        (b'{"prompt": "x", "stop": ["\\ud83d"]}', "/v1/completions", "stop"),
    ],
)
def test_text_that_is_not_unicode_is_a_400(served: Served, raw: bytes, path: str, param: str) -> None:
    r = httpx.post(f"{served.url}{path}", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_every_field_of_vllms_requests_is_served_or_refused_by_name(served: Served) -> None:
    """vLLM's fields were accepted and ignored (a +100 logit bias changed nothing). Now each is served with vLLM's
    meaning or, unless it holds the value meaning it is not used, refused with a 400 naming it."""
    from pagedkv.app.openai_api import NOT_SERVED

    url = f"{served.url}/v1/completions"
    for name, off in NOT_SERVED.items():
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 1, name: {"not": "off"}}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 1, name: off[-1]}, timeout=30)
        assert r.status_code == 200, (name, r.text)
    schema = {"type": "json_schema", "json_schema": {"name": "x"}}  # (structured outputs: tests/app/test_structured.py)
    r = httpx.post(url, json={"prompt": "x", "response_format": schema}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    client = served.client()
    plain = client.completions.create(model=NAME, prompt="The sky is", max_tokens=6, temperature=0)
    biased = client.completions.create(
        model=NAME, prompt="The sky is", max_tokens=6, temperature=0, logit_bias={"1000": 100}
    )
    assert biased.choices[0].text != plain.choices[0].text
    assert biased.choices[0].text == served.tok.decode([1000] * 6)
    first = served.tok.encode(plain.choices[0].text)[0]
    stopped = client.completions.create(
        model=NAME, prompt="The sky is", max_tokens=6, temperature=0, extra_body={"stop_token_ids": [first]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == first
    word = plain.choices[0].text.split()[1]
    kept = client.completions.create(
        model=NAME,
        prompt="The sky is",
        max_tokens=6,
        temperature=0,
        stop=[word],
        extra_body={"include_stop_str_in_output": True, "request_id": "mine"},
    )
    assert kept.choices[0].text.endswith(word) and kept.id == "cmpl-mine"
    r = httpx.post(url, json={"prompt": "x", "model": "gpt-4"}, timeout=30)  # (vLLM's answer for a model not here)
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "The model `gpt-4` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_the_bearer_scheme_in_any_case(served: Served) -> None:
    locked = Served(served.model, served.tok, loop=served.loop, api_key="sesame")
    try:
        for header, status in (("bearer sesame", 200), ("BEARER sesame", 200), ("Bearer sesam", 401),
                               ("Basic sesame", 401), ("sesame", 401), ("", 401)):  # fmt: skip
            r = httpx.get(f"{locked.url}/v1/models", headers={"Authorization": header} if header else {})
            assert r.status_code == status, header
    finally:
        locked.close()


def test_max_waiting_counts_what_would_wait_and_refuses_what_never_fits(served: Served) -> None:
    """``--max-waiting 4``: a burst into an idle server with free rows was refused (requests not yet handed to the
    engine counted as waiting); a request larger than the limit itself got 503 + Retry-After, retried forever. Now
    a burst that the free rows take is taken, and a request of more sequences than may ever wait is a 400."""
    import asyncio

    seats = served.loop.max_num_seqs
    assert served.settled() and seats == 8
    served.loop.max_waiting = 4
    try:

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"prompt": "Hi", "max_tokens": 2}
                rs = await asyncio.gather(*(http.post(f"{served.url}/v1/completions", json=body) for _ in range(12)))
                return [r.status_code for r in rs]

        assert asyncio.run(burst()) == [200] * 12  # (8 rows free, 4 may wait)
        r = httpx.post(f"{served.url}/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "retry-after" not in r.headers
    finally:
        served.loop.max_waiting = 64
    assert served.settled()


def test_slow_clients_are_closed_and_idle_connections_make_room(served: Served) -> None:
    """Connections that never finished their request were never timed out (21,000 of them exhausted the descriptors
    and /health stopped answering). Now a request head not sent within the read timeout closes its connection, a
    body not sent within it is a 408, and past the connection cap the longest idle connection makes room."""
    guarded = Served(served.model, served.tok, loop=served.loop, read_timeout=1.0, max_connections=20)
    host, port = "127.0.0.1", int(guarded.url.rsplit(":", 1)[1])
    try:
        half = socket.create_connection((host, port))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # (its head never ends)
        half.settimeout(10)
        assert half.recv(100) == b""  # (closed by the server after its read timeout of 1 s)
        slow = socket.create_connection((host, port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        slow.settimeout(5)
        assert b" 408 " in slow.recv(200).split(b"\r\n")[0]
        idle = [socket.create_connection((host, port)) for _ in range(40)]  # (past the cap of 20)
        time.sleep(0.3)
        assert httpx.get(f"{guarded.url}/health", timeout=5).status_code == 200
        closed = 0
        for s in idle:
            s.settimeout(3)
            try:
                closed += s.recv(1) == b""
            except (TimeoutError, ConnectionResetError):
                closed += 0
        assert closed >= 20, closed  # (the idle ones made room: at most 20 held)
        for s in (half, slow, *idle):
            s.close()
    finally:
        guarded.close()


def test_a_client_that_writes_its_whole_oversized_body_first_reads_the_413(served: Served) -> None:
    """A client sending a 50 MB body whole before it reads (httpx, requests) sometimes got a reset connection
    instead of the 413 (the server closed on unread bytes: a flaky test under load). Now the rest of a refused body
    is read and dropped (``openai_api.LINGER_S``, ``LINGER_BYTES``) before the answer; a client that declares a
    huge body and sends nothing more still gets its 413 within the linger's bound, and nothing stalls meanwhile."""
    from pagedkv.app.openai_api import LINGER_S

    host, port = "127.0.0.1", int(served.url.rsplit(":", 1)[1])
    body = b'{"prompt": "' + b"a" * (40 << 20) + b'"}'
    for _ in range(3):
        with socket.create_connection((host, port)) as c:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            c.sendall(head.encode() + body)  # (all of it before reading: a reset would raise here or below)
            c.settimeout(10)
            assert b" 413 " in c.recv(200).split(b"\r\n")[0]
    with socket.create_connection((host, port)) as stalled:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n{")
        assert httpx.get(f"{served.url}/health", timeout=5).status_code == 200  # (others served meanwhile)
        stalled.settimeout(LINGER_S + 30)  # (past the bound the recv raises: the linger never waits on the client)
        assert b" 413 " in stalled.recv(200).split(b"\r\n")[0]


def test_serve_refuses_to_start_when_the_pool_cannot_hold_max_model_len(capsys: pytest.CaptureFixture[str]) -> None:
    """/v1/models advertised 8,192 tokens where the pool held 5,808. Asked for more than the pool holds, the
    command refuses to start (vLLM's rule), in one line; not asked, it advertises what fits (above)."""
    from pagedkv.app.cli import main

    args = ["serve", "--port", "0", "--max-model-len", "8192", "--kv-cache-memory-bytes", str(32 << 20)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-model-len 8192 is more than the KV cache holds" in err[0], err


def test_logprobs_in_openais_shapes_and_the_chat_template_fields(served: Served) -> None:
    """Issue 64: the server refused ``logprobs``, which the library serves. Completions take ``logprobs: k``
    (tokens, token_logprobs, top_logprobs, text_offset), chat ``logprobs: true`` with ``top_logprobs`` (content:
    token, logprob, bytes, top_logprobs), each the engine's own logprobs; with ``stream`` they are a 400 naming
    them; ``chat_template``, ``chat_template_kwargs`` and ``continue_final_message`` reach the template."""
    ids = served.tok.encode("The sky is")
    eng = Engine(served.model, served.tok, kv_cache_memory_bytes=32 << 20, max_num_seqs=8)
    own = eng.generate([("", ids, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))])[0]
    r = httpx.post(f"{served.url}/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                         "logprobs": 2}, timeout=60).json()  # fmt: skip
    lp = lp_whole = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [own.logprobs[i][t].decoded_token for i, t in enumerate(own.token_ids)]
    own_values = [own.logprobs[i][t].logprob for i, t in enumerate(own.token_ids)]
    assert lp["token_logprobs"] == pytest.approx(own_values, abs=1e-4)  # (another process's threads: float order)
    assert all(len(top) == 2 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    client = served.client()
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)  # (greedy: its token is the likeliest)
    streamed = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                              temperature=0, logprobs=True, top_logprobs=3, stream=True)  # fmt: skip
    pieces = [item for c in streamed if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [(p.token, p.logprob) for p in pieces] == [(c.token, c.logprob) for c in content]  # (as whole, in chunks)
    text = ""
    tokens: list[str] = []
    for c in client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0, logprobs=2, stream=True):
        lp = c.choices[0].logprobs
        if lp is not None:
            assert lp.text_offset == [len(text) + sum(map(len, lp.tokens[:j])) for j in range(len(lp.tokens))]
            tokens += lp.tokens
        text += c.choices[0].text
    assert tokens == lp_whole["tokens"] and text == r["choices"][0]["text"]
    for body, param in (
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r2 = httpx.post(f"{served.url}{path}", json=body, timeout=30)
        assert r2.status_code == 400 and r2.json()["error"]["param"] == param, r2.text
    template = "{% for m in messages %}<{{ m['role'] }}|{{ m['content'] }}>{% endfor %}{{ extra }}"
    kept = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}],
        max_tokens=2,
        temperature=0,
        extra_body={"chat_template": template, "chat_template_kwargs": {"extra": "!"},
                    "add_generation_prompt": False},
    )  # fmt: skip
    prompt = "<user|Hi><assistant|Hello, I am>!"
    assert kept.usage.prompt_tokens == len(served.tok.encode(prompt))
    going = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}],
        max_tokens=2,
        temperature=0,
        extra_body={"chat_template": template, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert going.usage.prompt_tokens == len(served.tok.encode("<user|Hi><assistant|Hello, I am"))


def test_prompt_logprobs_and_echo_as_vllm_serves_them(served: Served) -> None:
    """Issue 64: ``echo`` and ``prompt_logprobs`` were refused. vLLM's ``prompt_logprobs`` field gives each prompt
    token's ``{id: {logprob, rank, decoded_token}}`` (the first null), the engine's own; ``echo`` puts the prompt's
    text before the completion's and, with ``logprobs``, the prompt's tokens before its tokens (the first's null)."""
    ids = served.tok.encode("The sky is blue because")
    eng = Engine(served.model, served.tok, kv_cache_memory_bytes=32 << 20, max_num_seqs=8)
    own = eng.generate([("", ids, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1))])[0]
    url = f"{served.url}/v1/completions"
    r = httpx.post(url, json={"prompt": ids, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 1}, timeout=60)
    choice = r.json()["choices"][0]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    assert [got[i][str(t)]["logprob"] for i, t in enumerate(ids) if i] == pytest.approx(
        [own.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i],
        abs=1e-4,  # type: ignore[index]
    )
    r = httpx.post(url, json={"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1},
                   timeout=60).json()["choices"][0]  # fmt: skip
    prompt_text = served.tok.decode(ids)
    assert r["text"].startswith(prompt_text) and r["text"] == prompt_text + choice["text"]
    lp = r["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == r["text"] and lp["text_offset"][len(ids)] == len(prompt_text)
    for body, param in (
        ({"prompt": "x", "echo": True, "stream": True}, "echo"),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r2 = httpx.post(f"{served.url}{path}", json=body, timeout=30)
        assert r2.status_code == 400 and r2.json()["error"]["param"] == param, r2.text
