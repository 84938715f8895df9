"""vLLM's ``vllm.sampling_params`` names, where a vLLM script imports them from (``from vllm.sampling_params import
SamplingParams, StructuredOutputsParams`` becomes ``from pagedkv.sampling_params import ...``): the classes
themselves live in ``pagedkv.shell.sampling`` and ``pagedkv.shell.structured``."""

from __future__ import annotations

from pagedkv.shell.sampling import RequestOutputKind, SamplingParams
from pagedkv.shell.sampling import SamplingError as VLLMValidationError
from pagedkv.shell.structured import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "VLLMValidationError"]
