"""What sizes and switches an engine (``EngineArgs``), which attention backend it runs (``backend_for``),
what it counts (``EngineStats``), and the process's GC policy once it stands (``freeze_startup``)."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.core.config import InvalidConfig

from pagedkv.shell.attention import AttentionBackend, get_backend
from pagedkv.shell.graphs import GRAPH_ROWS, launches_outweigh
from pagedkv.shell.invariant import InvariantBackend
from pagedkv.shell.kv_scales import KV_CACHE_DTYPES, kv_dtype_of, scales_for
from pagedkv.shell.rank import Rank, measured_budget, plan_for, rank_for
from pagedkv.shell.speculative import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """An engine's sizes and switches, in one place (a launcher of several ranks reads them too)."""

    block_size: int = 16
    kv_cache_memory_bytes: int = 256 << 20  # per rank
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    backend: str = "auto"  # auto: triton on CUDA (where it imports), torch elsewhere
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs, where the backend can be captured
    chunked_prefill: bool = True  # off: a prompt runs whole, alone in a step when it is over the budget
    caching_point: str = "commit"  # CacheConfig.caching_point: "schedule" caches a prefill chunk's blocks when planned
    free_queue: str = "tail"  # CacheConfig.free_queue: "vllm" reuses freed blocks without a hash first
    grow_prefill: bool = False  # SchedulerConfig.grow_prefill: a prompt's blocks chunk by chunk (window groups
    # then hold a window and a chunk, not the whole prompt)
    # SchedulerConfig.long_prefill_token_threshold (vLLM's): the most prompt tokens one request's chunk takes a step;
    # None: the prefill tokens a captured graph holds where decode steps replay graphs (prefill_chunk_cap), else 0
    long_prefill_token_threshold: int | None = None
    # vLLM's speculative_config (a mapping, its JSON text or a SpeculativeConfig): n-gram prompt lookup drafts,
    # verified in one forward ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    # "prompt_lookup_min": 2}); None: one token a request a step
    speculative_config: Any = None
    # overlapped scheduling (vLLM's async_scheduling): step N+1 planned, installed and launched before step N's
    # ids are read (shell.overlap); a stop token then ends its request a step later
    async_scheduling: bool = False
    # the pages' dtype (vLLM's kv_cache_dtype): "auto" (the model's), "fp8" / "fp8_e4m3" (e4m3), "fp8_e5m2"; fp8 pages
    # hold each layer's K and V over its scales (the checkpoint's, or calibrated at start-up: shell.kv_scales)
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # a request's tokens at most (vLLM's); None: the model's positions
    # vLLM's: on CUDA, the fraction of the device the weights, a forward of the largest step and the KV pages may
    # take; the pages get what is left (measured at start-up: shell.rank.measured_budget). None: the byte budget
    gpu_memory_utilization: float | None = None
    # vLLM's VLLM_BATCH_INVARIANT: a request's tokens the same whatever else is in the batch (shell.invariant):
    # every query token read as a decode row with fixed key splits, products and norms over row counts the device
    # keeps a row's bits for; the triton backend on CUDA, the torch backend elsewhere
    batch_invariant: bool = False
    # vLLM's --kv-offloading-size (GiB) and --kv-offloading-backend ("native"): the prefix cache's host tier; a
    # cached block the pool evicts is kept in host memory, a hit there loaded back (core/store/host.py, shell/host_pages.py)
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    # vLLM's offloading store_threshold (its kv_connector_extra_config): at 2 or more the tier keeps only contents
    # seen in that many uses (a request computing it, a hit), counted for the last ``kv_offloading_tracker_size``
    # contents; below 2 every evicted block (CacheConfig.host_store_threshold)
    kv_offloading_store_threshold: int = 0
    kv_offloading_tracker_size: int = 64_000

    def __post_init__(self) -> None:
        if self.speculative_config is not None and self.async_scheduling:
            raise InvalidConfig("speculative decoding with async_scheduling is not served yet: use one of them")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidConfig(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.max_model_len is not None and (type(self.max_model_len) is not int or self.max_model_len < 1):
            raise InvalidConfig(f"max_model_len must be a positive integer or None, got {self.max_model_len!r}")
        size = self.kv_offloading_size
        if size is not None and (type(size) not in (int, float) or not size > 0):
            raise InvalidConfig(f"kv_offloading_size must be a positive number of GiB or None, got {size!r}")
        if self.kv_offloading_backend != "native":
            raise InvalidConfig(
                f"kv_offloading_backend {self.kv_offloading_backend!r} is not served: pagedkv's tier is 'native' "
                "(LMCache and other connectors are vLLM's)"
            )
        if size is not None and not self.enable_prefix_caching:
            raise InvalidConfig("kv_offloading_size keeps the prefix cache's evicted blocks: it needs prefix caching")
        threshold, tracked = self.kv_offloading_store_threshold, self.kv_offloading_tracker_size
        if type(threshold) is not int or not 0 <= threshold < 1 << 31:
            raise InvalidConfig(f"kv_offloading_store_threshold must be a non-negative integer, got {threshold!r}")
        if type(tracked) is not int or not 1 <= tracked < 1 << 31:
            raise InvalidConfig(f"kv_offloading_tracker_size must be a positive integer, got {tracked!r}")
        if threshold > 1 and size is None:
            raise InvalidConfig(
                "kv_offloading_store_threshold chooses what the host tier keeps: it needs kv_offloading_size"
            )
        fraction = self.gpu_memory_utilization
        if fraction is not None and (type(fraction) not in (int, float) or not 0 < fraction <= 1):
            raise InvalidConfig(f"gpu_memory_utilization must be a number in (0, 1] or None, got {fraction!r}")

    def model_len(self, model: Any) -> int:
        """A request's tokens at most: ``max_model_len`` where given (not past the model's positions), else the
        model's positions."""
        if self.max_model_len is None:
            return int(model.config.max_position)
        if self.max_model_len > model.config.max_position:
            raise InvalidConfig(
                f"max_model_len {self.max_model_len} is past the model's {model.config.max_position} positions"
            )
        return self.max_model_len

    def step_tokens(self, model: Any) -> int:
        """The most query tokens one step's forward may hold: the budget, or with chunked prefill off a whole
        prompt (up to the model's length), which the scheduler runs alone when it is over the budget."""
        return (
            self.max_num_batched_tokens
            if self.chunked_prefill
            else max(self.max_num_batched_tokens, self.model_len(model))
        )

    def token_rows(self, model: Any = None, backend: AttentionBackend | None = None) -> int:
        """Query tokens a step may lay out one a forward row (``Worker``), for the decode kernel and its CUDA
        graphs: with speculation, every request and all its drafts (a verify step); where decode steps replay
        graphs (a CUDA ``model``, a capturable ``backend``), a prefill chunk of up to ``GRAPH_ROWS`` tokens too
        (``ModelRunner._forward``: a step that carries one runs as graph replays, not layer by layer), unless the model
        keeps Mamba states (a state steps through a row's tokens in order: they are never rows of their own); 0
        else."""
        spec = SpeculativeConfig.of(self.speculative_config)
        rows = 0 if spec is None else self.max_num_seqs * (1 + spec.num_speculative_tokens)
        if self.batch_invariant and model is not None:  # (every query token a row: shell.invariant)
            return max(rows, self.step_tokens(model))
        return rows if model is None else max(rows, self.graph_prefill_rows(model, backend))

    def prefill_chunk_cap(self, model: Any, backend: AttentionBackend | None) -> int:
        """``long_prefill_token_threshold`` as the scheduler takes it: the one given, or where prefill forwards of a
        captured bucket's tokens replay graphs (``token_rows``) and the model's launches outweigh those tokens'
        matrix work (``graphs.launches_outweigh``) those tokens, so that a long prompt's chunks replay them too
        instead of launching each layer from the host (a step of the decoding rows waits for each chunk); else 0,
        as vLLM's (a model whose products outweigh its launches, Llama-1B's and -8B's shapes: a cap only reads the
        weights once more a chunk, and keeps a long prompt's first token several steps away)."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        rows = self.graph_prefill_rows(model, backend)
        return rows if launches_outweigh(model, rows, self.async_scheduling) else 0

    def graph_prefill_rows(self, model: Any, backend: AttentionBackend | None) -> int:
        """Prompt tokens a prefill forward may lay out one a row for the decode graphs: where decode steps replay
        graphs and the model keeps no Mamba states (a state steps through a row's tokens in order), the step's
        tokens up to ``GRAPH_ROWS``; else 0."""
        if self.graphs_for(model, backend) and getattr(model, "state_shape", None) is None:
            return min(self.step_tokens(model), GRAPH_ROWS)
        return 0

    def graphs_for(self, model: Any, backend: AttentionBackend | None) -> bool:
        """Do decode forwards of ``model`` through ``backend`` replay CUDA graphs (``cuda_graphs``, a CUDA device,
        a backend and a model that can be captured)?"""
        device = getattr(model, "device", None)
        return (
            self.cuda_graphs
            and isinstance(device, torch.device)
            and device.type == "cuda"
            and getattr(backend, "capturable", False)
            and getattr(model, "capturable", True)
        )

    def attention(self, model: Any) -> AttentionBackend:
        """The attention backend these arguments name, for ``model``'s device (``auto`` resolved); with
        ``batch_invariant`` the invariant one over it (``shell.invariant.InvariantBackend``)."""
        name = backend_for(self.backend, model.device)
        if not self.batch_invariant:
            return get_backend(name)
        want = "triton" if model.device.type == "cuda" else "torch"
        if name != want:
            raise InvalidConfig(
                f"batch_invariant reads attention through the {want} backend on a {model.device.type} device (its "
                f"fixed key splits), not {name}"
            )
        if not getattr(model, "batch_invariant", False):
            raise InvalidConfig(
                f"batch_invariant is served for the Llama-family decoder (models.llama), not {type(model).__name__}"
            )
        return InvariantBackend(get_backend(want, invariant=True), model.device)

    def rank_for(
        self, model: Any, backend: AttentionBackend | None = None, calibration: Any = None, kv_scales: Any = None
    ) -> Rank:
        """The KV side these arguments give ``model`` (``shell.rank.rank_for``); ``backend`` (by default
        ``attention(model)``) lends the pool its fused K/V write, where it has one; ``calibration``: token ids of
        the forward that computes fp8 pages' scales where the checkpoint has none; ``kv_scales``: fp8 pages' scales
        found already (several ranks calibrate together: ``app.ranks``)."""
        backend = backend if backend is not None else self.attention(model)
        kv_dtype = kv_dtype_of(self.kv_cache_dtype)
        if kv_dtype is not None and not getattr(backend, "fp8_pages", False):
            raise InvalidConfig(
                f"the {backend.name} backend has no fp8 path: kv_cache_dtype {self.kv_cache_dtype} "
                "runs on the torch, triton and flashinfer backends (the pool is never upcast in silence)"
            )
        if kv_dtype is not None and getattr(model, "state_shape", None) is not None:
            raise InvalidConfig("fp8 pages beside Mamba states are not served: a state kept in fp8 drifts step by step")
        if getattr(model, "state_shape", None) is not None and self.speculative_config is not None:
            raise InvalidConfig(
                "speculative decoding is not served for a model with Mamba states: a rejected draft "
                "would stay in the row's state (it cannot be cut back as K/V blocks are)"
            )
        budget = self.kv_cache_memory_bytes
        if self.gpu_memory_utilization is not None:  # (the pages of the model's dtype or fp8: the plan they need)
            plan = plan_for(model, block_size=self.block_size, kv_dtype=kv_dtype)
            budget = measured_budget(
                model, plan, fraction=self.gpu_memory_utilization, tokens=self.step_tokens(model), backend=backend
            )
        return rank_for(
            model,
            max_model_len=self.model_len(model),
            block_size=self.block_size,
            kv_cache_memory_bytes=budget,
            enable_prefix_caching=self.enable_prefix_caching,
            max_rows=self.max_num_seqs,
            max_tokens=self.step_tokens(model),
            token_rows=self.token_rows(model, backend),
            backend=backend,
            caching_point=self.caching_point,
            free_queue=self.free_queue,
            kv_dtype=kv_dtype,
            kv_scales=kv_scales if kv_scales is not None else scales_for(model, kv_dtype, calibration, backend),
            host_bytes=int(self.kv_offloading_size * 2**30) if self.kv_offloading_size else 0,
            host_store_threshold=self.kv_offloading_store_threshold,
            host_tracker_size=self.kv_offloading_tracker_size,
        )


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0
    verifies: int = 0  # speculative decoding: decodes that verified drafts,
    draft_tokens: int = 0  # the drafts they verified,
    accepted_tokens: int = 0  # and the drafts the target accepted

    def verified(self, verify: Any, got: Any) -> Any:
        """Counts a step's verifies (``StepPlan.verify``) from what each request took (its accepted drafts,
        then one token); ``got`` back."""
        for rid, draft in verify:
            self.verifies += 1
            self.draft_tokens += len(draft)
            self.accepted_tokens += len(got[rid]) - 1
        return got

    @property
    def acceptance(self) -> float | None:
        """Accepted drafts over drafts verified (None without any)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


def backend_for(name: str, device: torch.device) -> str:
    """``auto``: the triton backend on a CUDA device where Triton imports, else torch; any other name as given.

    >>> backend_for("auto", torch.device("cpu")), backend_for("torch", torch.device("cuda"))
    ('torch', 'torch')
    """
    if name != "auto":
        return name
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return "torch"


def freeze_startup() -> None:
    """What a serving process should do once its model, pools and engine exist: collect, then move
    everything alive into CPython's permanent generation (``gc.freeze``, as vLLM's engine core
    does), so full collections never walk the weights' and the start-up state's objects again.
    The core does not need it (its step leaves little for the GC to walk, with the GC on at
    default thresholds: bench/peers.py); it is the process's policy, so the app calls it, never
    the library on its own."""
    gc.collect()
    gc.freeze()
