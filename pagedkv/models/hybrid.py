"""Mamba2 + attention hybrids over the shell (Bamba, granite-4.0-h): attention layers write K/V to their group's
pages and read them through the attention backend; Mamba2 layers keep each row's conv and SSM state in their state
group's block (``shell.mamba``), the same pages (vLLM's hybrid layout: ``PagePool(state=...)``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.core.errors import InvariantError
from pagedkv.core.config import GroupSpec, InvalidConfig
from pagedkv.core.grouping import LayerKind, LayerSpec
from pagedkv.models.hybrid_config import HybridConfig
from pagedkv.shell.attention import AttentionBackend, LayerAttention
from pagedkv.shell.mamba import Mamba2Weights, MixerBackend, state_blocks
from pagedkv.shell.mixers import get_mixer
from pagedkv.shell.pool import PagePool, StateShape
from pagedkv.shell.rank import Layout
from pagedkv.shell.worker import ForwardBatch


class HybridModel:
    """Weights as plain tensors; ``forward`` runs one installed batch (the same call as ``Llama.forward``)."""

    def __init__(
        self,
        config: HybridConfig,
        weights: Any,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        mixer: str = "auto",
    ) -> None:
        self.config = c = config
        self.dtype, self.device = dtype, torch.device(device)
        self.mixer: MixerBackend = get_mixer(mixer, self.device)  # auto: mamba_ssm's kernels on CUDA where they import

        def w(name: str, dt: torch.dtype | None = None) -> torch.Tensor:
            t: torch.Tensor = weights[name].to(device=self.device, dtype=dt or dtype)
            return t

        granite = c.arch == "granitemoehybrid"
        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if c.tie_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight" if granite else "model.final_layernorm.weight")
        self.layers: list[dict[str, torch.Tensor]] = []
        self.scans: list[Mamba2Weights | None] = []  # each Mamba2 layer's scan parameters (None: attention)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            L: dict[str, torch.Tensor] = {
                "ln1": w(p + "input_layernorm.weight"),
                "ln2": w(p + ("post_attention_layernorm" if granite else "pre_ff_layernorm") + ".weight"),
            }
            if granite:
                L["gate_up"], L["down"] = (
                    w(p + "shared_mlp.input_linear.weight"),
                    w(p + "shared_mlp.output_linear.weight"),
                )
                if c.experts:
                    L["router"] = w(p + "block_sparse_moe.router.layer.weight")
                    L["experts_gate_up"] = w(p + "block_sparse_moe.input_linear.weight")  # (E, 2 x size, hidden)
                    L["experts_down"] = w(p + "block_sparse_moe.output_linear.weight")  # (E, hidden, size)
            else:
                L["gate_up"] = torch.cat((w(p + "feed_forward.gate_proj.weight"), w(p + "feed_forward.up_proj.weight")))
                L["down"] = w(p + "feed_forward.down_proj.weight")
            if c.is_attention(i):
                L["qkv"] = torch.cat([w(p + f"self_attn.{k}_proj.weight") for k in "qkv"])
                L["o"] = w(p + "self_attn.o_proj.weight")
                self.scans.append(None)
            else:
                m = p + "mamba."
                L["in_proj"], L["out_proj"], L["gated_norm"] = (
                    w(m + "in_proj.weight"),
                    w(m + "out_proj.weight"),
                    w(m + "norm.weight"),
                )
                self.scans.append(
                    Mamba2Weights(
                        conv_w=w(m + "conv1d.weight")[:, 0],
                        conv_b=w(m + "conv1d.bias") if c.conv_bias else None,
                        dt_bias=w(m + "dt_bias", torch.float32),
                        A=-torch.exp(w(m + "A_log", torch.float32)),
                        D=w(m + "D", torch.float32),
                        heads=c.mamba_heads,
                        head_dim=c.mamba_head_dim,
                        groups=c.mamba_groups,
                        d_state=c.d_state,
                        chunk=c.chunk_size,
                        dt_limit=c.dt_limit,
                    )
                )
            self.layers.append(L)
        self.layer_names = tuple(f"layer{i}" for i in range(c.num_layers))
        self.inv_freq = (
            None
            if c.rope_theta is None
            else (1.0 / c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float32) / c.rotary_dim)).to(
                self.device
            )
        )
        self._places: tuple[Layout, tuple[Any, ...]] | None = None

    @property
    def state_shape(self) -> StateShape:
        """What a Mamba2 layer keeps in a state page (``rank_for`` plans the pool with it)."""
        return self.config.state

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """The attention layers' K/V and the Mamba2 layers' states, for ``plan_rank``."""
        c, size = self.config, self.dtype.itemsize
        return tuple(
            LayerSpec(name, kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype_bytes=size)
            if c.is_attention(i)
            else LayerSpec(name, LayerKind.MAMBA, state_bytes=c.state.elements * size)
            for i, name in enumerate(self.layer_names)
        )

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)).to(x.dtype) * w

    def _place(self, layout: Layout | GroupSpec) -> tuple[Any, ...]:
        """Each layer's (page slot, group, its attention or None): from the rank's layout, once."""
        if isinstance(layout, GroupSpec):
            raise InvalidConfig("a hybrid model has state groups: run it with its rank's layout, not one group")
        made = self._places
        if made is not None and made[0] is layout:
            return made[1]
        places = layout.of(self.layer_names)
        out = tuple(
            (
                p.slot,
                p.group,
                LayerAttention(group=p.group, spec=p.spec, scale=self.config.attention_scale)
                if self.config.is_attention(i)
                else None,
            )
            for i, p in enumerate(places)
        )
        self._places = (layout, out)
        return out

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        pool: PagePool,
        backend: AttentionBackend,
        layout: Layout | GroupSpec,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens`` (query tokens,) in the batch's order -> logits of each row's last token (rows, vocab), or of
        the tokens ``logits_at`` names."""
        c = self.config
        x = self.embed[tokens.to(self.device)]
        if c.embedding_multiplier != 1.0:
            x = x * c.embedding_multiplier
        places = self._place(layout)
        rope = None if self.inv_freq is None else self._rope_tables(batch.positions.to(self.device))
        blocks: dict[int, torch.Tensor] = {}  # state group -> each row's state block, once a forward
        for L, scan, (slot, group, attn) in zip(self.layers, self.scans, places):
            h = self._rms(x, L["ln1"])
            if scan is None:
                a = self._attention(h, L, slot, group, attn, rope, batch, pool, backend)
            else:
                if group not in blocks:
                    blocks[group] = state_blocks(batch, group)
                a = self._mamba(h, L, scan, pool.conv[slot], pool.ssm[slot], blocks[group], batch)
            x = x + a * c.residual_multiplier if c.residual_multiplier != 1.0 else x + a
            h = self._rms(x, L["ln2"])
            m = self._mlp(h, L)
            x = x + m * c.residual_multiplier if c.residual_multiplier != 1.0 else x + m
        last = (batch.query_start_loc[1:] - 1).long().to(self.device) if logits_at is None else logits_at
        logits = (self._rms(x[last], self.norm) @ self.lm_head.T).float()
        return logits / c.logits_scaling if c.logits_scaling != 1.0 else logits

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq is None:
            raise InvariantError("a model with attention layers has its rotary table")
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (tokens, 1, rotary_dim)
        return emb.cos(), emb.sin()

    def _turn(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on each head's leading ``rotary_dim`` dimensions (its two halves rotated), the rest as it is."""
        cos, sin = rope
        rd = self.config.rotary_dim
        part, rest = x[..., :rd].float(), x[..., rd:]
        turned = torch.cat((-part[..., rd // 2 :], part[..., : rd // 2]), dim=-1)
        return torch.cat(((part * cos + turned * sin).to(x.dtype), rest), dim=-1)

    def _attention(
        self,
        h: torch.Tensor,
        L: dict[str, torch.Tensor],
        slot: int,
        group: int,
        attn: LayerAttention,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        batch: ForwardBatch,
        pool: PagePool,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        c = self.config
        hd = c.head_dim
        q, k, v = torch.split(h @ L["qkv"].T, [c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd], dim=-1)
        q, k, v = q.reshape(-1, c.num_heads, hd), k.reshape(-1, c.num_kv_heads, hd), v.reshape(-1, c.num_kv_heads, hd)
        if rope is not None:
            q, k = self._turn(q, rope), self._turn(k, rope)
        pool.write(slot, k, v, batch.slot_mappings[group])
        return backend.forward(q, pool.k[slot], pool.v[slot], batch, attn).reshape(h.shape[0], -1) @ L["o"].T

    def _mamba(
        self,
        h: torch.Tensor,
        L: dict[str, torch.Tensor],
        scan: Mamba2Weights,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        blocks: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        c = self.config
        gate, xbc, dt = torch.split(h @ L["in_proj"].T, [c.inner, c.conv_dim, c.mamba_heads], dim=-1)
        y = self.mixer.forward(xbc, dt, scan, conv, ssm, blocks, batch).float()
        y = y * F.silu(gate.float())  # the gated norm: gate, then RMS over each group's part
        g = y.view(y.shape[0], c.mamba_groups, -1)
        y = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).view_as(y)
        return (L["gated_norm"] * y.to(h.dtype)) @ L["out_proj"].T

    def _mlp(self, h: torch.Tensor, L: dict[str, torch.Tensor]) -> torch.Tensor:
        gate, up = (h @ L["gate_up"].T).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ L["down"].T
        if "router" not in L:
            return out
        # granite's experts: each token's top k by the router, weighted by the softmax over those k. Every expert
        # runs over every token, weighted by a routing matrix that is zero where it was not chosen: no host sync,
        # so a CUDA graph captures it (E / k times the chosen experts' work: a reference, not a grouped kernel)
        top, chosen = (h @ L["router"].T).float().topk(self.config.experts_per_token, dim=-1)
        route = torch.zeros(h.shape[0], L["router"].shape[0], device=h.device).scatter_(
            1, chosen, torch.softmax(top, -1)
        )
        g, u = torch.einsum("th,eih->tei", h, L["experts_gate_up"]).chunk(2, dim=-1)  # (tokens, E, size) each
        moe = torch.einsum("tei,ehi,te->th", F.silu(g) * u, L["experts_down"], route.to(h.dtype))
        return moe + out
