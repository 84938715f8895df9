"""OpenAI's HTTP API over an ``EngineLoop`` (``pagedkv serve``; ``pip install 'pagedkv[serve]'``: Starlette and
uvicorn, as vLLM's server stands on). What a client of vLLM's server sends is read with vLLM's meaning:

- ``POST /v1/completions`` (``prompt``: a string, token ids, or a list of either) and ``POST /v1/chat/completions``
  (``messages`` through the model's chat template), streamed as server-sent events (``stream``: incremental text,
  then a chunk with the finish reason, a usage chunk where ``stream_options.include_usage`` asks it (in every
  chunk with ``continuous_usage_stats``), ``data: [DONE]``) or not; ``n``, ``stop``, ``stop_token_ids``,
  ``include_stop_str_in_output``, ``seed``, ``temperature``, ``top_p``, ``max_tokens`` (``max_completion_tokens``),
  ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, and vLLM's extra ``top_k``, ``min_tokens``,
  ``repetition_penalty``, ``ignore_eos``, ``request_id``, ``add_generation_prompt``; a field the request leaves
  out takes the server's default (its flags, its generation config). Every other field of vLLM's requests is
  refused (400, naming it) unless it holds the value that means it is not used (``NOT_SERVED``); a field vLLM
  does not know is passed over, as vLLM does.
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, vLLM's metric names and labels).

A bad request answers 400 with OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``), a model
not served 404 (vLLM's), a body over ``max_request_bytes`` 413 and one not sent within ``read_timeout`` 408; a
missing or wrong key (``--api-key``: ``Authorization: Bearer KEY``, the scheme in any case, compared in constant
time) 401; a queue too full 503 with ``Retry-After``, and a request that could never be queued 400; an engine
fault that ended a request 500 (the server serves on); an engine whose process has ended 500, and ``/health`` 503
(vLLM's answer). A prompt is checked against the longest request before it is tokenized (vLLM's bound: characters
over ``max_model_len`` times the longest token's), bodies are parsed and prompts tokenized off the event loop where
they are large, so that one client's request never stalls the others. A client that goes away cancels its request:
its blocks go back at the next pass between steps."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
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

from pagedkv.app.args import MAX_REQUEST_BYTES, READ_TIMEOUT_S
from pagedkv.app.engine_loop import EngineDead, EngineLoop, Histogram, NeverTaken, QueueFull, Sequence
from pagedkv.shell.outcomes import Completion
from pagedkv.shell.sampling import MAX_LOGPROBS, Logprob, SamplingError, SamplingParams, fan_out

RETRY_AFTER_S = 1
OFF_LOOP_BYTES = (
    16 << 10
)  # a body, a prompt or a conversation this large is parsed or tokenized off the event loop (~10 ms)
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
    "stop_token_ids": "stop_token_ids",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "logit_bias": "logit_bias",
    "min_p": "min_p",
    "skip_special_tokens": "skip_special_tokens",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
    "allowed_token_ids": "allowed_token_ids",
    "prompt_logprobs": "prompt_logprobs",
}
# vLLM's request fields (its CompletionRequest and ChatCompletionRequest) that pagedkv serve does not serve, each with
# the values that mean it is not used (a request may send those: clients send their defaults); any other value is a
# 400 naming the field, never a field taken and ignored.
NOT_SERVED: dict[str, tuple[Any, ...]] = {
    "logprob_token_ids": (None,),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "reasoning_effort": (None,),
    "thinking_token_budget": (None,),
    "include_reasoning": (None, True, False),
    "use_beam_search": (None, False),
    "watermarking": (None, False),
    "length_penalty": (None, 1, 1.0),
    "spaces_between_special_tokens": (None, True),
    "truncation_side": (None, "left", "right"),
    "bad_words": (None, []),
    "prompt_embeds": (None,),
    "priority": (None, 0),
    "session_id": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "return_weight_versions": (None, False),
    "routed_experts_prompt_start": (None, 0),
    "return_token_offsets": (None, False),
    "return_prompt_text": (None, False),
    "mm_payload": (None,),
    "return_mm_kwargs": (None, False),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
    "vllm_xargs": (None,),
    "repetition_detection": (None,),
    "stream_interval": (None, 1),
    "documents": (None,),
    "media_io_kwargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
}


def _constraint(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's structured outputs as ``StructuredOutputsParams``' fields: vLLM's ``structured_outputs`` (its
    fields as an object, ``extra_body`` for OpenAI's clients), or OpenAI's ``response_format`` (``json_object``: any
    JSON object; ``json_schema``: its ``schema``; ``text``: none), not both; a 400 naming the field otherwise."""
    given, fmt = body.get("structured_outputs"), body.get("response_format")
    if given is not None and fmt not in (None, {"type": "text"}):
        raise BadRequest("give structured_outputs or response_format, not both", "response_format")
    if given is not None:
        if not isinstance(given, dict):
            raise BadRequest(
                "structured_outputs must be an object of StructuredOutputsParams' fields", "structured_outputs"
            )
        return given
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest('response_format json_schema needs {"json_schema": {"name", "schema"}}', "response_format")
        return {"json": schema}
    raise BadRequest('response_format type must be "text", "json_object" or "json_schema"', "response_format")


