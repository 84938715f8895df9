"""pagedkv: a scheduler-managed paged KV cache for serving engines.

Layers, every import pointing down (docs/architecture.md): ``pagedkv.core`` is the
pure state machine (admission, blocks, generations, release, metadata snapshots,
the scheduler, verification); ``pagedkv.shell`` applies its decisions to device
page tensors; ``pagedkv.models`` holds reference models that run on the shell;
``pagedkv.app`` is the command line, ``LLM`` and the launcher of ranks.

vLLM's offline API is exported here under vLLM's names, so that a vLLM script runs with ``vllm`` replaced by
``pagedkv`` in its imports (``from pagedkv import LLM, SamplingParams``; docs/vllm-api.md). They are imported when
first asked for: ``import pagedkv.core`` loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {  # name -> (module, its name there)
    "LLM": ("pagedkv.app.llm", "LLM"),
    "RequestOutput": ("pagedkv.app.llm", "RequestOutput"),
    "CompletionOutput": ("pagedkv.app.llm", "CompletionOutput"),
    "TextPrompt": ("pagedkv.app.llm", "TextPrompt"),
    "TokensPrompt": ("pagedkv.app.llm", "TokensPrompt"),
    "PromptType": ("pagedkv.app.llm", "Prompt"),
    "SamplingParams": ("pagedkv.shell.sampling", "SamplingParams"),
    "RequestOutputKind": ("pagedkv.shell.sampling", "RequestOutputKind"),
    "VLLMValidationError": ("pagedkv.shell.sampling", "SamplingError"),
    "StructuredOutputsParams": ("pagedkv.shell.sampling", "StructuredOutputsParams"),
    "EngineArgs": ("pagedkv.shell.engine_args", "EngineArgs"),
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # (asked once)
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
