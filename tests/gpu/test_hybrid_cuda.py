"""The hybrid model (sliding-window and full layers from one pool) on a CUDA device, through the engine's
defaults there: the triton backend and CUDA-graph decode. Against transformers' own Qwen3 on the same
device (fp32, TF32 off), and against the torch reference backend, eager, batched with preemption,
chunked prefill and prefix hits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.cuda

pytest.importorskip("transformers", reason="the reference needs transformers")

from pagedkv.models.gguf import LlamaConfig  # noqa: E402
from pagedkv.models.llama import IdTokenizer, Llama  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams
from tests.models.test_hybrid import WINDOW, hf_model, prompts  # noqa: E402


@pytest.fixture(scope="module")
def models() -> tuple[Any, Llama]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = hf_model("qwen3").to("cuda")
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    return hf, Llama(LlamaConfig.from_hf_config(hf.config.to_dict()), sd, device="cuda")


def reference(hf: Any, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=511,
        )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def engine(model: Llama, **kw: Any) -> Engine:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    return Engine(model, IdTokenizer(), block_size=16, max_num_seqs=4, **kw)


def test_the_defaults_on_cuda_run_the_hybrid_model_as_transformers_does(models: tuple[Any, Llama]) -> None:
    hf, ours = models
    eng = engine(ours)
    assert eng.backend.name == "triton" and eng.runner.graphs is not None  # the engine's defaults on CUDA
    assert [g.kind.value for g in eng.cache.groups] == ["full", "sliding_window"] and eng.cache.groups[
        1
    ].window == WINDOW
    for prompt in prompts(1, 100, 1) + prompts(1, 37, 2):
        eng = engine(ours)
        (c,) = eng.generate([("p", prompt, SamplingParams(temperature=0.0, max_tokens=40))])
        assert c.token_ids == reference(hf, prompt, 40)
        assert eng.runner.graphs is not None and eng.runner.graphs.replays > 0  # decode ran from the graphs


def test_triton_and_graphs_equal_the_reference_batched_with_preemption_and_hits(models: tuple[Any, Llama]) -> None:
    _, ours = models
    shared = prompts(1, 48, 4)[0]
    batch = prompts(3, 20, 5, prefix=shared) + prompts(3, 50, 6)
    runs = []
    for kw in ({}, {"backend": "torch", "cuda_graphs": False}):
        eng = engine(ours, kv_cache_memory_bytes=21 * 16384, max_num_batched_tokens=32, **kw)  # 20 blocks of 16
        done = eng.generate([(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=30)) for i, p in enumerate(batch)])
        runs.append(([c.token_ids for c in done], eng.stats.preemptions, [c.cached_tokens for c in done]))
    (fast, pre, cached), (ref, _, _) = runs
    assert fast == ref
    assert pre > 0 and max(cached[:3]) >= 32
