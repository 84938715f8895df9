"""A small DiT-style reference model with a Hunyuan-like layout, its steps dense and paged, and
the dense denoising loop (the paged loop over the shell is ``pagedkv.app.denoise.DiTRunner``).

A row is ``[text (causal)] [reference image (full span, optional)] | [timestep token, image
latents (one full span)]``: everything before ``|`` is the stable prefix, kept across denoising
steps; the target after it is rewritten at every step. Nothing in the prefix can see the target
(causal text sees only earlier tokens; the reference image's span ends at the prefix), so the
prefix K/V are the same at every step: the paged path writes them once (first step) and then
writes only the target's K/V, reading the prefix from the pages. CFG gives two rows
(conditional and unconditional prompts of different lengths), combined as
``uncond + scale * (cond - uncond)``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.core.config import GroupSpec
from pagedkv.core.grouping import LayerSpec
from pagedkv.core.spec import RowSpec
from pagedkv.shell.attention import AttentionBackend, LayerAttention
from pagedkv.shell.pool import PagePool
from pagedkv.shell.rank import Layout, attention_layers
from pagedkv.shell.worker import ForwardBatch


IMAGE_TOKEN, TIME_TOKEN = 1_000_000, 1_000_001  # placeholder ids of image and timestep positions


@dataclass(frozen=True, slots=True)
class DiTConfig:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 3
    latent: int = 8  # channels of an image token
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True, slots=True)
class DiTRow:
    """One CFG branch: its text ids and (optionally) a reference image's latents."""

    text: tuple[int, ...]
    reference: torch.Tensor | None = None  # (ref tokens, latent)

    def spec(self, image_tokens: int) -> RowSpec:
        """The row for admission; image positions carry placeholder ids, and the reference image's
        content goes into the request's extra keys (``content_key``), so equal prefixes hit."""
        ref = 0 if self.reference is None else self.reference.shape[0]
        prefix = len(self.text) + ref
        spans = ((len(self.text), prefix),) if ref else ()
        target = image_tokens + 1  # the timestep token and the image
        tokens = self.text + (IMAGE_TOKEN,) * ref + (TIME_TOKEN,) + (IMAGE_TOKEN,) * image_tokens
        return RowSpec.of_tokens(
            tokens, prefix_len=prefix, target_len=target, spans=spans + ((prefix, prefix + target),)
        )

    def content_key(self) -> tuple[str, ...]:
        if self.reference is None:
            return ()
        return (
            "ref-image:" + hashlib.blake2b(self.reference.contiguous().numpy().tobytes(), digest_size=8).hexdigest(),
        )


