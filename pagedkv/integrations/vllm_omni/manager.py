"""vLLM-Omni's diffusion KV manager interface over pagedkv's pure core (docs/vllm-omni.md).

vLLM-Omni 0.30's scheduler (``vllm_omni.diffusion.sched``) calls six methods of its manager: ``has_request``,
``get_metadata``, ``reserve_request``, ``publish_request``, ``free_request`` and ``close``. ``PagedKVDiffusionManager``
answers them as ``DiffusionKVCacheManager`` does (metadata; ``None`` for "not now"; ``DiffusionKVAdmissionError`` for
"never"), deciding with pagedkv's core: one request a public request, one row a CFG sequence, all rows admitted or
none, the smallest prefix hit shared by the rows, the prefix cached once published, the rows let go the last first
(``free_queue="vllm-omni"``). The state is one persistent ``KVState``; a refused reservation leaves it as it was.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence
from typing import Any

from returns.result import Failure

from pagedkv.core import (
    CacheConfig,
    ErrorCode,
    GroupSpec,
    KVState,
    RequestSpec,
    RowSpec,
    admit,
    commit,
    initial_state,
    release,
    turn_away,
)


@functools.cache
def omni() -> Any:
    """vLLM-Omni's diffusion KV module (its error and metadata classes), imported when a manager is made: this
    module imports without it."""
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm_omni.diffusion.diffusion_kv import manager, metadata
    except ImportError as e:
        raise ImportError(
            f"pagedkv.integrations.vllm_omni needs vLLM-Omni 0.30 (pip install 'pagedkv[vllm-omni]'): {e}"
        ) from None
    return types.SimpleNamespace(
        AdmissionError=manager.DiffusionKVAdmissionError,
        Metadata=metadata.DiffusionKVMetadata,
        Sequence=metadata.DiffusionKVSequenceMetadata,
        hash_fn=get_hash_fn_by_name,
    )


__all__ = ["PagedKVDiffusionManager"]


class PagedKVDiffusionManager:
    """``DiffusionKVCacheManager``'s interface and decisions, pagedkv's core deciding.

    Takes ``DiffusionKVCacheManager``'s arguments. ``kv_cache_config``'s groups must be full-attention groups of one
    block size (a DiT's); ``scheduler_block_size`` and ``hash_block_size`` that block size. ``max_rows_per_request``
    (pagedkv's, optional): a request of more rows is refused at admission ("never"), not at the worker's install.
    """

    def __init__(
        self,
        kv_cache_config: Any,
        *,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_prefix_caching: bool = False,
        prefix_caching_hash_algo: str = "sha256",
        max_rows_per_request: int | None = None,
    ) -> None:
        self._omni = omni()
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
        if kv_cache_config.num_blocks <= 0 or not groups:
            raise ValueError("Diffusion KVCacheConfig must contain a positive block pool and at least one group")
        if scheduler_block_size <= 0 or hash_block_size <= 0:
            raise ValueError("scheduler_block_size and hash_block_size must be positive")
        if max_in_flight_tokens is not None and max_in_flight_tokens <= 0:
            raise ValueError(f"max_in_flight_tokens must be positive when provided, got {max_in_flight_tokens}")
        sizes = {int(g.kv_cache_spec.block_size) for g in groups}
        partial = [
            type(g.kv_cache_spec).__name__
            for g in groups
            if type(g.kv_cache_spec).__name__ not in ("FullAttentionSpec", "MLAAttentionSpec")
            or getattr(g.kv_cache_spec, "sliding_window", None)
            or getattr(g.kv_cache_spec, "attention_chunk_size", None)
        ]
        if partial or len(sizes) != 1 or {scheduler_block_size, hash_block_size} != sizes:
            raise ValueError(
                "pagedkv's vLLM-Omni manager serves full-attention groups of one block size, scheduled and hashed "
                f"at that size: got groups {[type(g.kv_cache_spec).__name__ for g in groups]}, block sizes "
                f"{sorted(sizes)}, scheduler_block_size {scheduler_block_size}, hash_block_size {hash_block_size}"
            )
        self.block_size = sizes.pop()
        self.config = CacheConfig(
            block_size=self.block_size,
            num_blocks=int(kv_cache_config.num_blocks),
            groups=tuple(GroupSpec(f"g{i}") for i in range(len(groups))),
            enable_prefix_caching=bool(enable_prefix_caching),
            max_model_len=max_model_len,
            max_rows_per_request=max_rows_per_request,
            free_queue="vllm-omni",
            cache_duplicates=True,  # (vLLM caches every block that fills, a hash twice too)
            block_hash="sha256" if prefix_caching_hash_algo == "sha256" else prefix_caching_hash_algo,
        )
        self._hash_function = self._omni.hash_fn(prefix_caching_hash_algo)
        self.state: KVState = initial_state(self.config)
        self.max_model_len = max_model_len
        self.hash_block_size = hash_block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._requests: dict[str, tuple[Any, ...]] = {}
        self._metadata: dict[str, Any] = {}
        self._internal_request_ids: set[str] = set()

    # -- what vLLM-Omni's scheduler calls ------------------------------------------------------
    def has_request(self, public_request_id: str) -> bool:
        return public_request_id in self._requests

    def get_metadata(self, public_request_id: str) -> Any:
        try:
            return self._metadata[public_request_id]
        except KeyError as exc:
            raise KeyError(f"Diffusion KV request {public_request_id!r} is not allocated") from exc

    def reserve_request(self, public_request_id: str, kv_requests: Sequence[Any]) -> Any:
        """Every CFG row's blocks, or none: the rows' metadata; ``None`` while the pool cannot hold them now;
        ``DiffusionKVAdmissionError`` for a request it never can (longer than ``max_model_len``, more blocks than
        the empty pool, more rows than ``max_rows_per_request``, independent contexts); ``ValueError`` for a
        malformed call. Nothing changes unless it returns metadata."""
        requests = self._checked(public_request_id, kv_requests)
        spec = RequestSpec(public_request_id, tuple(self._row(r) for r in requests))
        admitted = admit(self.state, spec)
        if isinstance(admitted, Failure):
            err = admitted.failure()
            if err.code is ErrorCode.NO_CAPACITY:  # (the pool as vLLM-Omni's leaves it: its rows tried, given back)
                self.state = turn_away(self.state, spec).unwrap().state
                return None
            if err.code is ErrorCode.UNSCHEDULABLE:
                raise self._omni.AdmissionError(f"Diffusion KV request {public_request_id!r}: {err.message}")
            raise ValueError(err.message)
        step = admitted.unwrap()
        effect = step.effect
        cached = min(effect.cached_tokens)
        metadata = self._omni.Metadata(
            request_id=public_request_id,
            allocation_generation=effect.generation,
            sequences=tuple(
                self._omni.Sequence(
                    sequence_id=r.sequence_id,
                    prefix_len=r.prefix_len,
                    target_len=r.target_len,
                    seq_len=r.seq_len,
                    block_ids=tuple(list(g) for g in blocks),
                    cached_prefix_len=cached,
                )
                for r, blocks in zip(requests, effect.blocks)
            ),
        )
        self.state = step.state
        for r in requests:
            r.num_computed_tokens = cached
        self._requests[public_request_id] = requests
        self._metadata[public_request_id] = metadata
        self._internal_request_ids.update(r.request_id for r in requests)
        return metadata

    def publish_request(self, public_request_id: str) -> None:
        """The request's first step materialized its rows: their full prefix blocks enter the prefix cache."""
        if not self.enable_prefix_caching:
            return
        try:
            requests = self._requests[public_request_id]
        except KeyError as exc:
            raise KeyError(f"Diffusion KV request {public_request_id!r} is not allocated") from exc
        committed = commit(self.state, public_request_id, [r.seq_len for r in requests])
        if isinstance(committed, Failure):
            raise ValueError(committed.failure().message)
        self.state = committed.unwrap().state

    def free_request(self, public_request_id: str) -> None:
        requests = self._requests.pop(public_request_id, ())
        self._metadata.pop(public_request_id, None)
        if not requests:
            return
        self.state = release(self.state, public_request_id, "finished").unwrap().state  # (a live request: known)
        for r in requests:
            r.num_computed_tokens = 0
            r.shared_prefix_boundary = 0
            self._internal_request_ids.discard(r.request_id)

    def close(self) -> None:
        for public_request_id in tuple(self._requests):
            self.free_request(public_request_id)

    # -- how a request becomes a RequestSpec -----------------------------------------------------
    def _checked(self, public_request_id: str, kv_requests: Sequence[Any]) -> tuple[Any, ...]:
        """The rows of a well-formed call (``DiffusionKVCacheManager``'s ``ValueError``s, its admission errors
        for independent contexts and rows past ``max_model_len``)."""
        if not public_request_id:
            raise ValueError("public_request_id must be non-empty")
        if public_request_id in self._requests:
            raise ValueError(f"Diffusion KV request {public_request_id!r} is already allocated")
        requests = tuple(kv_requests)
        if not requests:
            raise ValueError("Diffusion KV allocation requires at least one sequence")
        sequence_ids = [r.sequence_id for r in requests]
        internal_ids = [r.request_id for r in requests]
        if sequence_ids != list(range(len(requests))):
            raise ValueError(
                "Diffusion KV requests must be ordered by contiguous sequence_id values: "
                f"expected={list(range(len(requests)))}, got={sequence_ids}"
            )
        if len(internal_ids) != len(set(internal_ids)):
            raise ValueError(f"Diffusion KV internal request IDs must be unique, got {internal_ids}")
        conflicts = self._internal_request_ids.intersection(internal_ids)
        if conflicts:
            raise ValueError(f"Diffusion KV internal request IDs are already allocated: {sorted(conflicts)}")
        for r in requests:
            if r.kv_contexts:
                raise self._omni.AdmissionError("independent DiffusionKVContext allocation is not implemented yet")
            if r.seq_len > self.max_model_len:
                raise self._omni.AdmissionError(
                    f"Diffusion KV sequence {r.request_id!r} exceeds max_model_len: "
                    f"seq_len={r.seq_len}, max_model_len={self.max_model_len}"
                )
        return requests

    def _row(self, r: Any) -> RowSpec:
        """A CFG sequence as a row: its stable prefix (causal) and its target span, rewritten each step. With prefix
        caching on, its prefix is keyed by vLLM-Omni's own chain hashes (its ``build_block_hashes``: the hashes the
        caller gave, else those of the full blocks of known ids: the namespace, the ids, multimodal features at
        their positions), given to the core as the row's: it hits, and is cached, as far as they reach, and no
        further (a row of a count: the ids are in the hashes). A row of neither is never cached nor hit."""
        if self.enable_prefix_caching:
            r.build_block_hashes(self.hash_block_size, self._hash_function)  # (theirs: it checks ids and features)
        given = tuple(bytes(h) for h in r.block_hashes) if self.enable_prefix_caching else ()
        return RowSpec(r.seq_len, prefix_len=r.prefix_len, target_len=r.target_len, block_hashes=given)
