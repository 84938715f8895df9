"""pagedkv inside other engines (``pagedkv.integrations.vllm``)."""
