"""pagedkv inside vLLM-Omni (an optional extra: ``pip install 'pagedkv[vllm-omni]'``; docs/vllm-omni.md)."""
