"""The torch backend over pages equals dense attention computed independently."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.core import CacheConfig, GroupKind, GroupSpec, KVMetadata, Phase, RowMetadata
from pagedkv.core.outputs.metadata import segments_of, slots_of
from pagedkv.shell.attention import LayerAttention, get_backend, run_segments, segment_calls
from pagedkv.shell.errors import BackendUnavailable
from pagedkv.shell.pool import PagePool
from pagedkv.shell.worker import Worker


def dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    seq_len: int,
    spans: tuple[tuple[int, int], ...],
    spec: GroupSpec,
    scale: float,
) -> torch.Tensor:
    """Contiguous K/V (seq, kv_heads, d), the visibility rules written from the spans, one query at a time."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for i, pos in enumerate(range(start, seq_len)):
        end = pos + 1
        for a, b in spans:
            if a <= pos < b:
                end = min(b, seq_len)
        lo = 0
        if spec.kind is GroupKind.SLIDING_WINDOW:
            lo = max(0, pos - spec.window + 1)  # type: ignore[operator]
        elif spec.kind is GroupKind.CHUNKED_LOCAL:
            lo = pos // spec.chunk * spec.chunk  # type: ignore[operator]
        for h in range(heads):
            kh = k[lo:end, h // (heads // kv_heads)]
            w = torch.softmax((kh @ q[i, h]) * scale, dim=0)
            out[i, h] = w @ v[lo:end, h // (heads // kv_heads)]
    return out


@st.composite
def scenario(draw: st.DrawFn) -> dict[str, object]:
    bs = draw(st.sampled_from([1, 2, 3, 4, 8]))
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["full", "sliding_window", "chunked_local"]))
    spec = {
        "full": GroupSpec("g"),
        "sliding_window": GroupSpec("g", GroupKind.SLIDING_WINDOW, window=draw(st.integers(1, 8))),
        "chunked_local": GroupSpec("g", GroupKind.CHUNKED_LOCAL, chunk=draw(st.integers(1, 8))),
    }[kind]
    phase = draw(st.sampled_from(["prefill", "chunked", "decode", "denoise"]))
    nrows = draw(st.integers(1, 3))
    rows = []
    for _ in range(nrows):
        if phase == "denoise":
            p, t = draw(st.integers(0, 10)), draw(st.integers(1, 6))
            length, spans, start, seq_len = p + t, ((p, p + t),), p, p + t
        else:
            length = draw(st.integers(1, 20))
            spans = ()
            if draw(st.booleans()) and length >= 3:  # an image span inside the prompt
                a = draw(st.integers(0, length - 2))
                spans = ((a, draw(st.integers(a + 1, length))),)
            if phase == "decode":
                start, seq_len = length - 1, length
            elif phase == "chunked":
                start = draw(st.integers(0, length - 1))
                seq_len = draw(st.integers(start + 1, length))
            else:
                start, seq_len = draw(st.integers(0, length - 1)), length
        rows.append((length, spans, start, seq_len))
    return {
        "bs": bs,
        "kv_heads": kv_heads,
        "heads": heads,
        "spec": spec,
        "rows": rows,
        "seed": draw(st.integers(0, 2**16)),
        "d": draw(st.sampled_from([4, 8])),
    }


