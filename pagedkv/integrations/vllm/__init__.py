"""pagedkv beside vLLM (``pip install 'pagedkv[vllm]'``). So far: KV events in vLLM's wire format
(``events``), so a router that indexes vLLM's events (llm-d, Dynamo) reads pagedkv's. The KV cache
manager for vLLM's scheduler is not written yet (docs/prefix-and-groups.md lists the core options it
will use: ``free_queue``, ``reset_prefix_cache``, ``caching_point``)."""