class BadRequest(Exception):
    """A request answered with an error (400 unless ``status`` says otherwise) naming ``param``."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, kind: str = "BadRequestError"
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def error(status: int, message: str, param: str | None = None, kind: str = "BadRequestError") -> JSONResponse:
    """OpenAI's error object (the shape vLLM's server answers with)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class OpenAIServer:
    """The routes over ``loop``; ``defaults``: the sampling fields a request leaves out."""

    def __init__(
        self,
        loop: EngineLoop,
        model_name: str,
        *,
        defaults: SamplingParams | None = None,
        api_key: str | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        read_timeout: float = READ_TIMEOUT_S,
    ) -> None:
        self.loop, self.model_name = loop, model_name
        self.key = None if api_key is None else hashlib.sha256(api_key.encode()).digest()
        self.max_request_bytes, self.read_timeout = max_request_bytes, read_timeout
        self.defaults = defaults if defaults is not None else SamplingParams(max_tokens=16, temperature=1.0)
        self.tokenizer = loop.tokenizer
        self.created = int(time.time())
        self.max_model_len = loop.max_model_len or 1 << 62
        self.max_token_chars = longest_token(self.tokenizer)  # (vLLM's bound on a prompt's characters)

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
            if self.key is not None and not self._authorized(request.headers.get("authorization") or ""):
                return error(401, "a missing or wrong API key", kind="AuthenticationError")
            try:
                return await handler(request)  # type: ignore[no-any-return]
            except BadRequest as e:
                response = error(e.status, str(e), e.param, e.kind)
                if e.status in (408, 413):  # (the rest of the body is not kept: the connection goes)
                    response.headers["Connection"] = "close"
                return response
            except NeverTaken as e:
                return error(400, str(e), "n")
            except QueueFull as e:
                response = error(503, f"the server is full: {e}; retry later", kind="ServiceUnavailableError")
                response.headers["Retry-After"] = str(RETRY_AFTER_S)
                return response
            except EngineDead as e:
                return error(500, str(e), kind="InternalServerError")

        return guarded

    def _authorized(self, header: str) -> bool:
        """``Bearer KEY``, the scheme in any case (vLLM's rule), the key compared in constant time (its digest)."""
        scheme, _, key = header.partition(" ")
        given = hashlib.sha256(key.strip().encode("utf-8", "replace")).digest()
        return hmac.compare_digest(given, self.key or b"") and scheme.lower() == "bearer"

    # -- the routes -----------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.loop.dead is not None else 200)

    async def models(self, request: Request) -> Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedkv",
                "max_model_len": self.loop.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        body = await self._body(request, chat=False)
        prompts = await self._prompts(body.get("prompt"))
        return await self._serve(request, body, prompts, chat=False)

    async def chat(self, request: Request) -> Response:
        body = await self._body(request, chat=True)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
        for name, kind in (("chat_template", str), ("chat_template_kwargs", dict), ("continue_final_message", bool)):
            if body.get(name) is not None and not isinstance(body[name], kind):
                raise BadRequest(f"{name} must be a {kind.__name__}", name)
        generation = body.get("add_generation_prompt", True)
        if type(generation) is not bool:
            raise BadRequest("add_generation_prompt must be true or false", "add_generation_prompt")
        size = sum(len(str(m)) for m in messages) + len(body.get("chat_template") or "")
        self._check_chars(size, "messages")

        def render() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=generation,
                chat_template=body.get("chat_template"),
                continue_final_message=bool(body.get("continue_final_message")),
                template_kwargs=body.get("chat_template_kwargs"),
            )
            return list(self.tokenizer.encode(text))

        try:
            ids = await _off_loop(render, size)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        return await self._serve(request, body, [self._check_tokens(ids)], chat=True)

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(prometheus(self.loop, self.model_name), media_type="text/plain; version=0.0.4")

    # -- reading a request ----------------------------------------------------------------------------------------
    async def _body(self, request: Request, chat: bool) -> dict[str, Any]:
        """The request's JSON object, read within ``read_timeout`` (408) and ``max_request_bytes`` (413), parsed off
        the event loop where large; a text that is not Unicode, a model not served (404), a field vLLM takes that
        is not served: refused before anything else is done."""
        limit = self.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _linger(request)
            raise _too_large(int(length), limit)
        raw = bytearray()
        try:
            with anyio.fail_after(self.read_timeout):
                async for part in request.stream():
                    raw += part
                    if len(raw) > limit:
                        break
        except TimeoutError:
            raise BadRequest(
                f"the request was not sent within {self.read_timeout:g} s", status=408, kind="RequestTimeout"
            ) from None
        if len(raw) > limit:
            size = len(raw)
            del raw
            await _linger(request)
            raise _too_large(size, limit)
        try:
            body = await _off_loop(lambda: json.loads(raw), len(raw))
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        for name, value in body.items():  # (JSON's \ud800 escapes make text no encoder takes)
            if not _unicode(value):
                raise BadRequest(f"{name} holds text that is not valid Unicode (a lone surrogate)", name)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"The model `{model}` does not exist.", "model", 404, "NotFoundError")
        if "stream" in body and type(body["stream"]) is not bool:
            raise BadRequest("stream must be true or false", "stream")
        options = body.get("stream_options")
        if options is not None:
            if not body.get("stream"):
                raise BadRequest("stream_options can only be given with stream true", "stream_options")
            if not isinstance(options, dict) or any(
                k not in ("include_usage", "continuous_usage_stats") or type(v) is not bool for k, v in options.items()
            ):
                raise BadRequest(
                    "stream_options takes include_usage and continuous_usage_stats, true or false", "stream_options"
                )
        off = dict(NOT_SERVED, best_of=(None, 1, body.get("n", 1)), add_special_tokens=(None, not chat))
        for name, value in body.items():
            allowed = off.get(name)
            if allowed is not None and not any(value is v or (type(value) is type(v) and value == v) for v in allowed):
                raise BadRequest(f"{name} is not served by pagedkv serve", name)
        return body

    def _check_chars(self, chars: int, param: str) -> None:
        """vLLM's bound before tokenizing: a text of more characters than ``max_model_len`` tokens of the longest
        token's cannot fit."""
        most = self.max_model_len * self.max_token_chars
        if chars > most:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt contains "
                f"{chars} characters (more than {most} characters, which is the upper bound for "
                f"{self.max_model_len} input tokens). Please reduce the length of the input prompt.",
                param,
            )

    def _check_tokens(self, ids: list[int], param: str = "prompt") -> list[int]:
        if len(ids) > self.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt contains "
                f"{len(ids)} input tokens, which exceeds this limit even without any output tokens. Please reduce "
                "the length of the input prompt.",
                param,
            )
        return ids

    async def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            return [self._check_tokens(list(await _off_loop(lambda: self.tokenizer.encode(prompt), len(prompt))))]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return [self._check_tokens(list(prompt))]
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return [q for p in prompt for q in await self._prompts(p)]
        raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")

    def _params(self, body: dict[str, Any], chat: bool) -> SamplingParams:
        given = {FIELDS[k]: v for k, v in body.items() if k in FIELDS and v is not None}
        given.update(_asked_logprobs(body, chat))
        if _echo(body, chat) and given.get("logprobs") is not None and "prompt_logprobs" not in given:
            given["prompt_logprobs"] = given["logprobs"]  # (vLLM's: echoed tokens carry their logprobs too)
        if (
            "logit_bias" in given
        ):  # (JSON's keys are strings: vLLM reads them as ids, the bias clamped to OpenAI's range)
            bias = given["logit_bias"]
            if not isinstance(bias, dict) or not all(
                isinstance(k, str) and k.isdigit() and _finite(v) for k, v in bias.items()
            ):
                raise BadRequest("logit_bias must map token ids to numbers", "logit_bias")
            given["logit_bias"] = {int(k): min(100.0, max(-100.0, float(v))) for k, v in bias.items()}
        constraint = _constraint(body)
        if constraint is not None:
            given["structured_outputs"] = constraint
        most = given.get("max_tokens")
        if type(most) is int and most > self.max_model_len:
            raise BadRequest(
                f"max_tokens={most} cannot be greater than max_model_len={self.max_model_len}. "
                "Please request fewer output tokens.",
                "max_tokens" if "max_tokens" in body else "max_completion_tokens",
            )
        try:
            return replace(self.defaults, **given)  # (checked as it is built)
        except SamplingError as e:
            name = e.parameter or ""
            raise BadRequest(str(e), next((k for k, f in FIELDS.items() if f == name and k in body), name)) from None
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e)) from None

    # -- serving it -------------------------------------------------------------------------------------------------
    async def _serve(self, request: Request, body: dict[str, Any], prompts: list[list[int]], chat: bool) -> Response:
        params = self._params(body, chat)
        loop = asyncio.get_running_loop()
        given = body.get("request_id")  # (vLLM's: the response's id then carries it)
        if given is not None and (not isinstance(given, str) or not given.isprintable() or len(given) > 256):
            raise BadRequest("request_id must be a printable string of at most 256 characters", "request_id")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{given or uuid.uuid4().hex}"
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
            options = body.get("stream_options") or {}
            every = options.get("continuous_usage_stats", False) if options.get("include_usage") else None
            stream = self._stream(request, rid, seqs, chat, usage, every)
            return StreamingResponse(stream, media_type="text/event-stream")
        return Awaited(self._whole(rid, seqs, chat, usage, body), lambda: self.loop.cancel([s.rid for s in seqs]))

    async def _whole(
        self, rid: str, seqs: list[Sequence], chat: bool, usage: dict[str, int], body: dict[str, Any]
    ) -> Response:
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
        choices: list[dict[str, Any]] = [
            {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
            if chat
            else {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for i, c in enumerate(done)
        ]  # fmt: skip
        asked = seqs[0].params.logprobs if seqs else None
        echo = bool(seqs) and _echo(body, chat)
        for choice, c, s in zip(choices, done, seqs):
            if asked is not None:  # (OpenAI's shapes: the chat API's and the completions API's)
                lead = c.prompt_logprobs if echo else None
                choice["logprobs"] = openai_logprobs(c, asked, chat, lead, self.tokenizer.decode)
            if s.params.prompt_logprobs is not None:  # (vLLM's field: a dict a prompt token, the first null)
                choice["prompt_logprobs"] = vllm_prompt_logprobs(c)
            if echo:  # (the prompt's text before the completion's, vLLM's echo)
                choice["text"] = self.tokenizer.decode(c.prompt_token_ids) + c.text
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                             "choices": choices, "usage": usage})  # fmt: skip

    async def _stream(
        self,
        request: Request,
        rid: str,
        seqs: list[Sequence],
        chat: bool,
        usage: dict[str, int],
        every: bool | None = None,
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed request; ``every``: None without usage chunks (OpenAI's default),
        False for a usage chunk at the end (``include_usage``), True for usage in every chunk too. The usage counts
        the tokens whose text was sent (a stream an engine's death ended: what came before)."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def counted() -> dict[str, int]:
            done = sum(len(s.text.ids) if s.text is not None else 0 for s in seqs)
            return {**usage, "completion_tokens": done, "total_tokens": usage["prompt_tokens"] + done}

        asked = seqs[0].params.logprobs if seqs else None
        offsets = [0] * len(seqs)  # (the completions API's text_offset: the characters sent before a chunk)

        def chunk(i: int, text: str | None, finish: str | None = None, role: bool = False) -> str:
            lps = None
            if asked is not None and not role:  # (the logprobs of the tokens come since the last chunk)
                s = seqs[i]
                fresh, s.lps_sent = s.token_lps[s.lps_sent :], len(s.token_lps)
                lps = logprob_shape(logprob_rows(fresh, asked), chat, offsets[i]) if fresh or text else None
                offsets[i] += len(text or "")
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": lps, "finish_reason": finish}
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            if every:
                out["usage"] = counted()
            return sse(out)

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
                    if c.finish_reason not in ("stop", "length"):
                        yield sse({"error": {"message": f"the request ended with {c.finish_reason}: {c.error or ''}",
                                             "type": "InternalServerError", "param": None, "code": 500}})  # fmt: skip
                    if event[2]:
                        yield chunk(i, event[2])
                    yield chunk(i, None, c.finish_reason if c.finish_reason in ("stop", "length") else "abort")
            if every is not None:  # (stream_options.include_usage: OpenAI's last chunk, its choices empty)
                yield sse({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                           "usage": counted()})  # fmt: skip
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


def _asked_logprobs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """``SamplingParams``' ``logprobs`` from OpenAI's fields: the chat API's ``logprobs`` (true or false) and
    ``top_logprobs`` (0-20), the completions API's ``logprobs`` (0-20); not with ``stream`` (not served: a 400)."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if asked is not None and type(asked) is not bool:
            raise BadRequest("logprobs must be true or false", "logprobs")
        if top is not None and not asked:
            raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        if top is not None and not (type(top) is int and 0 <= top <= MAX_LOGPROBS):
            raise BadRequest(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
        k = (top or 0) if asked else None
    else:
        if asked is not None and not (type(asked) is int and 0 <= asked <= MAX_LOGPROBS):
            raise BadRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null", "logprobs")
        k = asked
    for name in ("echo", "prompt_logprobs"):
        if body.get(name) and body.get("stream"):
            raise BadRequest(f"{name} with stream is not served by pagedkv serve (ask it without stream)", name)
    echo = body.get("echo")
    if echo is not None and type(echo) is not bool:
        raise BadRequest("echo must be true or false", "echo")
    if echo and chat:
        raise BadRequest("echo is served by the completions API (the chat API's echo is not served)", "echo")
    return {} if k is None else {"logprobs": k}


def _echo(body: dict[str, Any], chat: bool) -> bool:
    return not chat and body.get("echo") is True


def openai_logprobs(
    c: Completion,
    k: int,
    chat: bool,
    echoed: list[dict[int, Logprob] | None] | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> dict[str, Any] | None:
    """A completion's logprobs in OpenAI's shape (``logprob_shape``); ``k``: the most likely ids given a token;
    ``echoed``: the prompt's logprobs, its tokens first (the completions API's echo: the first token's null, its text
    ``decode``'s)."""
    if c.logprobs is None:
        return None
    rows = logprob_rows(list(zip(c.token_ids, c.logprobs)), k)
    if echoed is not None and not chat:
        first = Logprob(None, 0, decode(c.prompt_token_ids[:1]) if decode else "")  # type: ignore[arg-type]
        lead = [
            (first, []) if row is None else logprob_rows([(t, row)], k)[0] for t, row in zip(c.prompt_token_ids, echoed)
        ]
        rows = lead + rows
    return logprob_shape(rows, chat)


def logprob_rows(entries: list[tuple[int, dict[int, Logprob]]], k: int) -> list[tuple[Logprob, list[Logprob]]]:
    """Each (token, its logprob entry): the token's own ``Logprob`` and the ``k`` most likely, in rank order."""
    return [(row[t], sorted(row.values(), key=lambda lp: lp.rank)[:k]) for t, row in entries]


def logprob_shape(rows: list[tuple[Logprob, list[Logprob]]], chat: bool, offset: int = 0) -> dict[str, Any]:
    """OpenAI's shape of tokens' logprobs: the chat API's ``{"content": [{token, logprob, bytes, top_logprobs}]}``,
    or the completions API's ``{tokens, token_logprobs, top_logprobs, text_offset}`` (offsets from ``offset``: a
    stream's chunk counts the text before it); vLLM's -9999.0 for a logprob of minus infinity, which JSON cannot
    carry."""

    def value(x: float | None) -> float | None:
        return None if x is None else max(x, -9999.0)

    def text(lp: Logprob) -> str:
        return lp.decoded_token or ""

    if chat:
        return {
            "content": [
                {
                    "token": text(own),
                    "logprob": value(own.logprob),
                    "bytes": list(text(own).encode()),
                    "top_logprobs": [
                        {"token": text(lp), "logprob": value(lp.logprob), "bytes": list(text(lp).encode())}
                        for lp in top
                    ],
                }
                for own, top in rows
            ]
        }
    offsets, at = [], offset
    for own, _ in rows:
        offsets.append(at)
        at += len(text(own))
    return {
        "tokens": [text(own) for own, _ in rows],
        "token_logprobs": [value(own.logprob) for own, _ in rows],
        "top_logprobs": [
            None if own.logprob is None else {text(lp): value(lp.logprob) for lp in top} for own, top in rows
        ],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(c: Completion) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: a prompt token's ``{id: {logprob, rank, decoded_token}}``, the first null."""
    if c.prompt_logprobs is None:
        return None
    return [
        None
        if row is None
        else {str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
              for t, lp in row.items()}
        for row in c.prompt_logprobs
    ]  # fmt: skip


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


LINGER_S = 2.0  # how long the rest of a refused body is read and dropped (``_linger``), at most
LINGER_BYTES = 64 << 20  # and how much of it


async def _linger(request: Request) -> None:
    """What the client still sends of a body refused unread (413), read and dropped, for at most ``LINGER_S``
    seconds and ``LINGER_BYTES`` (nginx's lingering close): a client that writes its whole body before it reads
    the answer (httpx, requests) then reads the 413, where a connection closed on unread bytes is reset under it
    and the answer lost. Nothing is kept; the connection still closes after the answer."""
    dropped = 0
    with anyio.move_on_after(LINGER_S):
        while dropped <= LINGER_BYTES:
            message = await request.receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def _too_large(size: int, limit: int) -> BadRequest:
    return BadRequest(
        f"the request's body is {size} bytes or more, over the {limit} this server takes (--max-request-bytes)",
        status=413,
        kind="RequestEntityTooLarge",
    )


async def _off_loop(work: Callable[[], Any], size: int) -> Any:
    """``work()``, in a worker thread where ``size`` (bytes, characters) says it is large (parsing, tokenizing: the
    event loop serves other clients meanwhile), else here (a thread's hop costs more than a small one)."""
    if size < OFF_LOOP_BYTES:
        return work()
    return await anyio.to_thread.run_sync(work)


def _unicode(value: Any) -> bool:
    """Does ``value`` (parsed JSON) hold only text UTF-8 can encode (no lone surrogate)?"""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, list):
        return all(_unicode(v) for v in value)
    if isinstance(value, dict):
        return all(_unicode(k) and _unicode(v) for k, v in value.items())
    return True


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def longest_token(tokenizer: Any) -> int:
    """The most characters one token's text holds (vLLM's ``max_chars_per_token``): a text of more characters than
    ``n`` times it holds more than ``n`` tokens."""
    size = getattr(tokenizer, "vocab_size", None)
    if not isinstance(size, int) or size <= 0:
        return 1 << 20  # (a tokenizer that does not say: no bound before tokenizing)
    return max(1, max(len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(size)))


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
