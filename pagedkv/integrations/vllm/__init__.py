"""pagedkv beside vLLM (``pip install 'pagedkv[vllm]'``): KV events in vLLM's wire format (``events``)
and their ZMQ publisher (``publish``), so a router that indexes vLLM's events (llm-d, Dynamo) reads
pagedkv's; and pagedkv's core as vLLM's KV cache manager (``manager.PagedKVCacheManager``), installed
in vLLM's own scheduler by ``PagedKVScheduler`` (``--scheduler-cls
pagedkv.integrations.vllm.PagedKVScheduler``). docs/vllm.md says what is served and what is refused."""

from typing import Any


def __getattr__(name: str) -> Any:  # vLLM is imported only when the scheduler is asked for
    if name in ("PagedKVScheduler", "PagedKVAsyncScheduler"):
        from pagedkv.integrations.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(name)
