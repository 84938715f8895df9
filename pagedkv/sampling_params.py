"""vLLM's ``vllm.sampling_params`` names, where a vLLM script imports them from (``from vllm.sampling_params import
SamplingParams, StructuredOutputsParams`` becomes ``from pagedkv.sampling_params import ...``): the classes
themselves live in ``pagedkv.shell.sampling``."""

from __future__ import annotations

from pagedkv.shell.sampling import RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedkv.shell.sampling import SamplingError as VLLMValidationError

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "VLLMValidationError"]