def build(
    sc: dict[str, object],
) -> tuple[torch.Tensor, list[torch.Tensor], PagePool, Worker, KVMetadata, LayerAttention, list]:
    bs, spec, rows = sc["bs"], sc["spec"], sc["rows"]  # type: ignore[assignment]
    g = torch.Generator().manual_seed(sc["seed"])  # type: ignore[arg-type]
    need = sum(-(-length // bs) for length, *_ in rows) + 1  # type: ignore[operator]
    cfg = CacheConfig(block_size=bs, num_blocks=need + 3, groups=(spec,))  # type: ignore[arg-type]
    pool = PagePool(cfg, num_layers=1, kv_heads=sc["kv_heads"], head_dim=sc["d"])  # type: ignore[arg-type]
    pool.k[0].fill_(float("nan"))  # anything not written (the null block, slots past seq_len) is NaN
    pool.v[0].fill_(float("nan"))
    ids = (torch.randperm(cfg.num_blocks - 1, generator=g) + 1).tolist()  # non-contiguous tables
    meta_rows, qs, dense_kv = [], [], []
    for r, (length, spans, start, seq_len) in enumerate(rows):  # type: ignore[misc]
        nb = -(-length // bs)
        table = [ids.pop() for _ in range(nb)]
        lo = 0
        if spec.kind is GroupKind.SLIDING_WINDOW:  # type: ignore[union-attr]
            lo = max(0, start - spec.window + 1)  # type: ignore[union-attr]
        elif spec.kind is GroupKind.CHUNKED_LOCAL:  # type: ignore[union-attr]
            lo = start // spec.chunk * spec.chunk  # type: ignore[union-attr]
        table = [0 if (j + 1) * bs <= lo else b for j, b in enumerate(table)]  # blocks a window let go
        k = torch.randn(length, sc["kv_heads"], sc["d"], generator=g)  # type: ignore[call-overload]
        v = torch.randn(length, sc["kv_heads"], sc["d"], generator=g)  # type: ignore[call-overload]
        written = [p for p in range(seq_len) if table[p // bs]]  # earlier steps wrote [0, seq_len)
        pool.write(
            0,
            k[written],
            v[written],
            torch.tensor(slots_of(table, bs, 0, seq_len))[torch.tensor([table[p // bs] != 0 for p in range(seq_len)])],
        )
        q = torch.randn(seq_len - start, sc["heads"], sc["d"], generator=g)  # type: ignore[call-overload]
        qs.append(q)
        dense_kv.append((k, v, start, seq_len, spans))
        meta_rows.append(
            RowMetadata(
                r,
                0,
                (tuple(table),),
                seq_len,
                seq_len - start,
                start,
                slots_of(table, bs, start, seq_len - start),
                segments_of(spans, seq_len, start),
            )
        )
    meta = KVMetadata(1, 0, bs, Phase.PREFILL, tuple(meta_rows))  # type: ignore[arg-type]
    worker = Worker(cfg, max_rows=4, max_blocks_per_row=32, max_tokens=128)
    layer = LayerAttention(0, spec, scale=1 / sc["d"] ** 0.5)  # type: ignore[arg-type, operator]
    return torch.cat(qs), qs, pool, worker, meta, layer, dense_kv


@given(scenario())
def test_torch_backend_over_pages_equals_dense(sc: dict[str, object]) -> None:
    q, qs, pool, worker, meta, layer, dense_kv = build(sc)
    batch = worker.install(meta)
    out = get_backend("torch").forward(q, pool.k[0], pool.v[0], batch, layer)
    ref = torch.cat(
        [
            dense(qr, k, v, start, seq_len, spans, layer.spec, layer.scale)
            for qr, (k, v, start, seq_len, spans) in zip(qs, dense_kv)
        ]
    )
    assert torch.isfinite(out).all(), "read a slot it must not read"
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max().clamp_min(1e-6)


@given(scenario())
def test_segment_calls_map_to_native_semantics(sc: dict[str, object]) -> None:
    """The calls native backends make (one causal flag each, kv_lens per row, tokens gathered and
    scattered back) reproduce the reference, run here with a torch stand-in of a varlen kernel."""
    q, qs, pool, worker, meta, layer, dense_kv = build(sc)
    structures = {tuple(s.causal for s in r.segments) for r in meta.rows}
    if len(structures) > 1:
        return  # the core refuses such a forward; native backends need one structure
    batch = worker.install(meta)
    bs = pool.config.block_size
    seq_lens = batch.seq_lens.tolist()

    def varlen_kernel(qp: torch.Tensor, call: object) -> torch.Tensor:
        # flash-attn's semantics: bottom-right aligned causal mask over kv_lens[r] keys of row r
        out = torch.empty_like(qp)
        cu = call.cu_seqlens_q.tolist()  # type: ignore[attr-defined]
        for r, kv_len in enumerate(call.kv_lens.tolist()):  # type: ignore[attr-defined]
            table = batch.block_tables[0, r].long()
            k = pool.k[0][table].reshape(-1, *pool.k[0].shape[2:])[:kv_len]
            v = pool.v[0][table].reshape(-1, *pool.v[0].shape[2:])[:kv_len]
            ql = cu[r + 1] - cu[r]
            for i in range(ql):
                pos = kv_len - ql + i if call.causal else kv_len - 1  # type: ignore[attr-defined]
                lo = 0
                if layer.spec.kind is GroupKind.SLIDING_WINDOW:
                    lo = max(0, pos - layer.spec.window + 1)  # type: ignore[operator]
                elif layer.spec.kind is GroupKind.CHUNKED_LOCAL:
                    return torch.full_like(qp, float("nan"))  # native kernels have no chunked form
                heads, kvh = qp.shape[1], k.shape[1]
                for h in range(heads):
                    kk, vv = k[lo : pos + 1, h // (heads // kvh)], v[lo : pos + 1, h // (heads // kvh)]
                    out[cu[r] + i, h] = torch.softmax(kk @ qp[cu[r] + i, h] * layer.scale, 0) @ vv
        return out

    if layer.spec.kind is GroupKind.CHUNKED_LOCAL or any(not s.causal for r in meta.rows for s in r.segments):
        if layer.spec.kind is not GroupKind.FULL:
            return  # full spans under a window: the native band form differs; the torch backend covers it
    got = run_segments(q, batch, varlen_kernel)
    ref = get_backend("torch").forward(q, pool.k[0], pool.v[0], batch, layer)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max().clamp_min(1e-6)
    assert len(segment_calls(batch)) == len(meta.rows[0].segments) and seq_lens and bs


def test_unavailable_backends_name_the_package() -> None:
    for name, package in (("flash_attn", "flash-attn"), ("npu", "torch-npu")):
        try:
            get_backend(name)
        except BackendUnavailable as e:
            assert package in str(e) and "pip install" in str(e)
        else:  # pragma: no cover - only where the package is installed
            pytest.skip(f"{name} is installed here")
    with pytest.raises(BackendUnavailable):
        get_backend("dense")


def test_flash_attn_backend_matches_torch_on_cuda() -> None:
    pytest.importorskip(
        "flash_attn",
        reason="flash-attn is not installed here (pip install 'pagedkv[flash]'); "
        "its call mapping is checked through segment_calls above",
    )
    if not torch.cuda.is_available():
        pytest.skip("flash-attn needs a CUDA device")
    sc = {
        "bs": 256,
        "kv_heads": 2,
        "heads": 8,
        "spec": GroupSpec("g"),
        "seed": 0,
        "d": 64,
        "rows": [(300, (), 0, 300), (520, (), 519, 520)],
    }
    q, _, pool, worker, meta, layer, _ = build(sc)
    pool.k[0], pool.v[0] = pool.k[0].nan_to_num().cuda().bfloat16(), pool.v[0].nan_to_num().cuda().bfloat16()
    worker = Worker(pool.config, max_rows=4, max_blocks_per_row=32, max_tokens=1024, device="cuda")
    batch = worker.install(meta)
    got = get_backend("flash_attn").forward(q.cuda().bfloat16(), pool.k[0], pool.v[0], batch, layer).float()
    ref = get_backend("torch").forward(q.cuda().bfloat16(), pool.k[0], pool.v[0], batch, layer).float()
    assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_the_documented_model_runner_runs() -> None:
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "shell_runner.py"), run_name="__main__")


def test_the_phase_backend_routes_decode_and_prefill_to_their_backends() -> None:
    """``triton+flashinfer``'s routing, shown with two torch backends on the CPU: decode forwards on the
    decode backend, several query tokens on the other, float32 forwards all on the decode one; the tokens
    are those one backend gives."""
    from dataclasses import replace

    from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
    from pagedkv.shell.attention.phases import PhaseBackend
    from pagedkv.shell.attention.torch_ref import TorchBackend
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.sampling import SamplingParams

    class Other(TorchBackend):
        name = "other"

    cfg = replace(
        SMOLLM2_SHAPES, vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
    )
    prompts = [
        (f"p{i}", [(5 * i + j) % 97 for j in range(9 + 4 * i)], SamplingParams(temperature=0.0, max_tokens=6))
        for i in range(3)
    ]
    for dtype, prefill_calls in ((torch.bfloat16, True), (torch.float32, False)):
        model = random_llama(cfg, seed=1, dtype=dtype)
        plain = [c.token_ids for c in Engine(model, IdTokenizer(), block_size=4).generate(prompts)]
        both = PhaseBackend(TorchBackend(), Other())
        eng = Engine(model, IdTokenizer(), block_size=4)
        eng.runner.backend = both  # the engine's forwards (its model runner's) through the phase backend
        assert [c.token_ids for c in eng.generate(prompts)] == plain
        assert both.name == "torch+other" and both.calls["torch"] > 0
        assert (both.calls["other"] > 0) == prefill_calls, both.calls
