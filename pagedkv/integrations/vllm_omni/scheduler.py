"""vLLM-Omni's diffusion request scheduler with pagedkv's manager installed (docs/vllm-omni.md).

``PagedKVRequestScheduler`` is vLLM-Omni's own ``RequestScheduler``, unchanged but for the manager
``initialize`` builds under ``diffusion_kv_mode="paged_scheduler"``: pagedkv's ``PagedKVDiffusionManager``, from the
same settings vLLM-Omni builds its own from, and the adapter's row limit (``diffusion_kv_max_rows_per_request``)
checked at admission. ``PagedKVDiffusionEngine`` is vLLM-Omni's ``DiffusionEngine`` that schedules requests with it:
a deploy config selects it with one line, ``engine_backend: pagedkv.integrations.vllm_omni.PagedKVDiffusionEngine``.
What stays vLLM-Omni's own, refused where asked for: KV connectors (P/D transfers, ``omni_kv_config``'s prefetch),
independent K/V contexts (the manager refuses them as vLLM-Omni's does), and step-level batching (``StepScheduler``:
vLLM-Omni refuses it under paged KV).
"""

from __future__ import annotations

from typing import Any

from pagedkv.integrations.vllm_omni.manager import PagedKVDiffusionManager, omni

try:
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine as _OmniEngine
    from vllm_omni.diffusion.sched.request_scheduler import RequestScheduler as _OmniRequestScheduler
except ImportError:  # vLLM-Omni is the extra: the classes are defined only where it is installed
    _OmniEngine = _OmniRequestScheduler = None


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


if _OmniRequestScheduler is not None:

    class PagedKVRequestScheduler(_OmniRequestScheduler):  # type: ignore[misc]
        """vLLM-Omni's ``RequestScheduler`` whose diffusion KV manager is pagedkv's core."""

        _diffusion_kv_manager: Any

        def initialize(self, od_config: Any, **kw: Any) -> None:
            refused = refusals(od_config)
            if refused:
                raise Unsupported("pagedkv's diffusion KV manager does not serve " + "; ".join(refused))
            super().initialize(od_config, **kw)
            theirs: Any = self._diffusion_kv_manager
            if theirs is None:  # (dense_legacy: no paged KV to manage)
                return
            config = kw["kv_vllm_config"]
            self._diffusion_kv_manager = PagedKVDiffusionManager(
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

    class PagedKVDiffusionEngine(_OmniEngine):  # type: ignore[misc]
        """vLLM-Omni's ``DiffusionEngine`` whose request scheduler is ``PagedKVRequestScheduler`` (a scheduler given
        to it is taken as it is; step-batch execution keeps vLLM-Omni's ``StepScheduler``)."""

        def _init_scheduler(self, od_config: Any, scheduler: Any = None, *args: Any, **kw: Any) -> None:
            if scheduler is None and getattr(self.execution_mode, "name", "") != "STEP_BATCH":
                scheduler = PagedKVRequestScheduler()
            super()._init_scheduler(od_config, scheduler, *args, **kw)

else:  # pragma: no cover - vLLM-Omni absent

    class PagedKVRequestScheduler:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            omni()

    class PagedKVDiffusionEngine(PagedKVRequestScheduler):  # type: ignore[no-redef]
        pass
