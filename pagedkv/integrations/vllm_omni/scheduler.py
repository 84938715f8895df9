"""vLLM-Omni's diffusion request scheduler with pagedkv's manager installed (docs/vllm-omni.md).

``PagedKVRequestScheduler`` is vLLM-Omni's own ``RequestScheduler``, unchanged but for the manager
``initialize`` builds under ``diffusion_kv_mode="paged_scheduler"``: pagedkv's ``PagedKVDiffusionManager``, from the
same settings vLLM-Omni builds its own from, and the adapter's row limit (``diffusion_kv_max_rows_per_request``)
checked at admission; ``PagedKVStepScheduler`` likewise vLLM-Omni's ``StepScheduler`` (step execution).
``PagedKVDiffusionEngine`` is vLLM-Omni's ``DiffusionEngine`` that schedules with them:
a deploy config selects it with one line, ``engine_backend: pagedkv.integrations.vllm_omni.PagedKVDiffusionEngine``.
What stays vLLM-Omni's own, refused where asked for: KV connectors (P/D transfers, ``omni_kv_config``'s prefetch),
and independent K/V contexts (the manager refuses them as vLLM-Omni's does).
"""

from __future__ import annotations

from typing import Any

from pagedkv.integrations.vllm_omni.manager import PagedKVDiffusionManager, omni

try:
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine as _OmniEngine
    from vllm_omni.diffusion.sched.request_scheduler import RequestScheduler as _OmniRequestScheduler
    from vllm_omni.diffusion.sched.step_scheduler import StepScheduler as _OmniStepScheduler
except ImportError:  # vLLM-Omni is the extra: the classes are defined only where it is installed
    _OmniEngine = _OmniRequestScheduler = _OmniStepScheduler = None


class Unsupported(ValueError):
    """A vLLM-Omni configuration pagedkv's manager does not serve (said before anything runs)."""


def refusals(od_config: Any) -> list[str]:
    """What of ``od_config`` pagedkv's manager does not serve (empty: it serves it)."""
    out = []
    if getattr(od_config, "kv_transfer_config", None) is not None:
        out.append("a KV connector (kv_transfer_config): transfers stay vLLM-Omni's manager's")
    if (getattr(od_config, "omni_kv_config", None) or {}).get("enable_kv_async_prefetch"):
        out.append("KV prefetch (omni_kv_config.enable_kv_async_prefetch)")
    return out


def _install(scheduler: Any, od_config: Any, kw: dict[str, Any]) -> None:
    """``scheduler``'s diffusion KV manager replaced by pagedkv's, built from the settings vLLM-Omni's ``initialize``
    built its own from (its connector refused first)."""
    theirs: Any = scheduler._diffusion_kv_manager
    if theirs is None:  # (dense_legacy: no paged KV to manage)
        return
    config = kw["kv_vllm_config"]
    scheduler._diffusion_kv_manager = PagedKVDiffusionManager(
        kw["kv_cache_config"],
        max_model_len=theirs.max_model_len,
        scheduler_block_size=kw["scheduler_block_size"],
        hash_block_size=theirs.hash_block_size,
        max_in_flight_tokens=config.max_in_flight_tokens,
        enable_prefix_caching=theirs.enable_prefix_caching,
        prefix_caching_hash_algo=getattr(config.cache_config, "prefix_caching_hash_algo", "sha256"),
        max_rows_per_request=getattr(od_config, "diffusion_kv_max_rows_per_request", None),
    )
    theirs.close()


def _check(od_config: Any) -> None:
    refused = refusals(od_config)
    if refused:
        raise Unsupported("pagedkv's diffusion KV manager does not serve " + "; ".join(refused))


if _OmniRequestScheduler is not None:

    class PagedKVRequestScheduler(_OmniRequestScheduler):  # type: ignore[misc]
        """vLLM-Omni's ``RequestScheduler`` (request batches) whose diffusion KV manager is pagedkv's core."""

        def initialize(self, od_config: Any, **kw: Any) -> None:
            _check(od_config)
            super().initialize(od_config, **kw)
            _install(self, od_config, kw)

    class PagedKVStepScheduler(_OmniStepScheduler):  # type: ignore[misc]
        """vLLM-Omni's ``StepScheduler`` (a denoising step a tick, requests joining and leaving between steps) whose
        diffusion KV manager is pagedkv's core."""

        def initialize(self, od_config: Any, **kw: Any) -> None:
            _check(od_config)
            super().initialize(od_config, **kw)
            _install(self, od_config, kw)

    class PagedKVDiffusionEngine(_OmniEngine):  # type: ignore[misc]
        """vLLM-Omni's ``DiffusionEngine`` scheduling with pagedkv's manager: ``PagedKVStepScheduler`` under step
        execution, else ``PagedKVRequestScheduler`` (a scheduler given to it is taken as it is)."""

        def _init_scheduler(self, od_config: Any, scheduler: Any = None, *args: Any, **kw: Any) -> None:
            if scheduler is None:
                step = getattr(self.execution_mode, "name", "") == "STEP_BATCH"
                scheduler = PagedKVStepScheduler() if step else PagedKVRequestScheduler()
            super()._init_scheduler(od_config, scheduler, *args, **kw)

else:  # pragma: no cover - vLLM-Omni absent

    class PagedKVRequestScheduler:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            omni()

    class PagedKVStepScheduler(PagedKVRequestScheduler):  # type: ignore[no-redef]
        pass

    class PagedKVDiffusionEngine(PagedKVRequestScheduler):  # type: ignore[no-redef]
        pass
