"""Mamba2 hybrids on a CUDA device through the engine's defaults there (the triton attention backend over pages
whose K and V blocks lie a page apart, CUDA-graph decode capturing the mixer's step) give the greedy tokens of the
CPU engine on the torch reference (which tests/models/test_mamba_hybrid.py holds equal to transformers 5.24's Bamba
and GraniteMoeHybrid; the GPU machine's transformers 5.17 gives other tokens for Bamba from the same weights, so
it is the oracle only where it is 5.24 or newer), batched with chunked prefill and preemption; ``mamba_ssm``'s
kernels, where they import, give the torch mixer's tokens; the host tier brings saved states back over CUDA's
streams."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.cuda

pytest.importorskip("transformers", reason="the reference needs transformers")

from pagedkv.models.hf import Weights, hf_config  # noqa: E402
from pagedkv.models.hybrid import HybridModel  # noqa: E402
from pagedkv.models.llama import IdTokenizer  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams  # noqa: E402
from tests.models.test_mamba_hybrid import BLOCK, PAGE_BYTES, TIER_POOL, conversations, hf_model, prompts  # noqa: E402


@pytest.fixture(scope="module", params=["bamba", "granite"])
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf.to("cuda"), path


def ours(path: Path, mixer: str = "torch", device: str = "cuda") -> HybridModel:
    _, config, _ = hf_config(str(path))
    return HybridModel(config, Weights(str(path)), device=device, mixer=mixer)  # type: ignore[arg-type]


def reference(hf: Any, path: Path, batch: list[list[int]], new: int) -> list[list[int]]:
    """The CPU engine's tokens (the torch reference), and transformers' on the device where it is 5.24 or newer."""
    _, want = serve(ours(path, device="cpu"), batch, new, kv_cache_memory_bytes=8 << 20)
    import transformers

    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24):
        for p, w in zip(batch, want):
            ids = torch.tensor([p], device="cuda")
            with torch.no_grad():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            assert out[0, len(p) :].tolist() == w
    return want


def engine(model: HybridModel, **kw: Any) -> Engine:
    return Engine(model, IdTokenizer(), block_size=BLOCK, max_num_seqs=4, **kw)


def serve(model: HybridModel, batch: list[list[int]], new: int, **kw: Any) -> tuple[Engine, list[list[int]]]:
    eng = engine(model, **kw)
    done = eng.generate([(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=new)) for i, p in enumerate(batch)])
    return eng, [c.token_ids for c in done]


def test_triton_and_graphs_give_transformers_tokens(models: tuple[Any, Path]) -> None:
    hf, path = models
    batch = prompts((70, 45, 9), 1)
    eng, got = serve(ours(path), batch, 16, kv_cache_memory_bytes=8 << 20)
    assert eng.backend.name == "triton" and eng.runner.graphs is not None
    assert got == reference(hf, path, batch, 16)


def test_chunked_prefill_and_preemption_on_the_device(models: tuple[Any, Path]) -> None:
    hf, path = models
    batch = prompts((50, 44, 38, 60), 5)
    eng, got = serve(ours(path), batch, 24, kv_cache_memory_bytes=21 * PAGE_BYTES, max_num_batched_tokens=24)
    assert eng.stats.preemptions > 0
    assert got == reference(hf, path, batch, 24)


def test_mamba_ssm_kernels_give_the_reference_tokens(models: tuple[Any, Path]) -> None:
    pytest.importorskip("mamba_ssm", reason="mamba-ssm is not installed here (pip install mamba-ssm causal-conv1d)")
    pytest.importorskip("causal_conv1d", reason="causal-conv1d is not installed here")
    _, path = models
    batch = prompts((70, 45, 9), 2)
    _, want = serve(ours(path, "torch"), batch, 16, max_num_batched_tokens=32)
    _, got = serve(ours(path, "mamba_ssm"), batch, 16, max_num_batched_tokens=32)
    assert got == want


def test_the_host_tier_brings_saved_states_back_on_the_device(models: tuple[Any, Path]) -> None:
    """tests/models/test_mamba_hybrid.py's conversations on the device: the tier's copies (a hybrid pool's pages,
    gathered by the Triton kernel, over the copy stream, loaded on the load stream) give the tokens of the run
    without it, and the saved states come back (the last turn hits its whole history)."""
    _, path = models
    plain = conversations(engine(ours(path), **TIER_POOL))
    eng = engine(ours(path), kv_offloading_size=0.001, **TIER_POOL)
    tiered = conversations(eng)
    assert [ids for _, ids, _ in tiered] == [ids for _, ids, _ in plain]
    assert [hit for *_, hit in tiered][-3:] == [112] * 3 and [hit for *_, hit in plain][-3:] == [0] * 3
    assert eng.host_pages is not None and eng.host_pages.loaded > 0 and eng.host_pages.stored > 0
