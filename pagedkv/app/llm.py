"""``LLM``: the whole-request API over the engine, with vLLM's names and meaning: a vLLM script's
``LLM(...).generate(prompts, SamplingParams(...))`` and ``LLM(...).chat(messages, ...)`` run unchanged, and give
vLLM's ``RequestOutput`` shape (``outputs[i].text``, ``token_ids``, ``finish_reason``, ``logprobs``).

Usage (loads SmolLM2, so it is shown here and run in tests/models/test_smollm2.py rather than as a doctest)::

    llm = LLM()
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
    out[0].outputs[0].text   # 'The capital of France is Paris.'
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, Required, TypedDict, cast


from pagedkv.app.args import auto_threads
from pagedkv.models.hf import generation_defaults, load_model, model_source, weights_dtype
from pagedkv.models.llama import Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.engine import Engine
from pagedkv.shell.engine_args import freeze_startup
from pagedkv.shell.outcomes import Completion
from pagedkv.shell.sampling import Logprob, SamplingError, SamplingParams, fan_out


class TextPrompt(TypedDict):
    """vLLM's: a prompt given as text."""

    prompt: Required[str]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """vLLM's: a prompt given as token ids (``prompt``, where given, is only what ``RequestOutput.prompt`` says)."""

    prompt_token_ids: Required[list[int]]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


Prompt = str | TextPrompt | TokensPrompt | list[int] | Mapping[str, Any]  # vLLM's prompt forms
Message = Mapping[str, Any]  # {"role": ..., "content": text or OpenAI's text parts}


@dataclass(slots=True)
class RequestStateStats:
    """vLLM's ``RequestOutput.metrics``: ``arrival_time`` (wall clock, ``time.time()``), ``queued_ts`` (when it was
    handed to the engine), ``first_token_ts`` and ``last_token_ts`` (``time.monotonic()``, vLLM's core clock),
    ``first_token_latency`` (seconds from arrival to the first token) and ``num_generation_tokens`` (over the
    request's ``n`` sequences). ``scheduled_ts`` is not measured here (0.0, vLLM's value for unset)."""

    num_generation_tokens: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0


