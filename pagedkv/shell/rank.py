"""One way to build a rank's KV side, the same for the engine, the followers, ``denoise``, the
graphs and the benches: the model's layers -> the grouping plan (``core.grouping.plan_groups``)
-> the core's geometry (``CacheConfig``) -> pages (``PagePool``) -> the worker's buffers.

    plan = plan_rank(attention_layers(30, kv_heads=3, head_dim=64, dtype=torch.bfloat16), block_size=16)
    sizing = size_pool(plan, kv_cache_memory_bytes=1 << 30)       # or memory_fraction + profile on CUDA
    cache = plan.cache_config(sizing.num_blocks, enable_prefix_caching=True, max_model_len=8192)
    rank = build_rank(plan, cache, max_rows=16, max_tokens=2048, device="cuda", backend=backend)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedkv.core.config import CacheConfig, GroupSpec, InvalidConfig
from pagedkv.core.grouping import GroupPlan, LayerKind, LayerSpec, num_blocks_for_budget, plan_groups
from pagedkv.shell.attention.base import AttentionBackend
from pagedkv.shell.pool import PagePool, StateShape
from pagedkv.shell.worker import Worker

PAGED_KINDS = (LayerKind.FULL, LayerKind.SLIDING_WINDOW, LayerKind.CHUNKED_LOCAL)  # what PagePool's K/V pages hold


def attention_layers(
    num_layers: int, *, kv_heads: int, head_dim: int, dtype: torch.dtype, prefix: str = "layer"
) -> tuple[LayerSpec, ...]:
    """``num_layers`` full-attention layers of one K/V shape (a Llama, the DiT reference)."""
    return tuple(
        LayerSpec(f"{prefix}{i}", kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype.itemsize)
        for i in range(num_layers)
    )


@dataclass(frozen=True, slots=True)
class RankPlan:
    """The grouping plan of this rank's layers, the one K/V page shape they share, and what a Mamba layer keeps
    in a state page (None: no state layers)."""

    groups: GroupPlan
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    state: StateShape | None = None

    @property
    def block_size(self) -> int:
        return self.groups.block_size

    def cache_config(self, num_blocks: int, **limits: object) -> CacheConfig:
        """The core's geometry for this plan; ``limits``: CacheConfig's other fields."""
        return self.groups.cache_config(num_blocks, **limits)


def plan_rank(
    layers: Sequence[LayerSpec], *, block_size: int, dtype: torch.dtype, state: StateShape | None = None
) -> RankPlan:
    """Plan ``layers`` (``plan_groups``) for K/V pages of one shape, and Mamba layers' states of shape ``state`` in
    the same pages; raises ``InvalidConfig`` for layers these pages cannot hold (MLA's latent pages have a pool of
    their own) and for state layers without ``state`` or of another size."""
    owners = [layer for layer in layers if layer.kv_sharing_target is None]
    odd = sorted(
        {layer.kind.value for layer in owners if layer.kind not in PAGED_KINDS and layer.kind is not LayerKind.MAMBA}
    )
    if odd:
        raise InvalidConfig(f"K/V page pools hold attention layers with heads; {odd} layers need their own pools")
    states = {layer.state_bytes for layer in owners if layer.kind is LayerKind.MAMBA}
    if states and (state is None or states != {state.elements * dtype.itemsize}):
        raise InvalidConfig(
            f"state layers of {sorted(states, key=str)} bytes need one state shape of that size "
            f"(plan_rank's state: {state})"
        )
    attention = [layer for layer in owners if layer.kind is not LayerKind.MAMBA]
    if not attention:
        raise InvalidConfig("a pool of state layers alone is not planned: the pages take their size from attention")
    shapes = {(layer.kv_heads, layer.head_dim, layer.dtype_bytes) for layer in attention}
    if len(shapes) > 1:
        raise InvalidConfig(
            f"one page pool holds one K/V shape (kv_heads, head_dim, dtype bytes); these layers have {sorted(shapes)}"
        )
    plan = plan_groups(tuple(layers), block_size)
    ((kv_heads, head_dim, dtype_bytes),) = shapes
    if dtype_bytes != dtype.itemsize:
        raise InvalidConfig(f"layers of {dtype_bytes}-byte elements planned for {dtype} pages")
    return RankPlan(plan, kv_heads, head_dim, dtype, state if states else None)


@dataclass(frozen=True, slots=True)
class PoolSizing:
    num_blocks: int  # including the null block 0
    page_bytes: int  # all layers' K and V pages of one block
    total_bytes: int
    tokens: int  # tokens the usable blocks hold

    def __str__(self) -> str:
        return (
            f"{self.num_blocks} blocks ({self.num_blocks - 1} usable) x {self.page_bytes} bytes = "
            f"{self.total_bytes / 2**20:.1f} MiB, {self.tokens} tokens"
        )


def size_pool(
    plan: RankPlan,
    *,
    device: torch.device | str = "cpu",
    kv_cache_memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    profile: Callable[[], object] | None = None,
) -> PoolSizing:
    """Blocks for an explicit byte budget (``num_blocks_for_budget``), or (CUDA) for a memory fraction
    of the device minus the non-KV memory a profile forward of the largest shape takes."""
    device = torch.device(device)
    if kv_cache_memory_bytes is None:
        if device.type != "cuda":
            raise InvalidConfig(
                f"on {device.type} the KV budget must be given: pass kv_cache_memory_bytes "
                "(a memory fraction is measured only on CUDA)"
            )
        if memory_fraction is None or not 0 < memory_fraction <= 1 or profile is None:
            raise InvalidConfig(
                "on CUDA give kv_cache_memory_bytes, or memory_fraction in (0, 1] with a profile "
                "forward of the largest shape"
            )
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile()
        torch.cuda.synchronize(device)
        non_kv = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        kv_cache_memory_bytes = int(total * memory_fraction) - non_kv
        if kv_cache_memory_bytes < 0:
            raise InvalidConfig(
                f"the profile forward takes {non_kv} bytes: {memory_fraction} of the device's "
                f"{total} leaves nothing for KV pages"
            )
    n = num_blocks_for_budget(kv_cache_memory_bytes, plan.groups)
    per_block = plan.groups.bytes_per_block
    return PoolSizing(n, per_block, n * per_block, (n - 1) * plan.block_size)


class PagedModel(Protocol):
    """What ``rank_for`` reads of a model: its paged layers, element type, device and longest row."""

    dtype: torch.dtype
    device: torch.device

    def kv_layers(self) -> Sequence[LayerSpec]: ...


@dataclass(frozen=True, slots=True)
class LayerPlace:
    """Where one layer's KV lives: its KV cache group (index into the geometry's groups: its block
    table) and its page tensor (the pool's slot ``slot``, shared with that slot of every other group)."""

    group: int
    spec: GroupSpec
    slot: int
    kv_scales: tuple[float, float] = (1.0, 1.0)  # fp8 pages: the layer's K and V scales


class Layout:
    """Each planned layer's place (vLLM's layout: for n groups of m layers, m page tensors, tensor i shared
    by layer slot i of every group; block ids are unique across groups, so they never collide). A layer
    that reads another's KV takes its target's place."""

    def __init__(
        self, plan: GroupPlan, groups: tuple[GroupSpec, ...], kv_scales: Mapping[str, tuple[float, float]] | None = None
    ) -> None:
        scales = kv_scales or {}
        self.by_name = {
            name: LayerPlace(g, groups[g], i, scales.get(name, (1.0, 1.0)))
            for g, pg in enumerate(plan.groups)
            for i, name in enumerate(pg.layers)
        }
        for layer, target in plan.shared:
            self.by_name[layer] = self.by_name[target]
        self._of: dict[tuple[str, ...], tuple[LayerPlace, ...]] = {}

    def of(self, names: Sequence[str]) -> tuple[LayerPlace, ...]:
        """The places of ``names`` (a model's layers, in order); ``InvalidConfig`` for a layer not planned."""
        key = tuple(names)
        got = self._of.get(key)
        if got is None:
            missing = [n for n in key if n not in self.by_name]
            if missing:
                raise InvalidConfig(f"layers {missing[:4]} are not in this rank's plan")
            got = self._of[key] = tuple(self.by_name[n] for n in key)
        return got


@dataclass(slots=True)
class Rank:
    """One rank's KV side: the plan, the core's geometry, its pages, its worker, and where each layer's
    KV lives (``layout``: the model's forward takes it)."""

    plan: RankPlan
    cache: CacheConfig
    pool: PagePool
    worker: Worker
    layout: Layout

    @property
    def sizing(self) -> PoolSizing:
        n, per_block = self.cache.num_blocks, self.plan.groups.bytes_per_block
        return PoolSizing(n, per_block, n * per_block, (n - 1) * self.cache.block_size)

    @property
    def group(self) -> GroupSpec:
        """The KV cache group every layer reads, for models of one group (the DiT); a hybrid model's layers
        find theirs in ``layout``."""
        if len(self.cache.groups) != 1:
            raise InvalidConfig(f"this model runs one KV cache group; the plan has {len(self.cache.groups)}")
        return self.cache.groups[0]


def build_rank(
    plan: RankPlan,
    cache: CacheConfig,
    *,
    max_rows: int,
    max_tokens: int,
    token_rows: int = 0,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
    kv_scales: Mapping[str, tuple[float, float]] | None = None,
) -> Rank:
    """Pages and worker buffers for ``cache`` (rank 0's geometry, or the one it broadcast), which must be
    ``plan``'s: the same block size and groups. Rows hold ``max_model_len`` (every block a row can need);
    ``token_rows``: query tokens a forward may lay out one a row (``Worker``); ``backend`` lends the pool its
    fused K/V write, when it has one; ``kv_scales``: each layer's K and V scale, for fp8 pages (``shell.kv_scales``)."""
    want = plan.cache_config(cache.num_blocks)
    if (cache.block_size, cache.groups) != (want.block_size, want.groups):
        raise InvalidConfig(
            f"geometry of block size {cache.block_size} and groups {[g.name for g in cache.groups]} "
            f"is not this rank's plan ({want.block_size}, {[g.name for g in want.groups]})"
        )
    if cache.max_model_len is None:
        raise InvalidConfig("a rank's geometry needs max_model_len: it sizes the block-table rows")
    pool = PagePool(
        cache,
        num_layers=plan.groups.layers_per_group,
        kv_heads=plan.kv_heads,
        head_dim=plan.head_dim,
        dtype=plan.dtype,
        device=device,
        write=None if backend is None else backend.kv_write,
        state=plan.state,
    )
    worker = Worker(
        cache,
        max_rows=max_rows,
        max_blocks_per_row=cache.blocks_for(cache.max_model_len),
        max_tokens=max_tokens,
        token_rows=token_rows,
        device=device,
    )
    return Rank(plan, cache, pool, worker, Layout(plan.groups, cache.groups, kv_scales))


def measured_budget(
    model: PagedModel, plan: RankPlan, *, fraction: float, tokens: int, backend: AttentionBackend
) -> int:
    """vLLM's ``gpu_memory_utilization`` on CUDA: the bytes of KV pages ``fraction`` of the device leaves once
    the weights and a forward of the largest step (one row of ``tokens`` query tokens, over a pool of the model's
    dtype just big enough for it) are counted (``size_pool``'s measure), in ``plan``'s blocks (fp8 ones too);
    ``InvalidConfig`` off CUDA, or when nothing is left."""
    if torch.device(model.device).type != "cuda":
        raise InvalidConfig(f"a memory fraction is measured on CUDA; on {model.device} give kv_cache_memory_bytes")

    def profile() -> None:  # (its pages and buffers are freed when it returns)
        from pagedkv.core import RequestSpec, RowSpec, admit, initial_state, publish

        own = plan_for(model, block_size=plan.block_size)
        cache = own.cache_config(-(-tokens // plan.block_size) + 2, max_model_len=tokens)  # (room for the row)
        probe = build_rank(own, cache, max_rows=1, max_tokens=tokens, device=model.device, backend=backend)
        state = admit(initial_state(cache), RequestSpec("profile", (RowSpec(tokens),))).unwrap().state
        batch = probe.worker.install(publish(state, ["profile"], "prefill").unwrap().effect)
        ids = torch.zeros(tokens, dtype=torch.int64, device=model.device)
        model.forward(ids, batch, probe.pool, backend, probe.layout)  # type: ignore[attr-defined]

    sizing = size_pool(plan, device=model.device, memory_fraction=fraction, profile=profile)
    torch.cuda.empty_cache()
    return sizing.total_bytes


def plan_for(model: PagedModel, *, block_size: int, kv_dtype: torch.dtype | None = None) -> RankPlan:
    """``plan_rank`` over ``model``'s layers, its Mamba states beside them; every attention layer's page element
    ``kv_dtype``'s where given (fp8: the pool sized by its bytes)."""
    layers = tuple(model.kv_layers())
    if kv_dtype is not None:
        layers = tuple(replace(x, dtype_bytes=kv_dtype.itemsize) if x.kind in PAGED_KINDS else x for x in layers)
    return plan_rank(
        layers, block_size=block_size, dtype=kv_dtype or model.dtype, state=getattr(model, "state_shape", None)
    )


def rank_for(
    model: PagedModel,
    *,
    max_model_len: int,
    block_size: int,
    kv_cache_memory_bytes: int,
    enable_prefix_caching: bool,
    max_rows: int,
    max_tokens: int,
    token_rows: int = 0,
    backend: AttentionBackend | None = None,
    kv_dtype: torch.dtype | None = None,
    kv_scales: Mapping[str, tuple[float, float]] | None = None,
    host_bytes: int = 0,
    host_store_threshold: int = 0,
    host_tracker_size: int = 64_000,
    **policies: str,
) -> Rank:
    """The whole path for one model on one device: plan its layers, size the pool for the budget,
    the geometry, the pages and the worker. ``kv_dtype``: the pages' dtype where it is not the model's (fp8, with
    ``kv_scales``). ``host_bytes``: the prefix cache's host tier (core/store/host.py), in blocks of the pages' size;
    ``host_store_threshold``, ``host_tracker_size``: which evicted blocks it keeps (CacheConfig's).
    ``policies``: CacheConfig's ``caching_point``, ``free_queue``."""
    plan = plan_for(model, block_size=block_size, kv_dtype=kv_dtype)
    sizing = size_pool(plan, device=model.device, kv_cache_memory_bytes=kv_cache_memory_bytes)
    host_blocks = host_bytes // sizing.page_bytes if host_bytes else 0
    if host_bytes and not host_blocks:
        raise InvalidConfig(f"a host tier of {host_bytes} bytes holds no block of {sizing.page_bytes} bytes")
    cache = plan.cache_config(
        sizing.num_blocks,
        enable_prefix_caching=enable_prefix_caching,
        max_model_len=max_model_len,
        host_blocks=host_blocks,
        host_store_threshold=host_store_threshold,
        host_tracker_size=host_tracker_size,
        **policies,
    )
    return build_rank(
        plan,
        cache,
        max_rows=max_rows,
        max_tokens=max_tokens,
        token_rows=token_rows,
        device=model.device,
        backend=backend,
        kv_scales=kv_scales,
    )
