"""``LLM``: the whole-request API over the engine, with vLLM's names and meaning: a vLLM script's
``LLM(...).generate(prompts, SamplingParams(...))`` and ``LLM(...).chat(messages, ...)`` run unchanged, and give
vLLM's ``RequestOutput`` shape (``outputs[i].text``, ``token_ids``, ``finish_reason``, ``logprobs``).

Usage (loads SmolLM2, so it is shown here and run in tests/models/test_smollm2.py rather than as a doctest)::

    llm = LLM()
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
    out[0].outputs[0].text   # 'The capital of France is Paris.'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from pagedkv.app.args import auto_threads
from pagedkv.models.hf import generation_defaults, load_model, weights_dtype
from pagedkv.models.llama import Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.engine import Engine
from pagedkv.shell.engine_args import freeze_startup
from pagedkv.shell.outcomes import Completion
from pagedkv.shell.sampling import Logprob, SamplingParams, fan_out

Prompt = str | Mapping[str, Any]  # text, or vLLM's {"prompt": text} / {"prompt_token_ids": [ids]}
Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant", "content": text}


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

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A prompt's result, as vLLM's: its ``n`` sequences in ``outputs``, and the prompt's tokens served from the
    prefix cache (``num_cached_tokens``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0


class LLM:
    """SmolLM2-135M-Instruct (or any checkpoint ``load_model`` serves, or a model of your own with its tokenizer)
    served through pagedkv."""

    def __init__(
        self,
        model: Any = None,
        tokenizer: Tokenizer | None = None,
        *,
        device: str = "auto",
        dtype: str | Any = "auto",
        threads: int | str = "auto",
        generation_config: str = "auto",
        **engine: Any,
    ) -> None:
        """``model``: a path (a Hugging Face checkpoint directory or a Llama-family ``.gguf`` file:
        ``models.hf.load_model``, its tokenizer with it), a model of your own (with ``tokenizer``), or None for
        SmolLM2-135M-Instruct. ``device``: auto (CUDA where there is one, else the CPU), cpu, cuda, cuda:N.
        ``dtype``: vLLM's names (auto: bfloat16 on CUDA, float32 on the CPU; half, float16, bfloat16, float,
        float32) or a torch dtype. ``threads``: torch's CPU threads, auto (the idle CPUs, as ``pagedkv generate
        --threads auto``) or a count; on CUDA left as they are. ``generation_config``: where the default
        ``SamplingParams`` come from (vLLM's): auto (the checkpoint's generation_config.json), vllm (none:
        ``SamplingParams()``), or a directory holding one. ``engine``: ``EngineArgs`` fields."""
        import torch

        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        if not device.startswith("cuda"):
            torch.set_num_threads(auto_threads() if threads == "auto" else int(threads))
        path = model if isinstance(model, str) else None
        if path is not None:
            model, loaded, _ = load_model(path, dtype=weights_dtype(dtype, device), device=device)
            tokenizer = tokenizer or loaded
        elif model is None:
            model, meta = Llama.smollm2(device=device, dtype=weights_dtype(dtype, device))
            tokenizer = tokenizer or Tokenizer(meta)
        if tokenizer is None:
            raise ValueError("a model of your own needs its tokenizer")
        source = path if generation_config == "auto" else None if generation_config == "vllm" else generation_config
        self.defaults = generation_defaults(source) if source is not None else {}
        self.tokenizer = tokenizer
        self.engine = Engine(model, tokenizer, **engine)
        freeze_startup()  # the app's GC policy: the weights and the start-up state are never walked again

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's generation defaults (``generation_config``), as vLLM's."""
        return SamplingParams(**self.defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Each prompt's ``RequestOutput``, in order. ``prompts``: one prompt or a list (a text, or vLLM's
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``); ``sampling_params``: one for all, or one a prompt
        (another count is a ``ValueError``), None for ``get_default_sampling_params()``. A prompt with ``n`` > 1
        gives ``n`` sequences, the i-th seeded ``seed + i`` (vLLM's rule). ``use_tqdm``: a progress bar on a
        terminal."""
        items = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        many = self._params(sampling_params, len(items))
        texts_ids = [self._prompt(p) for p in items]
        return self._run(texts_ids, many, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """``generate`` over conversations rendered by the model's chat template: one conversation (a list of
        ``{"role", "content"}`` messages, system prompts and earlier turns included) or a list of them."""
        one = bool(messages) and isinstance(messages[0], Mapping)  # (one conversation, or a list of them)
        convs = [cast(Sequence[Message], messages)] if one else list(cast(Sequence[Sequence[Message]], messages))
        many = self._params(sampling_params, len(convs))
        texts = [self.tokenizer.apply_chat_template([dict(m) for m in conv], add_generation_prompt) for conv in convs]
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

    def _prompt(self, prompt: Prompt) -> tuple[str, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            return str(prompt.get("prompt", "")), ids
        if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError(
            f'a prompt is a string, {{"prompt": str}} or {{"prompt_token_ids": [int, ...]}}; got {prompt!r:.80}'
        )

    def _run(
        self, prompts: list[tuple[str, list[int]]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        """Every prompt's ``n`` sequences as requests of one sequence each, served together; grouped back."""
        from pagedkv.app.report import progress_bar

        requests = [(text, ids, q) for (text, ids), p in zip(prompts, params) for q in fan_out(p)]
        bar = progress_bar(len(requests), disable=not use_tqdm)
        try:
            done = self.engine.generate(requests, on_finish=lambda _: bar.update(1))
        finally:
            bar.close()
        out, k = [], 0
        for (text, ids), p in zip(prompts, params):
            seqs, k = done[k : k + p.n], k + p.n
            out.append(
                RequestOutput(
                    str(seqs[0].request_id),
                    text,
                    ids,
                    [_output(i, c) for i, c in enumerate(seqs)],
                    num_cached_tokens=seqs[0].cached_tokens,
                )
            )
        return out


def _output(index: int, c: Completion) -> CompletionOutput:
    return CompletionOutput(
        index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason, c.error
    )
