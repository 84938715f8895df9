"""The flashinfer backend on the GPU: its multi-token path against the torch reference for every phase
(prefill, chunked prefill, image span, denoise target span, sliding window, large blocks); what it
refuses (float32, a full span under a window) with the reason; its decode against triton's on the same
pages; CUDA-graph decode against its eager step; an engine on it against one on triton. Skipped without
a GPU and without ``flashinfer-python``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

pytest.importorskip("flashinfer", reason="the flashinfer backend needs flashinfer-python (pip install flashinfer-python)")
pytest.importorskip("triton", reason="the comparisons run triton beside it")

from bench import gpu_decode, gpu_prefill_check  # noqa: E402
from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama  # noqa: E402
from pagedkv.shell.attention import get_backend  # noqa: E402
from pagedkv.shell.engine import Engine, SamplingParams  # noqa: E402
from pagedkv.shell.errors import ShellError  # noqa: E402

CASES = gpu_prefill_check.cases()
REFUSED = {"sliding window, image span"}  # a full span under a window: no FlashInfer window form


@pytest.mark.parametrize("name, rows, spec, bs", CASES, ids=[c[0] for c in CASES])
def test_multi_token_phases_equal_the_reference(name: str, rows: list, spec: object, bs: int) -> None:
    if name in REFUSED:
        with pytest.raises(ShellError, match="full span under a sliding window"):
            gpu_prefill_check.case(name, rows, spec, bs, torch.bfloat16, backend="flashinfer")  # type: ignore[arg-type]
        return
    _, err, _, _ = gpu_prefill_check.case(name, rows, spec, bs, torch.bfloat16, backend="flashinfer")  # type: ignore[arg-type]
    assert err < gpu_prefill_check.TOLERANCE[torch.bfloat16], err


def test_float32_is_refused_with_the_reason() -> None:
    name, rows, spec, bs = CASES[0]
    with pytest.raises(ShellError, match="float16 and bfloat16"):
        gpu_prefill_check.case(name, rows, spec, bs, torch.float32, backend="flashinfer")


@pytest.fixture(scope="module")
def decode_bench() -> gpu_decode.DecodeBench:
    return gpu_decode.DecodeBench(get_backend("flashinfer"))


@pytest.mark.parametrize("batch_size", [1, 5, 8, 64])  # 5: a bucket of 8 with three padding rows
def test_graph_replay_equals_the_eager_step(decode_bench: gpu_decode.DecodeBench, batch_size: int) -> None:
    _, _, diff = decode_bench.compare(batch_size)
    assert diff < 2e-2, diff


def test_decode_logits_equal_triton_s(decode_bench: gpu_decode.DecodeBench) -> None:
    triton = gpu_decode.DecodeBench()  # the same seeded weights, the same rows, the triton backend
    batch = decode_bench.rank.worker.install(decode_bench.meta(8))
    tokens = torch.randint(0, decode_bench.model.config.vocab_size, (8,), device="cuda")
    ours = decode_bench.eager(tokens, batch).float()
    tbatch = triton.rank.worker.install(triton.meta(8))
    theirs = triton.eager(tokens, tbatch).float()
    assert ((ours - theirs).norm() / theirs.norm()).item() < 2e-2


def test_an_engine_on_flashinfer_gives_triton_s_tokens() -> None:
    """bf16 (FlashInfer has no fp32): greedy tokens of random SmolLM2-shaped weights, batched with prefix
    hits, graphs on; the tokens equal triton's up to where the two first disagree by a near tie."""
    model = random_llama(SMOLLM2_SHAPES, dtype=torch.bfloat16, device="cuda")
    head = [(11 * j) % 49152 for j in range(48)]
    prompts = [(f"p{i}", head + [(7 * i + j) % 49152 for j in range(20 + 9 * i)], SamplingParams(max_tokens=12))
               for i in range(4)]  # fmt: skip
    runs = {}
    for backend in ("triton", "flashinfer"):
        eng = Engine(model, IdTokenizer(), backend=backend, block_size=16, kv_cache_memory_bytes=64 << 20)
        runs[backend] = [c.token_ids for c in eng.generate(prompts)]
        assert eng.state.kv.free_blocks == eng.cache.usable_blocks
        if backend == "flashinfer":
            assert eng.graphs is not None and eng.graphs.replays > 0  # its decode ran from CUDA graphs
    same = sum(a == b for ra, rb in zip(runs["triton"], runs["flashinfer"]) for a, b in zip(ra, rb))
    total = sum(len(r) for r in runs["triton"])
    assert same >= 0.9 * total, (runs["triton"], runs["flashinfer"])
