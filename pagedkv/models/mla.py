"""A small MLA reference model (DeepSeek-V2 shapes, scaled down, seeded weights): paged over latent
pages, and a dense implementation to check it against."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.shell.latent import LatentPagePool, mla_attention
from pagedkv.shell.worker import ForwardBatch


@dataclass(frozen=True, slots=True)
class MLAConfig:
    vocab: int = 64
    hidden: int = 64
    heads: int = 4
    kv_lora_rank: int = 16  # DeepSeek-V2: 512
    qk_nope_dim: int = 8  # 128
    qk_rope_dim: int = 4  # 64
    v_dim: int = 8  # 128
    layers: int = 2
    rope_theta: float = 10000.0
    seed: int = 0

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim


class MLAModel:
    def __init__(self, config: MLAConfig = MLAConfig()) -> None:
        self.config = c = config
        g = torch.Generator().manual_seed(c.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

        self.embed = w(c.vocab, c.hidden)
        self.layers = [
            {
                "q": w(c.heads * (c.qk_nope_dim + c.qk_rope_dim), c.hidden),
                "dkv": w(c.kv_lora_rank + c.qk_rope_dim, c.hidden),  # down-projection: [c_kv, k_pe]
                "uk": w(c.heads, c.qk_nope_dim, c.kv_lora_rank),
                "uv": w(c.heads, c.v_dim, c.kv_lora_rank),
                "o": w(c.hidden, c.heads * c.v_dim),
                "up": w(2 * c.hidden, c.hidden),
                "down": w(c.hidden, 2 * c.hidden),
            }
            for _ in range(c.layers)
        ]
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.qk_rope_dim, 2).float() / c.qk_rope_dim))
        self.scale = 1 / math.sqrt(c.qk_nope_dim + c.qk_rope_dim)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        f = pos[:, None].float() * self.inv_freq[None]
        emb = torch.cat([f, f], -1)
        while emb.dim() < x.dim():
            emb = emb.unsqueeze(-2)
        half = x.shape[-1] // 2
        return x * emb.cos() + torch.cat([-x[..., half:], x[..., :half]], -1) * emb.sin()

    def _project(
        self, x: torch.Tensor, L: dict[str, torch.Tensor], pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q_nope (T, H, dn), q_pe (T, H, dr), latent (T, rank + dr): what the cache holds."""
        c = self.config
        h = F.layer_norm(x, (c.hidden,))
        q = (h @ L["q"].T).view(-1, c.heads, c.qk_nope_dim + c.qk_rope_dim)
        q_nope, q_pe = q[..., : c.qk_nope_dim], self._rope(q[..., c.qk_nope_dim :], pos)
        kv = h @ L["dkv"].T
        c_kv = F.layer_norm(kv[:, : c.kv_lora_rank], (c.kv_lora_rank,))
        k_pe = self._rope(kv[:, c.kv_lora_rank :], pos)
        return q_nope, q_pe, torch.cat([c_kv, k_pe], -1)

    def _mlp(self, x: torch.Tensor, L: dict[str, torch.Tensor]) -> torch.Tensor:
        return x + F.gelu(F.layer_norm(x, (self.config.hidden,)) @ L["up"].T) @ L["down"].T

    def dense(self, tokens: list[int]) -> torch.Tensor:
        """The whole sequence on contiguous tensors, per-head keys built explicitly: logits (T, vocab)."""
        c = self.config
        x = self.embed[torch.tensor(tokens)]
        pos = torch.arange(len(tokens))
        mask = pos[None, :] <= pos[:, None]
        for L in self.layers:
            q_nope, q_pe, lat = self._project(x, L, pos)
            c_kv, k_pe = lat[:, : c.kv_lora_rank], lat[:, c.kv_lora_rank :]
            k = torch.cat([torch.einsum("kr,hdr->khd", c_kv, L["uk"]), k_pe[:, None, :].expand(-1, c.heads, -1)], -1)
            v = torch.einsum("kr,hvr->khv", c_kv, L["uv"])
            s = torch.einsum("qhd,khd->hqk", torch.cat([q_nope, q_pe], -1), k) * self.scale
            o = torch.einsum("hqk,khv->qhv", torch.softmax(s.masked_fill(~mask[None], float("-inf")), -1), v)
            x = self._mlp(x + o.reshape(len(tokens), -1) @ L["o"].T, L)
        return x @ self.embed.T

    def paged(self, tokens: torch.Tensor, batch: ForwardBatch, pool: LatentPagePool, *, absorbed: bool) -> torch.Tensor:
        """This forward's query tokens over latent pages: logits (query tokens, vocab)."""
        x = self.embed[tokens]
        pos = batch.positions
        for i, L in enumerate(self.layers):
            q_nope, q_pe, lat = self._project(x, L, pos)
            pool.write(i, lat, batch.slot_mapping)  # one latent per token, once per layer
            o = mla_attention(q_nope, q_pe, pool, i, batch, L["uk"], L["uv"], self.scale, absorbed=absorbed)
            x = self._mlp(x + o.reshape(x.shape[0], -1) @ L["o"].T, L)
        return x @ self.embed.T
