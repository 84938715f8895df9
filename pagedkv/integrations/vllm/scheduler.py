"""vLLM's v1 ``Scheduler`` with pagedkv's KV cache manager installed: ``--scheduler-cls
pagedkv.integrations.vllm.PagedKVScheduler`` (vLLM's seam for an out-of-tree scheduler).

The scheduler is vLLM's own, unchanged; only its ``kv_cache_manager`` is pagedkv's
(``PagedKVCacheManager``, backed by the pure core). What the manager does not serve is refused here,
before anything runs: KV connectors (P/D, offloading; they reach the manager's ``coordinator`` and
``block_pool``), speculative decoding, encoder-decoder models, decode context parallelism, pipeline
parallelism and async scheduling (both schedule a step before the last one's tokens are known; the
core hashes the tokens it holds).
"""

from __future__ import annotations

from typing import Any

from pagedkv.integrations.vllm.geometry import Unsupported, vllm_modules
from pagedkv.integrations.vllm.manager import PagedKVCacheManager

try:
    from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
except ImportError:  # vLLM is the extra: the class is defined only where it is installed
    _VllmScheduler = None


def refusals(vllm_config: Any) -> list[str]:
    """What of ``vllm_config`` pagedkv's manager does not serve (empty: it serves it)."""
    out = []
    if vllm_config.kv_transfer_config is not None:
        out.append("a KV connector (kv_transfer_config)")
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding (speculative_config)")
    if vllm_config.model_config is not None and vllm_config.model_config.is_encoder_decoder:
        out.append("an encoder-decoder model (cross-attention blocks)")
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        out.append("decode context parallelism")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        out.append("pipeline parallelism (steps in flight)")
    if vllm_config.scheduler_config.async_scheduling:
        out.append("async scheduling (run with --no-async-scheduling: a step's tokens must be known when the "
                   "next is scheduled, the core hashes them)")
    return out


if _VllmScheduler is not None:

    class PagedKVScheduler(_VllmScheduler):  # type: ignore[misc]
        """vLLM's ``Scheduler`` whose KV cache manager is pagedkv's core."""

        def __init__(self, vllm_config: Any, kv_cache_config: Any, structured_output_manager: Any, block_size: int,
                     hash_block_size: int | None = None, **kwargs: Any) -> None:  # fmt: skip
            refused = refusals(vllm_config)
            if refused:
                raise Unsupported("pagedkv's KV cache manager does not serve " + "; ".join(refused))
            vllm_modules()
            super().__init__(vllm_config, kv_cache_config, structured_output_manager, block_size,
                             hash_block_size=hash_block_size, **kwargs)  # fmt: skip
            theirs: Any = self.kv_cache_manager  # type: ignore[has-type]
            self.kv_cache_manager = PagedKVCacheManager(
                kv_cache_config=kv_cache_config, max_model_len=self.max_model_len,
                scheduler_block_size=self.block_size, hash_block_size=self.hash_block_size,
                max_in_flight_tokens=vllm_config.max_in_flight_tokens, enable_caching=theirs.enable_caching,
                use_eagle=theirs.use_eagle, log_stats=self.log_stats,
                enable_kv_cache_events=theirs.enable_kv_cache_events,
                watermark=self.scheduler_config.watermark, metrics_collector=self.kv_metrics_collector,
                enable_mamba_shared_prefix_checkpoint=self.cache_config.enable_mamba_shared_prefix_checkpoint,
                hash_algo=self.cache_config.prefix_caching_hash_algo,
            )  # fmt: skip
            del theirs

else:  # pragma: no cover - vLLM absent

    class PagedKVScheduler:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            vllm_modules()
