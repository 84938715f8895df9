"""vLLM's v1 schedulers with pagedkv's KV cache manager installed: ``--scheduler-cls
pagedkv.integrations.vllm.PagedKVScheduler`` (vLLM's seam for an out-of-tree scheduler), or
``PagedKVAsyncScheduler`` under async scheduling (vLLM's default on GPUs).

The schedulers are vLLM's own (``Scheduler``, ``AsyncScheduler``), unchanged; only their
``kv_cache_manager`` is pagedkv's (``PagedKVCacheManager``, backed by the pure core). Steps scheduled
before the last one's tokens are back and speculative decoding's drafts grow a row by placeholders whose
ids arrive later. What the manager does not serve is refused here, before anything runs: KV connectors
(P/D, offloading; they reach the manager's ``coordinator`` and ``block_pool``), encoder-decoder models,
decode context parallelism and pipeline parallelism, and a scheduler class that does not match the async
scheduling setting.
"""

from __future__ import annotations

from typing import Any

from pagedkv.integrations.vllm.geometry import vllm_modules
from pagedkv.integrations.vllm.version import Unsupported
from pagedkv.integrations.vllm.manager import PagedKVCacheManager

try:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
except ImportError:  # vLLM is the extra: the classes are defined only where it is installed
    _VllmScheduler = _VllmAsyncScheduler = None


def refusals(vllm_config: Any, *, async_class: bool = False) -> list[str]:
    """What of ``vllm_config`` pagedkv's manager does not serve under the scheduler class (async or not)
    (empty: it serves it)."""
    out = []
    if vllm_config.kv_transfer_config is not None:
        out.append("a KV connector (kv_transfer_config)")
    if vllm_config.model_config is not None and vllm_config.model_config.is_encoder_decoder:
        out.append("an encoder-decoder model (cross-attention blocks)")
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        out.append("decode context parallelism")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        out.append("pipeline parallelism (steps in flight)")
    if bool(vllm_config.scheduler_config.async_scheduling) != async_class:
        out.append(
            "async scheduling with PagedKVScheduler (use --scheduler-cls "
            "pagedkv.integrations.vllm.PagedKVAsyncScheduler)"
            if not async_class
            else "PagedKVAsyncScheduler without async scheduling (use PagedKVScheduler)"
        )
    return out


def _install(scheduler: Any, vllm_config: Any, kv_cache_config: Any) -> None:
    """``scheduler``'s KV cache manager replaced by pagedkv's, built from the same settings as vLLM built its own."""
    theirs: Any = scheduler.kv_cache_manager
    scheduler.kv_cache_manager = PagedKVCacheManager(
        kv_cache_config=kv_cache_config,
        max_model_len=scheduler.max_model_len,
        scheduler_block_size=scheduler.block_size,
        hash_block_size=scheduler.hash_block_size,
        max_in_flight_tokens=vllm_config.max_in_flight_tokens,
        enable_caching=theirs.enable_caching,
        use_eagle=theirs.use_eagle,
        num_hash_lookahead_tokens=scheduler.num_hash_lookahead_tokens,
        num_prefill_lookahead=scheduler.num_prefill_lookahead,
        log_stats=scheduler.log_stats,
        enable_kv_cache_events=theirs.enable_kv_cache_events,
        watermark=scheduler.scheduler_config.watermark,
        metrics_collector=scheduler.kv_metrics_collector,
        enable_mamba_shared_prefix_checkpoint=scheduler.cache_config.enable_mamba_shared_prefix_checkpoint,
        hash_algo=scheduler.cache_config.prefix_caching_hash_algo,
    )


def _check(vllm_config: Any, *, async_class: bool) -> None:
    refused = refusals(vllm_config, async_class=async_class)
    if refused:
        raise Unsupported("pagedkv's KV cache manager does not serve " + "; ".join(refused))
    vllm_modules()


if _VllmScheduler is not None:

    class _OnPagedKV:
        """A vLLM scheduler class with pagedkv's manager installed after vLLM's own constructor ran (the
        configuration checked first: ``_async`` says which of vLLM's classes it is)."""

        _async = False

        def __init__(
            self,
            vllm_config: Any,
            kv_cache_config: Any,
            structured_output_manager: Any,
            block_size: int,
            hash_block_size: int | None = None,
            **kwargs: Any,
        ) -> None:
            _check(vllm_config, async_class=self._async)
            super().__init__(
                vllm_config,
                kv_cache_config,
                structured_output_manager,
                block_size,  # type: ignore[call-arg]
                hash_block_size=hash_block_size,
                **kwargs,
            )
            _install(self, vllm_config, kv_cache_config)

    class PagedKVScheduler(_OnPagedKV, _VllmScheduler):  # type: ignore[misc]
        """vLLM's ``Scheduler`` whose KV cache manager is pagedkv's core."""

    class PagedKVAsyncScheduler(_OnPagedKV, _VllmAsyncScheduler):  # type: ignore[misc]
        """vLLM's ``AsyncScheduler`` (step N+1 scheduled while step N runs) whose KV cache manager is pagedkv's
        core."""

        _async = True

else:  # pragma: no cover - vLLM absent

    class PagedKVScheduler:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            vllm_modules()

    class PagedKVAsyncScheduler(PagedKVScheduler):  # type: ignore[no-redef]
        pass
