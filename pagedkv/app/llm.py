"""``LLM``: the whole-request API over the engine.

Usage (loads SmolLM2, so it is shown here and run in tests/models/test_smollm2.py rather than as a doctest)::

    llm = LLM()
    [c.text for c in llm.generate(["What is the capital of France?"], chat=True)]
    # ['The capital of France is Paris.']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.app.devices import dtype_for
from pagedkv.models.hf import load_model
from pagedkv.models.llama import Llama
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.shell.engine import Engine
from pagedkv.shell.outcomes import Completion
from pagedkv.shell.engine_args import freeze_startup
from pagedkv.shell.sampling import SamplingParams


class LLM:
    """SmolLM2-135M-Instruct (or any ``Llama`` with a ``Tokenizer``) served through pagedkv."""

    def __init__(self, model: Llama | str | None = None, tokenizer: Tokenizer | None = None, *, device: str = "cpu",
                 dtype: str = "auto", **engine: Any) -> None:  # fmt: skip
        """``model``: a ``Llama``, a path (a Hugging Face checkpoint directory or a Llama-family ``.gguf`` file:
        ``models.hf.load_model``, its tokenizer with it), or None for SmolLM2-135M-Instruct. ``dtype`` of what
        it loads: auto is bfloat16 on cuda (with the triton backend and CUDA graphs, the engine's defaults
        there), float32 on the CPU; ``engine``: ``EngineArgs`` fields."""
        if isinstance(model, str):
            model, loaded, _ = load_model(model, dtype=dtype_for(dtype, device), device=device)
            tokenizer = tokenizer or loaded
        elif model is None:
            model, meta = Llama.smollm2(device=device, dtype=dtype_for(dtype, device))
            tokenizer = tokenizer or Tokenizer(meta)
        if tokenizer is None:
            raise ValueError("a model of your own needs its tokenizer")
        self.tokenizer = tokenizer
        self.engine = Engine(model, tokenizer, **engine)
        freeze_startup()  # the app's GC policy: the weights and the start-up state are never walked again

    def generate(self, prompts: Sequence[str], params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 *, chat: bool = False) -> list[Completion]:  # fmt: skip
        """Completions in prompt order; ``chat`` applies the model's chat template to each prompt."""
        many = params if isinstance(params, Sequence) else [params] * len(prompts)
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompts]
        return self.engine.generate([(t, self.tokenizer.encode(t), sp) for t, sp in zip(texts, many)])
