"""The manager's part of vLLM's ``mamba_cache_mode="align"`` that is a step's, not the core's: the Mamba states
cached in the current scheduler step (vLLM's ``MambaManager.cached_blocks_this_step``). A new request whose hit
ends on one of them waits a step: its state is written by this step's forward, which has not run."""

from __future__ import annotations

from typing import Any

from pagedkv.core import Step, cache_ahead_many
from pagedkv.core.prefix import find_hit
from pagedkv.core.spec import RequestSpec
from pagedkv.core.state import KVState
from pagedkv.integrations.vllm.stream import Transaction


class StepStates:
    """What a manager mixes in; ``_aligned`` (the align-mode Mamba groups) and ``_cached_now`` are set by it."""

    _aligned: list[int]
    _cached_now: set[tuple[int, bytes]]  # (group, hash) of the Mamba states cached this step
    use_eagle: bool

    def new_step_starts(self) -> None:
        self._cached_now.clear()

    def _cache_ahead(self, txn: Transaction, request: Any, slot: int, through: int) -> None:
        """``cache_ahead`` through ``through`` tokens (vLLM's block hashes taken); the Mamba states it caches noted
        as cached this step."""
        hashed = txn.state.rows[slot].num_hashed
        rid = request.request_id
        cached = cache_ahead_many(txn.state, [(rid, [through])], hashes={rid: request.block_hashes})
        txn.apply(cached.map(lambda step: Step(step.state, step.effect[0])), "cache_ahead")
        if self._aligned:
            record = txn.state.rows[slot]
            self._cached_now.update(
                (g, record.hash_at(j))
                for j in range(hashed, record.num_hashed)
                for g in self._aligned
                if record.blocks[g][j]
            )

    def _state_cached_now(self, state: KVState, spec: RequestSpec) -> bool:
        """Does the hit of ``spec`` end on a Mamba state cached this step? (A lookup of its own: the admission that
        follows finds the same hit, but the wait must come before anything is taken.)"""
        hit = find_hit(state, spec, drop_last_block=self.use_eagle)
        return bool(hit.num_blocks) and any((g, hit.hashes[0][-1]) in self._cached_now for g in self._aligned)
