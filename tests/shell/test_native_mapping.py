"""The torch-npu backend's argument mapping, checked without an Ascend device: NpuBackend runs over a
stand-in ``torch_npu`` whose ``npu_fused_infer_attention_score`` computes what Ascend documents for
the arguments it is given (TND queries, paged key/value ``(blocks, block_size, kv_heads * dim)``,
cumulative ``actual_seq_lengths``, per-row ``actual_seq_lengths_kv``, ``sparse_mode`` 0 = no mask,
3 = bottom-right causal, 4 = a causal band of ``pre_tokens``). A wrong layout, length, mode or
window in the mapping gives other numbers than the torch reference."""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given

from pagedkv.core import GroupKind, GroupSpec
from pagedkv.shell.attention import get_backend
from pagedkv.shell.errors import BackendUnavailable, ShellError
from tests.shell.test_shell_attention import build, scenario


def fused_infer_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    num_heads: int,
    num_key_value_heads: int,
    input_layout: str,
    block_table: torch.Tensor,
    block_size: int,
    actual_seq_lengths: list[int],
    actual_seq_lengths_kv: list[int],
    sparse_mode: int,
    atten_mask: torch.Tensor | None = None,
    pre_tokens: int = 2**31 - 1,
    next_tokens: int = 2**31 - 1,
) -> tuple[torch.Tensor, None]:
    """What the documented operator computes, written from its documentation, one query at a time."""
    assert input_layout == "TND" and query.shape[1] == num_heads
    assert sparse_mode in (0, 3, 4) and (sparse_mode == 0) == (atten_mask is None)
    d = query.shape[2]
    out = torch.empty_like(query)
    starts = [0, *actual_seq_lengths]  # TND: cumulative query lengths
    for b, kv_len in enumerate(actual_seq_lengths_kv):
        nb = -(-kv_len // block_size)
        pages = block_table[b, :nb].long()
        k = key[pages].reshape(-1, num_key_value_heads, d)[:kv_len].nan_to_num()
        v = value[pages].reshape(-1, num_key_value_heads, d)[:kv_len].nan_to_num()
        n = starts[b + 1] - starts[b]
        for i in range(n):
            pos = kv_len - n + i  # bottom-right alignment
            lo, hi = 0, kv_len
            if sparse_mode in (3, 4):
                hi = pos + 1
            if sparse_mode == 4:
                lo = max(0, pos - pre_tokens)
            for h in range(num_heads):
                kv = h // (num_heads // num_key_value_heads)
                w = torch.softmax(k[lo:hi, kv] @ query[starts[b] + i, h] * scale, 0)
                out[starts[b] + i, h] = w @ v[lo:hi, kv]
    return out, None


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = fused_infer_attention  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return get_backend("npu")


@given(sc=scenario())
def test_npu_mapping_reproduces_the_reference(sc: dict[str, object]) -> None:
    sc = {**sc, "bs": 16}  # the operator's paged form takes block sizes in multiples of 16
    q, _, pool, worker, meta, layer, _ = build(sc)
    if len({tuple(s.causal for s in r.segments) for r in meta.rows}) > 1:
        return  # the core refuses such a forward
    batch = worker.install(meta)
    spec = layer.spec
    with pytest.MonkeyPatch.context() as mp:
        fake = types.ModuleType("torch_npu")
        fake.npu_fused_infer_attention_score = fused_infer_attention  # type: ignore[attr-defined]
        mp.setitem(sys.modules, "torch_npu", fake)
        backend = get_backend("npu")
        full_span = any(not s.causal for s in meta.rows[0].segments)
        if spec.kind is GroupKind.CHUNKED_LOCAL or (spec.kind is GroupKind.SLIDING_WINDOW and full_span):
            with pytest.raises(ShellError, match="torch backend"):
                backend.forward(q, pool.k[0], pool.v[0], batch, layer)
            return
        got = backend.forward(q, pool.k[0], pool.v[0], batch, layer)
    ref = get_backend("torch").forward(q, pool.k[0], pool.v[0], batch, layer)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max().clamp_min(1e-6)


def test_the_stand_in_can_tell_a_wrong_mapping(npu: Any) -> None:
    """The same forward with the window's band one token too wide must differ: the check can fail."""
    sc = {
        "bs": 16,
        "kv_heads": 1,
        "heads": 2,
        "spec": GroupSpec("g", GroupKind.SLIDING_WINDOW, window=3),
        "rows": [(20, (), 0, 20)],
        "seed": 1,
        "d": 4,
    }
    q, _, pool, worker, meta, layer, _ = build(sc)
    batch = worker.install(meta)
    ref = get_backend("torch").forward(q, pool.k[0], pool.v[0], batch, layer)
    assert (npu.forward(q, pool.k[0], pool.v[0], batch, layer) - ref).abs().max() <= 1e-5 * ref.abs().max()
    wide = GroupSpec("g", GroupKind.SLIDING_WINDOW, window=4)
    got = npu.forward(q, pool.k[0], pool.v[0], batch, replace(layer, spec=wide))
    assert (got - ref).abs().max() > 1e-3


def test_block_sizes_the_operator_cannot_page_are_refused(npu: Any) -> None:
    sc = {"bs": 8, "kv_heads": 1, "heads": 1, "spec": GroupSpec("g"), "rows": [(9, (), 0, 9)], "seed": 0, "d": 4}
    q, _, pool, worker, meta, layer, _ = build(sc)
    with pytest.raises(ShellError, match="multiple of 16"):
        npu.forward(q, pool.k[0], pool.v[0], worker.install(meta), layer)


def test_torch_npu_is_named_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    with pytest.raises(BackendUnavailable, match="torch-npu"):
        get_backend("npu")
