"""The flashinfer backend on the GPU: its multi-token path against the torch reference for every phase
(prefill, chunked prefill, image span, denoise target span, sliding window, large blocks); what it
refuses (float32, a full span under a window) with the reason; its decode against triton's on the same
pages; CUDA-graph decode against its eager step; an engine on it against one on triton. Skipped without
a GPU and without ``flashinfer-python``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

pytest.importorskip(
    "flashinfer", reason="the flashinfer backend needs flashinfer-python (pip install flashinfer-python)"
)
pytest.importorskip("triton", reason="the comparisons run triton beside it")

from tests.gpu import decode_rig  # noqa: E402
from tests.gpu import prefill_cases  # noqa: E402
from pagedkv.shell.attention import get_backend  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams
from pagedkv.shell.errors import ShellError  # noqa: E402

CASES = prefill_cases.cases()
REFUSED = {"sliding window, image span"}  # a full span under a window: no FlashInfer window form


@pytest.mark.parametrize("name, rows, spec, bs", CASES, ids=[c[0] for c in CASES])
def test_multi_token_phases_equal_the_reference(name: str, rows: list, spec: object, bs: int) -> None:
    if name in REFUSED:
        with pytest.raises(ShellError, match="full span under a sliding window"):
            prefill_cases.case(name, rows, spec, bs, torch.bfloat16, backend="flashinfer")  # type: ignore[arg-type]
        return
    _, err, _, _ = prefill_cases.case(name, rows, spec, bs, torch.bfloat16, backend="flashinfer")  # type: ignore[arg-type]
    assert err < prefill_cases.TOLERANCE[torch.bfloat16], err


def test_float32_is_refused_with_the_reason() -> None:
    name, rows, spec, bs = CASES[0]
    with pytest.raises(ShellError, match="float16 and bfloat16"):
        prefill_cases.case(name, rows, spec, bs, torch.float32, backend="flashinfer")


@pytest.fixture(scope="module")
def rig() -> decode_rig.DecodeRig:
    return decode_rig.DecodeRig(get_backend("flashinfer"))


@pytest.mark.parametrize("batch_size", [1, 5, 8, 64])  # 5: a bucket of 8 with three padding rows
def test_graph_replay_equals_the_eager_step(rig: decode_rig.DecodeRig, batch_size: int) -> None:
    _, _, diff = rig.compare(batch_size)
    assert diff < 2e-2, diff


DECODE = prefill_cases.decode_cases()


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
@pytest.mark.parametrize("name, rows, spec, bs", DECODE, ids=[c[0] for c in DECODE])
def test_decode_equals_the_reference(name: str, rows: list, spec: object, bs: int, backend: str) -> None:
    """Both backends' decode on the same shuffled pages against the float32 torch reference (bf16 inputs)."""
    from pagedkv.core import Phase

    _, err, _, _ = prefill_cases.case(
        name,
        rows,
        spec,
        bs,
        torch.bfloat16,
        backend=backend,  # type: ignore[arg-type]
        phase=Phase.DECODE,
    )
    assert err < prefill_cases.TOLERANCE[torch.bfloat16], err


