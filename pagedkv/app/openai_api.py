"""OpenAI's HTTP API over an ``EngineLoop`` (``pagedkv serve``; ``pip install 'pagedkv[serve]'``: Starlette and
uvicorn, as vLLM's server stands on). What a client of vLLM's server sends is read with vLLM's meaning:

- ``POST /v1/completions`` (``prompt``: a string, token ids, or a list of either) and ``POST /v1/chat/completions``
  (``messages`` through the model's chat template), streamed as server-sent events (``stream``: incremental text,
  then a chunk with the finish reason, a usage chunk, ``data: [DONE]``) or not; ``n``, ``stop``, ``seed``,
  ``temperature``, ``top_p``, ``max_tokens`` (``max_completion_tokens``), ``presence_penalty`` and
  ``frequency_penalty``, and vLLM's extra ``top_k``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``;
  a field the request leaves out takes the server's default (its flags, its generation config).
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, vLLM's metric names).

A bad request answers 400 with OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``); a
missing or wrong key (``--api-key``) 401; a full queue 503 with ``Retry-After``; an engine fault that ended a
request 500 (the server serves on); an engine whose process has ended 500, and ``/health`` 503 (vLLM's answer). A
client that goes away cancels its request: its blocks go back at the next pass between steps."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pagedkv.app.engine_loop import EngineDead, EngineLoop, Histogram, QueueFull, Sequence
from pagedkv.shell.outcomes import Completion
from pagedkv.shell.sampling import SamplingParams, fan_out, params_problem

RETRY_AFTER_S = 1
FIELDS = {  # the request's field -> SamplingParams' (vLLM's names; max_completion_tokens is the chat API's newer)
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "n": "n",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error(status: int, message: str, param: str | None = None, kind: str = "BadRequestError") -> JSONResponse:
    """OpenAI's error object (the shape vLLM's server answers with)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class OpenAIServer:
    """The routes over ``loop``; ``defaults``: the sampling fields a request leaves out."""

    def __init__(
        self, loop: EngineLoop, model_name: str, *, defaults: SamplingParams | None = None, api_key: str | None = None
    ) -> None:
        self.loop, self.model_name, self.api_key = loop, model_name, api_key
        self.defaults = defaults if defaults is not None else SamplingParams(max_tokens=16, temperature=1.0)
        self.tokenizer = loop.tokenizer
        self.created = int(time.time())

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self._guarded(self.completions), methods=["POST"]),
                Route("/v1/chat/completions", self._guarded(self.chat), methods=["POST"]),
                Route("/v1/models", self._guarded(self.models), methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ]
        )

    def _guarded(self, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def guarded(request: Request) -> Response:
            if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return error(401, "a missing or wrong API key", kind="AuthenticationError")
            try:
                return await handler(request)  # type: ignore[no-any-return]
            except BadRequest as e:
                return error(400, str(e), e.param)
            except QueueFull as e:
                response = error(503, f"the server is full: {e}; retry later", kind="ServiceUnavailableError")
                response.headers["Retry-After"] = str(RETRY_AFTER_S)
                return response
            except EngineDead as e:
                return error(500, str(e), kind="InternalServerError")

        return guarded

    # -- the routes -----------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.loop.dead is not None else 200)

    async def models(self, request: Request) -> Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedkv",
                "max_model_len": self.loop.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        prompts = self._prompts(body.get("prompt"))
        return await self._serve(request, body, prompts, chat=False)

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
        turns = [
            {"role": m.get("role"), "content": _content(m.get("content"))} for m in messages if isinstance(m, dict)
        ]
        if len(turns) != len(messages) or any(not isinstance(t["role"], str) or t["content"] is None for t in turns):
            raise BadRequest(
                "each message must be an object with a string role and content: a string, or text parts "
                '([{"type": "text", "text": ...}])',
                "messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(turns)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        return await self._serve(request, body, [list(self.tokenizer.encode(text))], chat=True)

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(prometheus(self.loop, self.model_name), media_type="text/plain; version=0.0.4")

    # -- reading a request ----------------------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(
                f"the model {model!r} is not served here (this server serves {self.model_name!r})", "model"
            )
        if "stream" in body and type(body["stream"]) is not bool:
            raise BadRequest("stream must be true or false", "stream")
        for name, off in (("logprobs", (None, False)), ("top_logprobs", (None, 0)), ("echo", (None, False)),
                          ("best_of", (None, 1, body.get("n", 1))), ("tools", (None, [])), ("suffix", (None, ""))):  # fmt: skip
            if body.get(name) not in off:
                raise BadRequest(f"{name} is not served by pagedkv serve", name)
        return body

    def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [list(self.tokenizer.encode(prompt))]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return [q for p in prompt for q in self._prompts(p)]
        raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")

    def _params(self, body: dict[str, Any]) -> SamplingParams:
        given = {FIELDS[k]: v for k, v in body.items() if k in FIELDS and v is not None}
        try:
            params = replace(self.defaults, **given)
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e)) from None
        problem = params_problem(params)
        if problem is not None:
            name = problem.split(" ", 1)[0]
            raise BadRequest(problem, next((k for k, f in FIELDS.items() if f == name and k in body), name))
        return params

    # -- serving it -------------------------------------------------------------------------------------------------
    async def _serve(self, request: Request, body: dict[str, Any], prompts: list[list[int]], chat: bool) -> Response:
        params = self._params(body)
        loop = asyncio.get_running_loop()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        per_prompt = fan_out(params)
        seqs = [
            Sequence(f"{rid}-{i}-{j}", ids, p, loop) for i, ids in enumerate(prompts) for j, p in enumerate(per_prompt)
        ]
        self.loop.submit(seqs)
        try:
            first = [await s.events.get() for s in seqs]
        except asyncio.CancelledError:
            self.loop.cancel([s.rid for s in seqs])
            raise
        refused = next((e for e in first if e[0] == "refused"), None)
        if refused is not None:
            raise BadRequest(refused[1])
        usage = {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0, "total_tokens": 0}
        if body.get("stream"):
            stream = self._stream(request, rid, seqs, chat, usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        return Awaited(self._whole(rid, seqs, chat, usage), lambda: self.loop.cancel([s.rid for s in seqs]))

    async def _whole(self, rid: str, seqs: list[Sequence], chat: bool, usage: dict[str, int]) -> Response:
        done: list[Completion] = []
        for s in seqs:
            while True:
                event = await s.events.get()
                if event[0] == "done":
                    done.append(event[1])
                    break
        failed = next((c for c in done if c.finish_reason not in ("stop", "length")), None)
        if failed is not None:
            status = 500 if failed.finish_reason in ("error", "cancelled") else 400
            return error(status, f"the request ended with {failed.finish_reason}: {failed.error or ''}".rstrip(": "),
                         kind="InternalServerError" if status == 500 else "BadRequestError")  # fmt: skip
        usage["completion_tokens"] = sum(len(c.token_ids) for c in done)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        choices = [
            {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
            if chat
            else {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for i, c in enumerate(done)
        ]  # fmt: skip
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                             "choices": choices, "usage": usage})  # fmt: skip

    async def _stream(
        self, request: Request, rid: str, seqs: list[Sequence], chat: bool, usage: dict[str, int]
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(i: int, text: str | None, finish: str | None = None, role: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": i, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}
            return sse({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]})

        finished: set[int] = set()
        pending: dict[asyncio.Future[tuple[Any, ...]], int] = {}
        try:
            if chat:
                for i in range(len(seqs)):
                    yield chunk(i, None, role=True)
            pending = {asyncio.ensure_future(s.events.get()): i for i, s in enumerate(seqs)}
            while pending:
                ready, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in ready:
                    i = pending.pop(task)
                    event = task.result()
                    text = ""
                    while event[0] == "text":  # (what has arrived since: one chunk)
                        text += event[1]
                        if seqs[i].events.empty():
                            break
                        event = seqs[i].events.get_nowait()
                    if text:
                        yield chunk(i, text)
                    if event[0] == "text":
                        pending[asyncio.ensure_future(seqs[i].events.get())] = i
                        continue
                    c: Completion = event[1]
                    finished.add(i)
                    usage["completion_tokens"] += len(c.token_ids)
                    if c.finish_reason not in ("stop", "length"):
                        yield sse({"error": {"message": f"the request ended with {c.finish_reason}: {c.error or ''}",
                                             "type": "InternalServerError", "param": None, "code": 500}})  # fmt: skip
                    if event[2]:
                        yield chunk(i, event[2])
                    yield chunk(i, None, c.finish_reason if c.finish_reason in ("stop", "length") else "abort")
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            yield sse({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                       "usage": usage})  # fmt: skip
            yield "data: [DONE]\n\n"
        finally:  # (the client gone: the generator closed before its end; what did not finish is cancelled)
            for task in pending:
                task.cancel()
            unfinished = [s.rid for i, s in enumerate(seqs) if i not in finished]
            if unfinished:
                self.loop.cancel(unfinished)


class Awaited(Response):
    """A response not streamed, made once ``made`` completes, while the client is listened to: a client that goes
    away before then cancels the making (``gone``: its requests cancelled) and is sent nothing."""

    def __init__(self, made: Coroutine[Any, Any, Response], gone: Callable[[], None]) -> None:
        super().__init__()
        self.made, self.gone = made, gone

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        result: list[Response] = []

        async def make() -> None:
            result.append(await self.made)
            tg.cancel_scope.cancel()

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone()
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(make)
            tg.start_soon(listen)
        if result:
            await result[0](scope, receive, send)


def _content(content: Any) -> str | None:
    """A message's text: a string, or OpenAI's content parts when every one is text (joined); None otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        texts = [p.get("text") for p in content]
        return "".join(texts) if all(isinstance(t, str) for t in texts) else None
    return None


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def prometheus(loop: EngineLoop, model_name: str) -> str:
    """``/metrics``: the engine's figures in Prometheus' text format under vLLM's names (each with its
    ``model_name`` label)."""
    m, label = loop.metrics, f'model_name="{model_name}"'
    lines: list[str] = []

    def one(name: str, kind: str, help_: str, value: float, extra: str = "") -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.append(f"{name}{{{label}{extra}}} {value}")

    one("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", m.running)
    one("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", m.waiting + loop.queued)
    one("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", m.kv_usage)
    one("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
        m.prefix_queries)  # fmt: skip
    one("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
        m.prefix_hits)  # fmt: skip
    one("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", m.preemptions)
    one("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", m.prompt_tokens)
    one("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", m.generation_tokens)
    name = "vllm:request_success_total"
    lines.extend([f"# HELP {name} Count of finished requests, by finish reason.", f"# TYPE {name} counter"])
    for reason, n in sorted(m.finished.items()):
        lines.append(f'{name}{{{label},finished_reason="{reason}"}} {n}')
    with m.lock:
        for hname, h, help_ in (
            ("vllm:time_to_first_token_seconds", m.ttft, "Histogram of time to first token in seconds."),
            ("vllm:inter_token_latency_seconds", m.itl, "Histogram of inter-token latency in seconds."),
            ("vllm:e2e_request_latency_seconds", m.e2e, "Histogram of e2e request latency in seconds."),
        ):
            lines.extend(_histogram(hname, h, help_, label))
    return "\n".join(lines) + "\n"


def _histogram(name: str, h: Histogram, help_: str, label: str) -> list[str]:
    out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    counts = h.counts
    cumulative = 0
    for bound, n in zip([*h.buckets, math.inf], counts):
        cumulative += n
        le = "+Inf" if bound == math.inf else repr(float(bound))
        out.append(f'{name}_bucket{{{label},le="{le}"}} {cumulative}')
    out.append(f"{name}_sum{{{label}}} {h.total}")
    out.append(f"{name}_count{{{label}}} {h.count}")
    return out
