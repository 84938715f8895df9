"""pagedkv inside vLLM-Omni (an optional extra: ``pip install 'pagedkv[vllm-omni]'``; docs/vllm-omni.md): its
diffusion KV manager's interface over pagedkv's core, the request scheduler that installs it, and the engine a
deploy config selects with ``engine_backend: pagedkv.integrations.vllm_omni.PagedKVDiffusionEngine``."""

from pagedkv.integrations.vllm_omni.manager import PagedKVDiffusionManager
from pagedkv.integrations.vllm_omni.scheduler import (
    PagedKVDiffusionEngine,
    PagedKVRequestScheduler,
    PagedKVStepScheduler,
    Unsupported,
)

__all__ = [
    "PagedKVDiffusionEngine",
    "PagedKVDiffusionManager",
    "PagedKVRequestScheduler",
    "PagedKVStepScheduler",
    "Unsupported",
]
