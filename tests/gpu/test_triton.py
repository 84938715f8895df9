"""The triton backend on the GPU: its varlen path against the torch reference for prefill, chunked
prefill, full spans, denoising steps, sliding windows and large blocks; its fused K/V write; CUDA-graph
decode against the eager step; and an engine on it against one on the torch backend."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

pytest.importorskip("triton", reason="the triton backend needs triton")

from bench import gpu_decode, gpu_prefill_check  # noqa: E402
from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama  # noqa: E402
from pagedkv.shell.engine import Engine, SamplingParams  # noqa: E402

CASES = gpu_prefill_check.cases()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name, rows, spec, bs", CASES, ids=[c[0] for c in CASES])
def test_varlen_equals_the_reference(name: str, rows: list, spec: object, bs: int, dtype: torch.dtype) -> None:
    _, err, _, _ = gpu_prefill_check.case(name, rows, spec, bs, dtype)  # type: ignore[arg-type]
    assert err < gpu_prefill_check.TOLERANCE[dtype], err


def test_the_fused_kv_write_equals_index_copy() -> None:
    assert gpu_decode.fused_write_matches()


@pytest.fixture(scope="module")
def decode_bench() -> gpu_decode.DecodeBench:
    return gpu_decode.DecodeBench()


@pytest.mark.parametrize("batch_size", [1, 5, 8, 64])  # 5: a bucket of 8 with three padding rows
def test_graph_replay_equals_the_eager_step(decode_bench: gpu_decode.DecodeBench, batch_size: int) -> None:
    _, _, diff = decode_bench.compare(batch_size)
    assert diff < 2e-2, diff  # bf16: the graph and the eager step run the same kernels


def test_an_engine_on_triton_gives_the_torch_backends_tokens() -> None:
    model = random_llama(SMOLLM2_SHAPES, device="cuda")
    prompts = [(f"p{i}", [(7 * i + j) % 49152 for j in range(40 + 9 * i)], SamplingParams(max_tokens=12))
               for i in range(4)]  # fmt: skip
    runs = {}
    for backend in ("torch", "triton"):
        eng = Engine(model, IdTokenizer(), backend=backend, block_size=16, kv_cache_memory_bytes=64 << 20)
        runs[backend] = [c.token_ids for c in eng.generate(prompts)]
        assert eng.state.kv.free_blocks == eng.cache.usable_blocks  # every block back
    assert runs["triton"] == runs["torch"]