@dataclass(slots=True)
class CompletionOutput:
    """One sequence of a request, as vLLM's: ``index`` among the request's ``n``, its text and ids, why it ended
    (``stop``, ``length``; pagedkv's ``cancelled``, ``error`` and refusal codes too, with ``error`` saying why),
    ``stop_reason`` (the stop string or token id that ended it; None for the end-of-sequence token or a length)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    error: str | None = None
    lora_request: None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A prompt's result, as vLLM's: its ``n`` sequences in ``outputs``, the prompt's tokens served from the
    prefix cache (``num_cached_tokens``), its times (``metrics``); ``prompt`` is None for a prompt given as ids
    alone; ``prompt_logprobs`` where ``SamplingParams(prompt_logprobs=k)`` asked them (a dict a prompt token, the
    first None), ``lora_request`` None."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestStateStats | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: None = None


class LLM:
    """SmolLM2-135M-Instruct (or any checkpoint ``load_model`` serves, a hub id, or a model of your own with its
    tokenizer) served through pagedkv, under vLLM's ``LLM`` API (docs/vllm-api.md maps it row by row)."""

    def __init__(
        self,
        model: Any = None,
        tokenizer: Tokenizer | str | None = None,
        *,
        device: str = "auto",
        dtype: str | Any = "auto",
        threads: int | str = "auto",
        generation_config: str = "auto",
        seed: int | None = 0,
        chat_template: str | None = None,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        gpu_memory_utilization: float | None = None,
        **engine: Any,
    ) -> None:
        """``model``: a path (a Hugging Face checkpoint directory or a Llama-family ``.gguf`` file:
        ``models.hf.load_model``, its tokenizer with it), a hub id (``models.hf.model_source``: the default model's
        id is the packaged weights; others through ``huggingface_hub``'s cache, ``HF_HUB_OFFLINE`` respected), a
        model of your own (with ``tokenizer``), or None for SmolLM2-135M-Instruct. ``tokenizer``: ours, or a path or
        hub id whose tokenizer to take. ``device``: auto (CUDA where there is one, else the CPU), cpu, cuda, cuda:N.
        ``dtype``: vLLM's names (auto: bfloat16 on CUDA, float32 on the CPU; half, float16, bfloat16, float,
        float32) or a torch dtype. ``threads``: torch's CPU threads, auto (the idle CPUs, as ``pagedkv generate
        --threads auto``) or a count; on CUDA left as they are. ``generation_config``: where the default
        ``SamplingParams`` come from (vLLM's): auto (the checkpoint's generation_config.json), vllm (none:
        ``SamplingParams()``), or a directory holding one. vLLM's: ``seed`` (the requests without a seed of their own
        draw from it and their order: the same script, the same tokens; None: from their ids), ``chat_template``
        (``chat``'s, over the model's), ``enforce_eager`` (no CUDA graphs), ``gpu_memory_utilization`` (CUDA's
        budget; without meaning on the CPU, where it is passed over), ``trust_remote_code`` (pagedkv runs no code
        of a checkpoint's: either value loads the same), ``tensor_parallel_size`` 1 (ranks:
        ``pagedkv.app.ranks``). ``engine``: ``EngineArgs`` fields."""
        import torch

        if tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size}: LLM serves one rank (ranks: pagedkv generate --ranks)"
            )
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        if not device.startswith("cuda"):
            torch.set_num_threads(auto_threads() if threads == "auto" else int(threads))
        elif gpu_memory_utilization is not None:
            engine["gpu_memory_utilization"] = gpu_memory_utilization
        if enforce_eager:
            engine["cuda_graphs"] = False
        path = model_source(model) if isinstance(model, str) else None
        if path is not None:
            model, loaded, _ = load_model(path, dtype=weights_dtype(dtype, device), device=device)
            tokenizer = tokenizer if tokenizer is not None else loaded
        elif model is None or isinstance(model, str):  # (None, or the packaged model's hub id)
            model, meta = Llama.smollm2(device=device, dtype=weights_dtype(dtype, device))
            tokenizer = tokenizer if tokenizer is not None else Tokenizer(meta)
        if isinstance(tokenizer, str):
            from pagedkv.models.gguf import load_tokenizer_meta
            from pagedkv.models.hf import load_tokenizer

            where = model_source(tokenizer)
            tokenizer = load_tokenizer(where) if where is not None else Tokenizer(load_tokenizer_meta())
        if tokenizer is None:
            raise ValueError("a model of your own needs its tokenizer")
        if seed is not None and not (type(seed) is int and 0 <= seed < 1 << 63):
            raise SamplingError(f"seed must be an integer in [0, 2**63) or None, got {seed!r:.40}", parameter="seed")
        source = path if generation_config == "auto" else None if generation_config == "vllm" else generation_config
        self.defaults = generation_defaults(source) if source is not None else {}
        self.tokenizer = tokenizer
        self.seed, self._drawn = seed, 0  # (the unseeded requests served so far: each draws seed and its place)
        self.chat_template = chat_template
        self._hf_tokenizer: Any = None
        self.engine = Engine(model, tokenizer, **engine)
        freeze_startup()  # the app's GC policy: the weights and the start-up state are never walked again

    def get_tokenizer(self) -> Any:
        """The model's tokenizer as Hugging Face's ``PreTrainedTokenizerFast`` (over the same ``tokenizer.json``, with
        the chat template and special tokens), where transformers is installed; else pagedkv's ``Tokenizer`` (its
        ``encode``, ``decode`` and ``apply_chat_template`` to text)."""
        if self._hf_tokenizer is None:
            tok = self.tokenizer
            self._hf_tokenizer = tok.as_hf() if isinstance(tok, Tokenizer) else tok
        return self._hf_tokenizer

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the ranks serving this ``LLM`` (one)."""
        return 1

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's generation defaults (``generation_config``), as vLLM's."""
        return SamplingParams(**self.defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: Any = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Each prompt's ``RequestOutput``, in order. ``prompts``: one prompt or a list (a text, a list of token
        ids, vLLM's ``TextPrompt`` ``{"prompt": text}`` or ``TokensPrompt`` ``{"prompt_token_ids": ids}``);
        ``sampling_params``: one for all, or one a prompt (another count is a ``ValueError``), None for
        ``get_default_sampling_params()``. A prompt with ``n`` > 1 gives ``n`` sequences, the i-th seeded
        ``seed + i`` (vLLM's rule). ``use_tqdm``: a progress bar on a terminal. A prompt that leaves no room for a
        token in the longest request, or params out of range, raise ``SamplingError`` (vLLM's
        ``VLLMValidationError``) before anything runs. LoRA, priorities and multimodal inputs are not served: a
        value for them other than None is a ``ValueError`` naming it."""
        _not_served(lora_request=lora_request, priority=priority, tokenization_kwargs=tokenization_kwargs,
                    mm_processor_kwargs=mm_processor_kwargs)  # fmt: skip
        one = isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, list) and bool(prompts) and all(type(t) is int for t in prompts)
        )
        items = [cast(Prompt, prompts)] if one else list(cast(Sequence[Prompt], prompts))
        many = self._params(sampling_params, len(items))
        texts_ids = [self._prompt(p) for p in items]
        return self._run(texts_ids, many, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """``generate`` over conversations rendered by the chat template (``chat_template``, else ``LLM``'s, else
        the model's): one conversation (a list of ``{"role", "content"}`` messages, the content a string or OpenAI's
        text parts; system prompts and earlier turns included) or a list of them; ``continue_final_message``: the
        model goes on with the last message; ``tools`` and ``chat_template_kwargs`` reach the template
        (``Tokenizer.apply_chat_template``). A conversation the template cannot render is a ``ValueError``."""
        _not_served(lora_request=lora_request, priority=priority, tokenization_kwargs=tokenization_kwargs,
                    mm_processor_kwargs=mm_processor_kwargs)  # fmt: skip
        one = bool(messages) and isinstance(messages[0], Mapping)  # (one conversation, or a list of them)
        convs = [cast(Sequence[Message], messages)] if one else list(cast(Sequence[Sequence[Message]], messages))
        many = self._params(sampling_params, len(convs))
        texts = [
            self.tokenizer.apply_chat_template(
                conv,
                add_generation_prompt,
                chat_template=chat_template if chat_template is not None else self.chat_template,
                continue_final_message=continue_final_message,
                content_format=chat_template_content_format,
                tools=tools,
                template_kwargs=chat_template_kwargs,
            )
            for conv in convs
        ]
        return self._run([(t, self.tokenizer.encode(t)) for t in texts], many, use_tqdm)

    def _params(self, given: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if given is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(given, SamplingParams):
            return [given] * n
        many = list(given)
        if len(many) != n:
            raise ValueError(f"{len(many)} sampling params for {n} prompts: give one for all, or one a prompt")
        return many

    def _prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return None, list(prompt)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            given = cast(Mapping[str, Any], prompt)
            text = given.get("prompt")
            return (text if isinstance(text, str) else None), list(given["prompt_token_ids"])
        if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError(
            'a prompt is a string, a list of token ids, {"prompt": str} or {"prompt_token_ids": [int, ...]}; '
            f"got {prompt!r:.80}"
        )

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: bool | Callable[..., Any],
    ) -> list[RequestOutput]:
        """Every prompt's ``n`` sequences as requests of one sequence each, served together; grouped back."""
        from pagedkv.app.report import progress_bar

        longest = self.engine.longest_request()
        for (_, ids), p in zip(prompts, params):  # (vLLM's checks, before anything runs)
            if p.structured_outputs is not None:  # (a constraint that cannot compile: the library's reason)
                self.engine.grammars().compile(p.structured_outputs)  # (its compile started: the engine finds it)
            n = len(self.engine.served_prompt(p, ids))
            if n >= longest:
                raise SamplingError(
                    f"The decoder prompt (length {n}) leaves no room for a token within the maximum model length of "
                    f"{longest}. Make sure that `max_model_len` is no smaller than the number of text tokens plus one.",
                    parameter="prompt",
                    value=n,
                )
        requests = [(text or "", ids, self._seeded(q)) for (text, ids), p in zip(prompts, params) for q in fan_out(p)]
        arrival, queued = time.time(), time.monotonic()
        first: dict[Any, float] = {}
        last: dict[Any, float] = {}

        def on_token(rid: Any, _: int) -> None:
            now = time.monotonic()
            first.setdefault(rid, now)
            last[rid] = now

        bar = progress_bar(len(requests), disable=not use_tqdm)
        try:
            done = self.engine.generate(requests, on_finish=lambda _: bar.update(1), on_token=on_token)
        finally:
            bar.close()
        out, k = [], 0
        for (text, ids), p in zip(prompts, params):
            seqs, k = done[k : k + p.n], k + p.n
            firsts = [first[c.request_id] for c in seqs if c.request_id in first]
            lasts = [last[c.request_id] for c in seqs if c.request_id in last]
            metrics = RequestStateStats(
                num_generation_tokens=sum(len(c.token_ids) for c in seqs),
                arrival_time=arrival,
                queued_ts=queued,
                first_token_ts=min(firsts, default=0.0),
                last_token_ts=max(lasts, default=0.0),
                first_token_latency=min(firsts) - queued if firsts else 0.0,
            )
            out.append(
                RequestOutput(
                    str(seqs[0].request_id),
                    text,
                    seqs[0].prompt_token_ids,
                    [_output(i, c) for i, c in enumerate(seqs)],
                    num_cached_tokens=seqs[0].cached_tokens,
                    metrics=metrics,
                    prompt_logprobs=seqs[0].prompt_logprobs,
                )
            )
        return out

    def _seeded(self, params: SamplingParams) -> SamplingParams:
        """``params`` (a fanned-out copy) with a seed: its own, or one drawn from ``LLM``'s seed and how many
        unseeded requests came before (vLLM's: one generator seeded once), or none where ``seed`` is None."""
        if params.seed is None and self.seed is not None:
            params.seed = (self.seed * 0x9E3779B97F4A7C15 + self._drawn * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)
            self._drawn += 1
        return params


def _not_served(**given: Any) -> None:
    """A ``ValueError`` naming the first of vLLM's keywords given a value pagedkv does not serve (None, an empty
    mapping, and priority 0 mean they are not used)."""
    for name, value in given.items():
        if value is None or (isinstance(value, Mapping) and not value) or (name == "priority" and value in (0, [0])):
            continue
        raise ValueError(f"{name} is not served by pagedkv (docs/vllm-api.md)")


def _output(index: int, c: Completion) -> CompletionOutput:
    return CompletionOutput(
        index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason, c.error
    )
