"""The triton backend on the GPU: its varlen path against the torch reference for prefill, chunked
prefill, full spans, denoising steps, sliding windows and large blocks; its fused K/V write; CUDA-graph
decode against the eager step; and an engine on it against one on the torch backend."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

pytest.importorskip("triton", reason="the triton backend needs triton")

from tests.gpu import decode_rig  # noqa: E402
from tests.gpu import prefill_cases  # noqa: E402
from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams

CASES = prefill_cases.cases()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name, rows, spec, bs", CASES, ids=[c[0] for c in CASES])
def test_varlen_equals_the_reference(name: str, rows: list, spec: object, bs: int, dtype: torch.dtype) -> None:
    _, err, _, _ = prefill_cases.case(name, rows, spec, bs, dtype)  # type: ignore[arg-type]
    assert err < prefill_cases.TOLERANCE[dtype], err


def test_the_fused_kv_write_equals_index_copy() -> None:
    assert decode_rig.fused_write_matches()


@pytest.fixture(scope="module")
def rig() -> decode_rig.DecodeRig:
    return decode_rig.DecodeRig()


@pytest.mark.parametrize("batch_size", [1, 5, 8, 64])  # 5: a bucket of 8 with three padding rows
def test_graph_replay_equals_the_eager_step(rig: decode_rig.DecodeRig, batch_size: int) -> None:
    _, _, diff = rig.compare(batch_size)
    assert diff < 2e-2, diff  # bf16: the graph and the eager step run the same kernels


def test_an_engine_on_triton_gives_the_torch_backends_tokens() -> None:
    model = random_llama(SMOLLM2_SHAPES, device="cuda")
    prompts = [
        (f"p{i}", [(7 * i + j) % 49152 for j in range(40 + 9 * i)], SamplingParams(temperature=0.0, max_tokens=12))
        for i in range(4)
    ]
    runs = {}
    for backend in ("torch", "triton"):
        eng = Engine(model, IdTokenizer(), backend=backend, block_size=16, kv_cache_memory_bytes=64 << 20)
        runs[backend] = [c.token_ids for c in eng.generate(prompts)]
        assert eng.state.kv.free_blocks == eng.cache.usable_blocks  # every block back
    assert runs["triton"] == runs["torch"]


def test_the_engine_replays_graphs_and_gives_the_eager_tokens() -> None:
    """The engine captures its graphs at start-up and decodes by replay; greedy and seeded sampled requests
    get the tokens of the same engine with graphs off, and a seeded request alone gets its batched tokens."""
    model = random_llama(SMOLLM2_SHAPES, device="cuda")
    params = [
        SamplingParams(temperature=0.0, max_tokens=16),
        SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=6),
    ]
    prompts = [(f"p{i}", [(5 * i + j) % 49152 for j in range(30 + 11 * i)], params[i % 3]) for i in range(6)]
    runs = {}
    for graphs in (True, False):
        eng = Engine(
            model, IdTokenizer(), backend="triton", kv_cache_memory_bytes=64 << 20, max_num_seqs=8, cuda_graphs=graphs
        )
        assert (eng.runner.graphs is not None) == graphs and (not graphs or eng.runner.graphs.captures == 1)
        runs[graphs] = [c.token_ids for c in eng.generate(prompts)]
    assert runs[True] == runs[False]
    alone = Engine(model, IdTokenizer(), backend="triton", kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
    assert [c.token_ids for c in alone.generate(prompts[1:2])] == runs[True][1:2]


def test_prefill_forwards_replay_graphs_and_give_the_eager_tokens() -> None:
    """A prefill forward whose tokens a captured bucket holds is laid out one token a row and replayed (a step
    that carries prompt tokens is not launched layer by layer); a long prompt runs in chunks of at most 512 tokens
    (the engine's default ``long_prefill_token_threshold`` with graphs) that replay too, or with the cap off in one
    eager forward; greedy tokens equal the engine's with graphs off in every case."""
    model = random_llama(SMOLLM2_SHAPES, device="cuda")
    short = [
        (f"s{i}", [(3 * i + j) % 49152 for j in range(20 + 7 * i)], SamplingParams(temperature=0.0, max_tokens=1))
        for i in range(4)
    ]
    long = [("l", [(11 + j) % 49152 for j in range(1200)], SamplingParams(temperature=0.0, max_tokens=4))]
    runs = {}
    for graphs, cap in ((True, None), (True, 0), (False, None)):
        eng = Engine(
            model,
            IdTokenizer(),
            backend="triton",
            kv_cache_memory_bytes=64 << 20,
            max_num_seqs=8,
            cuda_graphs=graphs,
            long_prefill_token_threshold=cap,
        )
        assert eng.worker.token_rows == (min(eng.args.max_num_batched_tokens, 512) if graphs else 0)
        assert eng.state.config.long_prefill_token_threshold == (512 if graphs and cap is None else 0)
        before = 0 if eng.runner.graphs is None else eng.runner.graphs.replays
        runs[graphs, cap, "short"] = [c.token_ids for c in eng.generate(short)]  # one prefill forward, a token each
        if graphs:
            assert eng.runner.graphs.replays == before + 1  # the prompts' forward: replayed
            before = eng.runner.graphs.replays
        runs[graphs, cap, "long"] = [c.token_ids for c in eng.generate(long)]
        if graphs:  # chunks of 512, 512, 176 replayed, then 3 decodes; or one eager chunk of 1,200, then 3 decodes
            assert eng.runner.graphs.replays == before + (6 if cap is None else 3)
    for part in ("short", "long"):
        assert runs[True, None, part] == runs[False, None, part] == runs[True, 0, part]


def test_a_prefill_forward_over_the_bucket_replays_in_pieces_between_requests() -> None:
    """Eight prompts of 100-135 tokens admitted in one step (925 tokens: over the 512-row bucket, each under it):
    the forward is cut between requests into two pieces, each replayed; greedy tokens equal the engine's with
    graphs off."""
    model = random_llama(SMOLLM2_SHAPES, device="cuda")
    prompts = [
        (f"p{i}", [(13 * i + j) % 49152 for j in range(100 + 5 * i)], SamplingParams(temperature=0.0, max_tokens=6))
        for i in range(8)
    ]
    runs = {}
    for graphs in (True, False):
        eng = Engine(
            model, IdTokenizer(), backend="triton", kv_cache_memory_bytes=64 << 20, max_num_seqs=8, cuda_graphs=graphs
        )
        before = 0 if eng.runner.graphs is None else eng.runner.graphs.replays
        runs[graphs] = [c.token_ids for c in eng.generate(prompts)]
        assert eng.stats.steps == 6  # (the prompts in one step, then five decodes)
        if graphs:
            assert eng.runner.graphs.replays == before + 2 + 5
    assert runs[True] == runs[False]


def test_a_model_whose_products_outweigh_its_launches_replays_what_a_bucket_holds_and_cuts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model that says Llama-8B's matrix parameters (its launch bound 34 tokens overlapped, under the 512-row
    bucket): a prompt forward of 300 tokens is still laid out a token a row and replayed (``ModelRunner.flat_tokens``,
    a bucket's tokens at every size), and eight prompts of 940 tokens in all in one step are not cut into replays
    (``ModelRunner.pieces`` off): that step runs eagerly. Greedy tokens equal the engine's with graphs off."""
    from pagedkv.models.llama import Llama

    monkeypatch.setattr(Llama, "matmul_params", property(lambda self: 6_979_321_856))
    model = random_llama(SMOLLM2_SHAPES, device="cuda")
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    one = [("one", [(7 * j) % 49152 for j in range(300)], greedy)]
    eight = [(f"p{i}", [(13 * i + j) % 49152 for j in range(100 + 5 * i)], greedy) for i in range(8)]
    runs = {}
    for graphs in (True, False):
        eng = Engine(
            model, IdTokenizer(), backend="triton", kv_cache_memory_bytes=64 << 20, max_num_seqs=8, cuda_graphs=graphs
        )
        if graphs:
            assert (eng.runner.flat_tokens, eng.runner.pieces) == (512, False)
        before = 0 if eng.runner.graphs is None else eng.runner.graphs.replays
        runs[graphs, "one"] = [c.token_ids for c in eng.generate(one)]
        if graphs:  # the prompt's forward and five decodes, each replayed
            assert eng.runner.graphs.replays == before + 1 + 5
            before = eng.runner.graphs.replays
        runs[graphs, "eight"] = [c.token_ids for c in eng.generate(eight)]
        if graphs:  # the prompts' forward eagerly, whole; five decodes replayed
            assert eng.runner.graphs.replays == before + 5
    assert runs[True, "one"] == runs[False, "one"] and runs[True, "eight"] == runs[False, "eight"]


def test_decode_rows_riding_in_an_eager_prompt_forward_give_the_torch_backends_tokens() -> None:
    """Prompts of 600-700 tokens (over the 512-row bucket, the chunk cap off: eager forwards) arrive while others
    decode: the decode rows ride in the prompt's eager forward (``ride_along``'s eager room), their attention through
    the decode kernel (``decode_lead``), the prompt's through the varlen kernel; every request gets the tokens of an
    engine on the torch backend served the same way (fp32)."""
    from pagedkv.shell import runner

    model = random_llama(SMOLLM2_SHAPES, device="cuda")
    prompts = [[(17 * i + j) % 49152 for j in range(600 + 25 * i)] for i in range(5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    runs, rode = {}, []
    real = runner.ride_along

    def spy(forwards: list, most: int, eager: int = 0) -> list:
        out = real(forwards, most, eager)
        rode.append(any(lead is not None and f.num_query_tokens > most for f, lead in out))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "ride_along", spy)
        for backend in ("torch", "triton"):
            eng = Engine(
                model, IdTokenizer(), backend=backend, kv_cache_memory_bytes=256 << 20, max_num_seqs=8,
                long_prefill_token_threshold=0,
            )  # fmt: skip
            done = []
            for i, p in enumerate(prompts):
                eng.add_request(f"p{i}", "", p, greedy)
                done += eng.step() + eng.step()
            while eng.has_unfinished():
                done += eng.step()
            runs[backend] = sorted((c.request_id, c.token_ids) for c in done)
            assert eng.state.kv.free_blocks == eng.cache.usable_blocks  # every block back
    assert sum(rode) >= 8  # (four arrivals a backend rode eagerly)
    assert runs["triton"] == runs["torch"]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pages_are_read_in_registers_as_the_dequantized_values(fp8: torch.dtype) -> None:
    """The decode and varlen kernels over fp8 pages equal fp32 math over the pages' values times their scales."""
    from pagedkv.shell.attention.triton_decode import paged_decode, paged_varlen
    from tests.gpu.fp8_case import fp8_case

    B, D = 3, 64
    q, k8, v8, ks, vs, table, lens, want = fp8_case(3, B, 100, 8, 2, D, 16, fp8, torch.float32)
    got = paged_decode(q, k8, v8, table, lens, D**-0.5, kv_scales=(ks, vs))
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    got = paged_varlen(q, k8, v8, table, cu, lens, 1, causal=True, scale=D**-0.5, kv_scales=(ks, vs))
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    plain = paged_decode(q, k8, v8, table, lens, D**-0.5)  # the scales ignored: a test that can fail
    assert ((plain - want).norm() / want.norm()).item() > 0.1


def test_an_engine_on_fp8_pages_gives_the_torch_backends_tokens_with_graphs() -> None:
    model = random_llama(SMOLLM2_SHAPES, device="cuda")
    prompts = [
        (f"p{i}", [(7 * i + j) % 49152 for j in range(40 + 9 * i)], SamplingParams(temperature=0.0, max_tokens=12))
        for i in range(4)
    ]
    runs = {}
    for backend in ("torch", "triton"):
        eng = Engine(
            model, IdTokenizer(), backend=backend, block_size=16, kv_cache_memory_bytes=64 << 20, kv_cache_dtype="fp8"
        )
        assert eng.pool.fp8 and (eng.runner.graphs is not None) == (backend == "triton")
        runs[backend] = [c.token_ids for c in eng.generate(prompts)]
    assert runs["triton"] == runs["torch"]


@pytest.mark.parametrize("drafts", [2, 4])
def test_verified_tokens_are_the_decoded_tokens_in_bf16(drafts: int) -> None:
    """Eight greedy requests in bf16 with graphs: with n-gram drafts verified beside them (each position a token
    row of the decode kernel, more rows than the batch) the tokens are those decoding makes (issue 48: they
    parted at batch 8 with two drafts while the decode kernel's splits followed the number of rows)."""
    model = random_llama(SMOLLM2_SHAPES, device="cuda", dtype=torch.bfloat16)
    prompts = [
        (
            f"p{i}",
            [(5 * i + j % 7) % 49152 for j in range(30 + 11 * i)] * 2,
            SamplingParams(temperature=0.0, max_tokens=24),
        )
        for i in range(8)
    ]
    runs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": drafts, "prompt_lookup_min": 2}):
        eng = Engine(
            model,
            IdTokenizer(),
            backend="triton",
            block_size=16,
            kv_cache_memory_bytes=64 << 20,
            speculative_config=spec,
        )
        runs[spec is None] = [c.token_ids for c in eng.generate(prompts)]
        assert eng.runner.graphs is not None and eng.runner.graphs.replays > 0
        assert (eng.stats.verifies > 0) == (spec is not None)
    assert runs[False] == runs[True]


@pytest.mark.parametrize("G", [1, 3, 4, 8])
@pytest.mark.parametrize("pages", ["bf16", "fp8", "fp32"])
def test_the_decode_kernel_over_group_sizes_tails_and_windows(G: int, pages: str) -> None:
    """paged_decode against fp32 math for every query-row padding (1, 3 -> 4, 4, 8 query heads a KV head), rows
    whose keys end inside a tile or a split, more programs than a row has splits, and a sliding window; and each
    row's bits the same whatever the programs a row and whatever rows sit beside it (tables cut narrower too)."""
    from pagedkv.shell.attention.triton_decode import paged_decode
    from pagedkv.shell.pool import quantize

    gen = torch.Generator(device="cuda").manual_seed(G)
    KVH, D, bs, lens = 2, 64, 16, [1, 17, 64, 65, 300, 700]
    nb = -(-max(lens) // bs)
    k = torch.randn(len(lens) * nb + 1, bs, KVH, D, device="cuda", generator=gen)
    v = torch.randn(len(lens) * nb + 1, bs, KVH, D, device="cuda", generator=gen)
    q = torch.randn(len(lens), G * KVH, D, device="cuda", generator=gen)
    scales = (1.0, 1.0)
    if pages == "fp8":
        scales = (float(k.abs().max()) / 200, float(v.abs().max()) / 100)
        kp, vp = quantize(k, scales[0], torch.float8_e4m3fn), quantize(v, scales[1], torch.float8_e4m3fn)
        k, v, q = kp.float() * scales[0], vp.float() * scales[1], q.bfloat16()
    elif pages == "bf16":
        kp, vp, q = k.bfloat16(), v.bfloat16(), q.bfloat16()
        k, v = kp.float(), vp.float()
    else:
        kp, vp = k, v
    table = (torch.randperm(len(lens) * nb, device="cuda", generator=gen) + 1).view(len(lens), nb).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for window, programs in ((0, 1), (0, 2), (300, 2), (40, 8), (0, None)):  # None: auto_programs
        out = paged_decode(q, kp, vp, table, seq, D**-0.5, programs=programs, window=window, kv_scales=scales)
        alone = paged_decode(q[4:5], kp, vp, table[4:5, :20], seq[4:5], D**-0.5, window=window, kv_scales=scales)
        assert torch.equal(out[4:5], alone), (
            G,
            pages,
            window,
            programs,
        )  # (300 keys: two splits; its table cut to 20 blocks)
        got = out.float()
        for r, L in enumerate(lens):
            lo = max(0, L - window) if window else 0
            idx = torch.arange(lo, L, device="cuda")
            kc = k[table[r, idx // bs].long(), idx % bs].transpose(0, 1)  # (KVH, L, D)
            vc = v[table[r, idx // bs].long(), idx % bs].transpose(0, 1)
            want = torch.nn.functional.scaled_dot_product_attention(
                q[r].float()[:, None], kc, vc, scale=D**-0.5, enable_gqa=True
            )[:, 0]
            err = ((got[r] - want).norm() / want.norm()).item()
            assert err < (1e-4 if pages == "fp32" else 1e-2), (G, pages, window, L, err)
