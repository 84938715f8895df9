"""fp8 KV pages' scales: each layer's K scale and V scale (a page holds ``value / scale`` in fp8), from the
checkpoint where it carries them (``model.kv_scales``: vLLM's ``self_attn.k_scale`` / ``v_scale`` tensors) or
computed at start-up from one calibration forward, as vLLM's ``calculate_kv_scales`` does: the largest magnitude
each layer writes, over a constant that leaves headroom for later tokens (vLLM's ``K_SCALE_CONSTANT`` 200 and
``V_SCALE_CONSTANT`` 100)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pagedkv.core import RequestSpec, RowSpec, admit, initial_state, publish
from pagedkv.shell.attention.base import AttentionBackend
from pagedkv.shell.rank import rank_for

KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0
TINY = 1e-6  # a layer that writes zeros still gets a usable scale

# a calibration prompt: ordinary text (the model's first forward in vLLM is whatever batch comes first)
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache keeps each request's keys and values "
    "in fixed-size blocks, so many requests share one pool of device memory without fragmentation. "
    "1, 2, 3, 4, 5: numbers, names like Paris and Tokyo, and code such as def f(x): return x * 2."
)


def kv_dtype_of(name: str) -> torch.dtype | None:
    """The page dtype of a ``kv_cache_dtype`` name (vLLM's names; ``auto``: the model's own, None)."""
    return KV_CACHE_DTYPES[name]


def calibrate(model: Any, tokens: Sequence[int], backend: AttentionBackend) -> dict[str, tuple[float, float]]:
    """Each layer's (K scale, V scale) from one prefill forward of ``tokens`` in the model's own dtype."""
    n = len(tokens)
    rank = rank_for(
        model,
        max_model_len=n,
        block_size=16,
        kv_cache_memory_bytes=_budget(model, n),
        enable_prefix_caching=False,
        max_rows=1,
        max_tokens=n,
        backend=backend,
    )
    kv = admit(initial_state(rank.cache), RequestSpec("calibration", (RowSpec.of_tokens(list(tokens)),))).unwrap().state
    batch = rank.worker.install(publish(kv, ["calibration"], "prefill").unwrap().effect)
    return record_scales(
        model.layer_names,
        lambda wrap: model.forward(torch.tensor(list(tokens)), batch, wrap(rank.pool), backend, rank.layout),
    )


def record_scales(
    names: Sequence[str], run: Callable[[Callable[[Any], Any]], object]
) -> dict[str, tuple[float, float]]:
    """Each layer's (K scale, V scale) from one forward: ``run(wrap)`` runs it with its pool wrapped by ``wrap`` (which
    records the largest |K| and |V| of each write: one a layer, in ``names``' order)."""
    seen: list[tuple[float, float]] = []
    run(lambda pool: _Recording(pool, seen))
    if len(seen) != len(names):
        raise RuntimeError(f"calibration saw {len(seen)} K/V writes for {len(names)} layers")
    return {
        name: (max(k / K_SCALE_CONSTANT, TINY), max(v / V_SCALE_CONSTANT, TINY)) for name, (k, v) in zip(names, seen)
    }


def scales_for(
    model: Any, kv_dtype: torch.dtype | None, tokens: Sequence[int] | None, backend: AttentionBackend
) -> Mapping[str, tuple[float, float]] | None:
    """The scales fp8 pages use: the checkpoint's, else calibrated over ``tokens`` (None: 256 ids spread over the
    model's vocabulary, for an engine without a tokenizer); None for pages of the model's dtype."""
    if kv_dtype is None:
        return None
    if tokens is None:
        vocab = model.config.vocab_size
        tokens = [(7 * i + 3) % vocab for i in range(256)]
    return getattr(model, "kv_scales", None) or calibrate(model, tokens, backend)


def _budget(model: Any, n: int) -> int:
    """Bytes for a pool of one row of ``n`` tokens (and the null block), at the model's page size."""
    per_token: int = sum(x.bytes_per_token for x in model.kv_layers())
    return (n + 64) * per_token * 2


class _Recording:
    """A pool that records the largest |K| and |V| of each write (one a layer, in order) and writes through."""

    def __init__(self, pool: Any, seen: list[tuple[float, float]]) -> None:
        self.pool, self.seen = pool, seen

    def __getattr__(self, name: str) -> Any:  # the pages and everything else: the pool's own
        return getattr(self.pool, name)

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        self.seen.append((float(k.abs().max()), float(v.abs().max())))
        self.pool.write(layer, k, v, slot_mapping, scales)


def calibration_ids(tokenizer: Any) -> list[int] | None:
    """The calibration text's ids through the engine's tokenizer, as a chat turn where it has a template (a
    request's first positions, its special tokens, carry the largest K and V of many models: a scale that has not
    seen them clips them), else as it is; None: it has no ``encode``."""
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        return None
    template = getattr(tokenizer, "apply_chat_template", None)
    text = CALIBRATION_TEXT
    if callable(template):
        try:
            text = template([{"role": "user", "content": CALIBRATION_TEXT}])
        except Exception:  # noqa: BLE001 - a tokenizer without a usable template: the plain text
            text = CALIBRATION_TEXT
    return list(encode(text))