class DiT:
    def __init__(self, config: DiTConfig = DiTConfig()) -> None:
        self.config = c = config
        g = torch.Generator().manual_seed(c.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

        self.embed = w(c.vocab, c.hidden)
        self.latent_in, self.latent_out = w(c.hidden, c.latent), w(c.latent, c.hidden)
        self.time = w(c.hidden, 1)
        kv = c.kv_heads * c.head_dim
        self.layers = [
            {
                "q": w(c.hidden, c.hidden),
                "k": w(kv, c.hidden),
                "v": w(kv, c.hidden),
                "o": w(c.hidden, c.hidden),
                "up": w(2 * c.hidden, c.hidden),
                "down": w(c.hidden, 2 * c.hidden),
            }
            for _ in range(c.layers)
        ]

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """Its layers' K/V pages (fp32), for ``plan_rank``."""
        c = self.config
        return attention_layers(c.layers, kv_heads=c.kv_heads, head_dim=c.head_dim, dtype=torch.float32)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"layer{i}" for i in range(self.config.layers))

    def attentions(self, where: GroupSpec | Layout) -> list[LayerAttention]:
        """Each layer's attention: in one group (``GroupSpec``), or as the rank's layout places it (``Layout``: its
        group, and its K and V scales where the pages are fp8)."""
        scale = 1 / math.sqrt(self.config.head_dim)
        if isinstance(where, GroupSpec):
            return [LayerAttention(0, where, scale=scale)] * self.config.layers
        return [LayerAttention(p.group, p.spec, scale=scale, kv_scales=p.kv_scales) for p in where.of(self.layer_names)]

    # -- embeddings --------------------------------------------------------------
    def _prefix(self, row: DiTRow) -> torch.Tensor:
        x = self.embed[torch.tensor(row.text)]
        if row.reference is not None:
            x = torch.cat([x, row.reference @ self.latent_in.T])
        return x

    def _target(self, image: torch.Tensor, t: float) -> torch.Tensor:
        step = (self.time @ torch.tensor([[t]])).T  # (1, hidden): the timestep token
        return torch.cat([step, image @ self.latent_in.T])

    def _block(self, x: torch.Tensor, L: dict[str, torch.Tensor], attend: object) -> torch.Tensor:
        c = self.config
        h = F.layer_norm(x, (c.hidden,))
        q = (h @ L["q"].T).view(-1, c.heads, c.head_dim)
        k = (h @ L["k"].T).view(-1, c.kv_heads, c.head_dim)
        v = (h @ L["v"].T).view(-1, c.kv_heads, c.head_dim)
        x = x + attend(q, k, v).reshape(x.shape) @ L["o"].T  # type: ignore[operator]
        return x + F.gelu(F.layer_norm(x, (c.hidden,)) @ L["up"].T) @ L["down"].T

    # -- dense: contiguous K/V, an explicit mask, the whole sequence every step ----------
    def dense_step(self, rows: list[DiTRow], images: list[torch.Tensor], t: float) -> list[torch.Tensor]:
        c = self.config
        outs = []
        for row, image in zip(rows, images):
            x = torch.cat([self._prefix(row), self._target(image, t)])
            spec = row.spec(image.shape[0])
            n = x.shape[0]
            pos = torch.arange(n)
            end = pos + 1  # causal: position p sees [0, p]
            for a, b in spec.spans:
                end[a:b] = b  # a full span [a, b) sees [0, b)
            mask = torch.arange(n)[None, :] < end[:, None]

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor = mask) -> torch.Tensor:
                k = k.repeat_interleave(c.heads // c.kv_heads, 1)
                v = v.repeat_interleave(c.heads // c.kv_heads, 1)
                s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
                return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~mask, float("-inf")), -1), v)

            for L in self.layers:
                x = self._block(x, L, attend)
            outs.append(x[-image.shape[0] :] @ self.latent_out.T)  # the image tokens' prediction
        return outs

    # -- paged: K/V through the pool; the first step writes everything, later ones the target ---
    def paged_step(
        self,
        rows: list[DiTRow],
        images: list[torch.Tensor],
        t: float,
        batch: ForwardBatch,
        pool: PagePool,
        backend: AttentionBackend,
        group: GroupSpec | Layout,
    ) -> list[torch.Tensor]:
        return self.paged_rows([(row, image, t) for row, image in zip(rows, images)], batch, pool, backend, group)

    def paged_rows(
        self,
        entries: list[tuple[DiTRow, torch.Tensor, float]],
        batch: ForwardBatch,
        pool: PagePool,
        backend: AttentionBackend,
        group: GroupSpec | Layout,
    ) -> list[torch.Tensor]:
        """``paged_step`` over the forward's rows in order, each with its own image and timestep (rows of
        several requests at different denoising steps in one forward: step batching). ``group``: the one group,
        or the rank's layout (fp8 pages: each layer's scales)."""
        x = self.query_inputs(entries, batch)
        attns = self.attentions(group)
        for i, L in enumerate(self.layers):

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int = i) -> torch.Tensor:
                pool.write(i, k, v, batch.slot_mapping, attns[i].kv_scales)  # this forward's K/V, once, then attention
                return backend.forward(q, pool.k[i], pool.v[i], batch, attns[i])

            x = self._block(x, L, attend)
        return self.predictions(x, entries, batch)

    def query_inputs(self, entries: list[tuple[DiTRow, torch.Tensor, float]], batch: ForwardBatch) -> torch.Tensor:
        """The embeddings of the forward's query positions, rows in order (only the query positions run)."""
        xs = []
        for r, (row, image, t) in zip(batch.metadata.rows, entries):
            full = torch.cat([self._prefix(row), self._target(image, t)])
            xs.append(full[r.kv_start_pos : r.seq_len])
        return torch.cat(xs)

    def predictions(
        self, x: torch.Tensor, entries: list[tuple[DiTRow, torch.Tensor, float]], batch: ForwardBatch
    ) -> list[torch.Tensor]:
        """Each row's image-token prediction from the last layer's ``x`` (rows in order)."""
        qsl = batch.query_start_loc.tolist()
        return [x[qsl[r + 1] - entries[r][1].shape[0] : qsl[r + 1]] @ self.latent_out.T for r in range(len(entries))]


def euler(images: list[torch.Tensor], preds: list[torch.Tensor], steps: int, cfg_scale: float) -> list[torch.Tensor]:
    """One Euler step; with two rows (CFG), both move along uncond + scale * (cond - uncond)."""
    if len(preds) == 2:
        guided = preds[1] + cfg_scale * (preds[0] - preds[1])
        preds = [guided, guided]
    return [img - pred / steps for img, pred in zip(images, preds)]


def dense_denoise(
    model: DiT, rows: list[DiTRow], images: list[torch.Tensor], steps: int, cfg_scale: float = 4.0
) -> list[torch.Tensor]:
    history = []
    for s in range(steps):
        preds = model.dense_step(rows, images, 1.0 - s / steps)
        images = euler(images, preds, steps, cfg_scale)
        history.append(images[0])
    return history
