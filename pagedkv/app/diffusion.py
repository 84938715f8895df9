"""The paged denoising loop of a diffusion request over the shell: the DiT reference model's steps
with the core's prepared metadata (``pagedkv denoise`` runs it)."""

from __future__ import annotations

import time
from typing import Any

import torch

from pagedkv.core.errors import ErrorCode
from pagedkv.core.outputs.metadata import KVMetadata
from pagedkv.models.dit import DiT, DiTRow, euler
from pagedkv.models.ulysses import UlyssesDiT
from pagedkv.shell.attention import AttentionBackend
from pagedkv.shell.errors import refuse
from pagedkv.shell.kv_scales import record_scales
from pagedkv.shell.rank import Rank


def dit_kv_scales(
    model: DiT, rank: Rank, backend: AttentionBackend, rows: list[DiTRow], images: list[torch.Tensor], first: KVMetadata
) -> dict[str, tuple[float, float]]:
    """fp8 pages' scales for ``model`` from one first step of ``rows`` (``first``: its prefill snapshot) on ``rank``, a
    rank of pages in the model's own dtype (``shell.kv_scales.record_scales``)."""
    batch = rank.worker.install(first)
    return record_scales(
        model.layer_names,
        lambda wrap: model.paged_step(rows, images, 1.0, batch, wrap(rank.pool), backend, rank.layout),
    )


class DiTRunner:
    """Request-level execution of a paged diffusion request: every denoising step in one call, the
    prepared metadata of each phase installed once and reused by every layer and later step."""

    def __init__(self, model: DiT, rank: Rank, backend: AttentionBackend) -> None:
        self.model, self.rank, self.backend = model, rank, backend
        self.step_seconds: list[float] = []  # wall time of each denoising step of the last run

    def run(
        self,
        rows: list[DiTRow],
        images: list[torch.Tensor],
        steps: int,
        first: KVMetadata,
        later: KVMetadata | None,
        cfg_scale: float = 4.0,
    ) -> list[torch.Tensor]:
        """Euler denoising over ``steps``; returns the image after every step (CFG-combined when 2 rows)."""
        if steps > 1 and later is None:
            raise refuse(ErrorCode.INVALID, "later denoising steps need the denoise metadata")
        rank = self.rank
        history = []
        self.step_seconds = []
        for s in range(steps):
            t0 = time.perf_counter()
            batch = rank.worker.install(first if s == 0 or later is None else later)
            preds = self.model.paged_step(rows, images, 1.0 - s / steps, batch, rank.pool, self.backend, rank.layout)
            images = euler(images, preds, steps, cfg_scale)
            history.append(images[0])
            self.step_seconds.append(time.perf_counter() - t0)
        return history


class DiTStepRunner:
    """Step-level execution (``core.scheduler.steps``): each tick's forwards, rows of requests at different
    denoising steps together (``model``: the DiT, or its Ulysses shard on one rank of several). ``add`` a request's rows, images and steps when it is submitted; ``history[rid]``
    gets its image after each of its steps (CFG-combined when it has 2 rows); ``take`` it when the request ends
    (finished, failed, cancelled), which forgets it. A forward that raises leaves its requests' images as they
    were (the planner's ``fail`` ends them or runs their step again)."""

    def __init__(self, model: DiT | UlyssesDiT, rank: Rank, backend: AttentionBackend, cfg_scale: float = 4.0) -> None:
        self.model, self.rank, self.backend, self.cfg_scale = model, rank, backend, cfg_scale
        self.work: dict[object, tuple[list[DiTRow], list[torch.Tensor], int]] = {}
        self.history: dict[object, list[torch.Tensor]] = {}
        self.forwards = 0  # forwards run (each holds every request that could batch in its tick)
        self.failed_forward: Any = None  # the forward ``run`` raised at

    def add(self, rid: object, rows: list[DiTRow], images: list[torch.Tensor], steps: int) -> None:
        """A submitted request's work; a reused id starts a new history."""
        self.work[rid] = (rows, images, steps)
        self.history[rid] = []

    def take(self, rid: object) -> list[torch.Tensor]:
        """An ended request's images, one a step it completed; the runner forgets it."""
        self.work.pop(rid, None)
        return self.history.pop(rid, [])

    def run(self, plan: Any) -> None:
        """Every forward of ``plan``; raises at the first that fails (``failed_forward`` says which), after the
        forwards before it updated their requests."""
        self.failed_forward = None
        for fwd in plan.forwards:
            self.failed_forward = fwd
            self.run_forward(fwd)
        self.failed_forward = None

    def run_forward(self, fwd: Any) -> None:
        batch = self.rank.worker.install(fwd.metadata)
        entries, owners = [], []
        for rid, s in zip(fwd.request_ids, fwd.step_index):
            rows, images, steps = self.work[rid]
            entries += [(row, img, 1.0 - s / steps) for row, img in zip(rows, images)]
            owners.append((rid, len(rows), steps))
        preds = self.model.paged_rows(entries, batch, self.rank.pool, self.backend, self.rank.layout)
        self.forwards += 1
        k = 0
        for rid, n, steps in owners:
            rows, images, _ = self.work[rid]
            images = euler(images, preds[k : k + n], steps, self.cfg_scale)
            k += n
            self.work[rid] = (rows, images, steps)
            self.history.setdefault(rid, []).append(images[0])
