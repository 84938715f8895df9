"""vLLM's KV cache configuration as the core's: each group (full attention, a sliding window or a Mamba group
in ``mamba_cache_mode="align"``, one block size), the pool, the policies of vLLM's block pool, and the hash kind and seed vLLM hashes with. What the
manager does not serve is refused here, at construction, with the reason (``Unsupported``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pagedkv.core import CacheConfig, GroupKind, GroupSpec
from pagedkv.core.store.state import KVState
from pagedkv.integrations.vllm.version import SUPPORTED, Unsupported, release

DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for a cryptographic hash when PYTHONHASHSEED is unset


def vllm_modules() -> Any:
    """vLLM's modules the manager uses, or ``Unsupported`` where vLLM is not installed, or is a release the manager
    does not answer (``version.SUPPORTED``)."""

    try:
        release()
        from vllm.v1.core import kv_cache_manager, kv_cache_utils
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    except ImportError as exc:  # the extra is vLLM itself
        raise Unsupported(f"pagedkv's vLLM manager needs vLLM {' or '.join(SUPPORTED)} installed: {exc}") from None
    return kv_cache_manager, kv_cache_utils, FullAttentionSpec, SlidingWindowSpec, MambaSpec


def hash_seed() -> str:
    """The seed vLLM derived ``NONE_HASH`` from (its ``get_none_hash_seed``: PYTHONHASHSEED if set, a random one
    for the xxhash kinds, else its default), the root of the core's chains."""
    try:
        from vllm.v1.core.kv_cache_utils import get_none_hash_seed
    except ImportError:
        return os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    return str(get_none_hash_seed())


@dataclass(frozen=True)
class Geometry:
    config: CacheConfig  # the core's, with vLLM's block-pool policies
    caps: tuple[int | None, ...]  # per group: a window group's admission cap (full_sequence_must_fit), vLLM's
    windows: tuple[int | None, ...]  # per group: its sliding window, or None
    aligned: tuple[bool, ...]  # per group: a Mamba group in mamba_cache_mode="align"

    def growth_need(self, blocks: Any, num_tokens: int) -> int:
        """The blocks a running row of ``blocks`` (per group) takes growing to ``num_tokens``: each group's missing
        positions, an align-mode Mamba group's last one only."""
        want = -(-num_tokens // self.config.block_size)
        return sum(
            min(max(want - len(ids), 0), 1) if aligned else max(want - len(ids), 0)
            for ids, aligned in zip(blocks, self.aligned)
        )

    def capped_need(self, state: KVState, num_tokens: int, computed: int, hit_ids: Any) -> int:
        """vLLM's admission gate for ``full_sequence_must_fit``: the blocks the whole sequence takes, a window
        group's capped at its admission cap (its ``max_admission_blocks_per_request``), each hit block no one
        holds counted."""
        bs, refcount = self.config.block_size, state.refcount
        total = 0
        for ids, window, cap, aligned in zip(hit_ids or ((),) * len(self.caps), self.windows, self.caps, self.aligned):
            if aligned:  # (a block at the last position, and the hit's state block where no one holds it)
                total += min(max(-(-num_tokens // bs) - len(ids), 0), 1)
                total += sum(1 for b in ids if b and refcount[b] == 0)
                continue
            required = -(-num_tokens // bs) if cap is None else min(-(-num_tokens // bs), cap)
            skipped = max(0, computed - window + 1) // bs if window else 0
            total += max(required - max(skipped, len(ids)), 0)
            total += sum(1 for b in ids[skipped:] if b and refcount[b] == 0)
        return total


def translate(
    kv_cache_config: Any,
    *,
    max_model_len: int,
    block_size: int,
    in_flight: int,
    caching: bool,
    hash_algo: str,
    hash_lookahead: int = 0,
    kv_events: bool = True,
    refused: list[str],
) -> Geometry:
    """The core's geometry for vLLM's ``kv_cache_config``; ``refused`` (what the caller already refuses) and
    what this finds unserved raise ``Unsupported`` together. ``kv_events``: vLLM's ``enable_kv_cache_events``
    (off, the core builds no events)."""
    _, _, full_spec, window_spec, mamba_spec = vllm_modules()
    groups: list[GroupSpec] = []
    caps: list[int | None] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if getattr(spec, "block_size", None) != block_size:
            refused.append(
                f"group {i}'s block size {getattr(spec, 'block_size', None)} (pagedkv pools one "
                f"block size: {block_size})"
            )
        if type(spec) is full_spec:
            groups.append(GroupSpec(f"g{i}"))
            caps.append(None)
        elif type(spec) is window_spec:
            groups.append(GroupSpec(f"g{i}", GroupKind.SLIDING_WINDOW, window=spec.sliding_window))
            caps.append(
                spec.max_admission_blocks_per_request(max_in_flight_tokens=in_flight, max_model_len=max_model_len)
            )
        elif (
            type(spec) is mamba_spec
            and spec.mamba_cache_mode == "align"
            and not (spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks)
        ):
            groups.append(GroupSpec(f"g{i}", GroupKind.MAMBA_ALIGN))
            caps.append(None)
        elif type(spec) is mamba_spec:
            refused.append(
                f"group {i}'s MambaSpec with mamba_cache_mode={spec.mamba_cache_mode!r}, "
                f"{spec.num_speculative_blocks} speculative and {spec.num_prefill_checkpoint_blocks} "
                "prefill checkpoint blocks (Mamba groups in mode 'align' without either only)"
            )
        else:
            refused.append(
                f"group {i}'s {type(spec).__name__} (full attention, sliding windows and Mamba in "
                "mamba_cache_mode='align' only)"
            )
    config = None
    try:
        config = CacheConfig(
            block_size=block_size,
            num_blocks=kv_cache_config.num_blocks,
            groups=tuple(groups),
            enable_prefix_caching=caching,
            max_model_len=max_model_len,
            hash_namespace=hash_seed(),
            free_queue="vllm",
            reset_prefix_cache="when_idle",
            caching_point="schedule",
            block_hash=hash_algo,
            cache_duplicates=True,
            hash_lookahead=hash_lookahead,
            kv_events=kv_events,
            # vLLM's request.block_hashes are taken as the core's; PAGEDKV_CHECK_HASHES=1 checks each (tests do)
            check_given_hashes=os.environ.get("PAGEDKV_CHECK_HASHES", "0") == "1",
        )
    except ValueError as e:  # (InvalidConfig: a hash kind whose package is absent, an empty group list)
        refused.append(f"this cache configuration ({e})")
    if refused or config is None:
        raise Unsupported("pagedkv's KV cache manager does not serve " + "; ".join(refused))
    return Geometry(
        config, tuple(caps), tuple(g.window for g in groups), tuple(g.kind is GroupKind.MAMBA_ALIGN for g in groups)
    )