def test_an_engine_on_flashinfer_gives_triton_s_tokens() -> None:
    """The real SmolLM2 weights, bf16 (FlashInfer has no fp32), greedy, the four prompts of bench/gpu_serve.py:
    FlashInfer's graph path gives its eager path's tokens exactly; FlashInfer's and triton+flashinfer's
    first 16 tokens of every prompt equal triton's (bf16 kernels summing in another order may part at a
    near tie later: bench/gpu_backends.py reports where). Random weights are no oracle here: their greedy
    runs are full of near ties."""
    from tests.gpu.prompts import PROMPTS, prompt_text
    from pagedkv.models.gguf import ModelFileMissing
    from pagedkv.models.llama import Llama
    from pagedkv.models.tokenizer import Tokenizer

    try:
        model, meta = Llama.smollm2(device="cuda", dtype=torch.bfloat16)
    except ModelFileMissing as e:
        pytest.skip(str(e))
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    texts = [prompt_text(tok, p, sys_) for p, sys_ in PROMPTS]
    reqs = [(t, tok.encode(t), SamplingParams(temperature=0.0, max_tokens=24)) for t in texts]
    runs = {}
    for backend, graphs in (("triton", True), ("flashinfer", False), ("flashinfer", True), ("triton+flashinfer", True)):
        eng = Engine(model, tok, backend=backend, block_size=16, kv_cache_memory_bytes=64 << 20, cuda_graphs=graphs)
        runs[(backend, graphs)] = [c.token_ids for c in eng.generate(reqs)]
        assert eng.state.kv.free_blocks == eng.cache.usable_blocks
        assert (eng.runner.graphs is not None and eng.runner.graphs.replays > 0) == graphs
        if backend == "triton+flashinfer":
            assert all(n > 0 for n in eng.backend.calls.values()), eng.backend.calls  # type: ignore[attr-defined]
    assert runs[("flashinfer", True)] == runs[("flashinfer", False)]
    for name in ("flashinfer", "triton+flashinfer"):
        for ours, theirs in zip(runs[(name, True)], runs[("triton", True)]):
            assert ours[:16] == theirs[:16], (name, ours, theirs)


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_flashinfer_reads_fp8_pages_with_the_layers_scales(tensor_cores: bool) -> None:
    """FlashInfer's decode and prefill kernels, planned and run as the flashinfer backend does (``kv_data_type``
    fp8, the layer's ``k_scale`` / ``v_scale`` passed to ``run``), equal fp32 math over the pages' values
    times their scales; without the scales they do not (a test that can fail)."""
    import flashinfer

    from tests.gpu.fp8_case import fp8_case

    B, L, H, KVH, D, bs = 3, 100, 32, 8, 128, 16
    nb = -(-L // bs)
    q, k8, v8, ks, vs, table, _, want = fp8_case(5, B, L, H, KVH, D, bs, torch.float8_e4m3fn, torch.bfloat16)
    i32 = torch.int32
    indptr = torch.arange(B + 1, dtype=i32) * nb
    last = torch.full((B,), L - (nb - 1) * bs, dtype=i32)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    kw = {"q_data_type": torch.bfloat16, "kv_data_type": torch.float8_e4m3fn, "sm_scale": D**-0.5}
    dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    dec.plan(indptr, table.reshape(-1).to(i32).cpu(), last, H, KVH, D, bs, **kw)
    pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    pre.plan(
        torch.arange(B + 1, dtype=i32), indptr, table.reshape(-1).to(i32).cpu(), last, H, KVH, D, bs, causal=True, **kw
    )

    def err(got: torch.Tensor) -> float:
        return ((got.float() - want).norm() / want.norm()).item()

    for wrapper in (dec, pre):
        assert err(wrapper.run(q, (k8, v8), k_scale=ks, v_scale=vs)) < 1e-2
        assert err(wrapper.run(q, (k8, v8))) > 0.1


def test_an_engine_on_fp8_pages_runs_on_flashinfer_with_graphs() -> None:
    """An engine on fp8 pages with the flashinfer backend (CUDA graphs on) serves every request to its end and
    gives every block back; its kernels' numbers are the test above's."""
    from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama

    model = random_llama(SMOLLM2_SHAPES, dtype=torch.bfloat16, device="cuda")
    prompts = [
        (f"p{i}", [(11 * i + j) % 49152 for j in range(30 + 7 * i)], SamplingParams(temperature=0.0, max_tokens=6))
        for i in range(4)
    ]
    eng = Engine(
        model, IdTokenizer(), backend="flashinfer", block_size=16, kv_cache_memory_bytes=64 << 20, kv_cache_dtype="fp8"
    )
    assert eng.pool.fp8
    done = eng.generate(prompts)
    assert [len(c.token_ids) for c in done] == [6] * 4
    assert eng.runner.graphs is not None and eng.runner.graphs.replays > 0
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks
