"""A hybrid model (sliding-window and full-attention layers) served from one pool against transformers.

The oracle is transformers' own Qwen3 (and Qwen2) with its own random initialisation (no hub, fp32, CPU),
``layer_types`` alternating sliding and full attention, a window of 24 tokens: prompts of 37 to 100 tokens
run past the window, so its group lets blocks go in the middle of a request.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the reference needs transformers (pip install -e '.[test]')")

from pagedkv.core.rules.kinds import GroupKind  # noqa: E402
from pagedkv.core.store.state import request_blocks  # noqa: E402
from pagedkv.models.gguf import LlamaConfig  # noqa: E402
from pagedkv.models.llama import IdTokenizer, Llama  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams

WINDOW = 24
VOCAB = 512
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def hf_model(kind: str) -> Any:
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=TYPES,
        max_window_layers=0,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        initializer_range=0.25,
    )
    torch.manual_seed(0)  # transformers' own init, seeded: wide enough that greedy tokens vary
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **common)).eval()
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    with torch.no_grad():  # Qwen2's q/k/v biases start at zero: give them values, so the test can see them
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.25)
    return model


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def models(request: pytest.FixtureRequest) -> tuple[Any, Llama]:
    hf = hf_model(request.param)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    return hf, Llama(LlamaConfig.from_hf_config(hf.config.to_dict()), sd)


def prompts(n: int, length: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(0, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def reference(hf: Any, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():  # the mask given: generate would take every pad_token_id in the prompt for padding
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=VOCAB - 1,
        )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def engine(model: Llama, **kw: Any) -> Engine:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    return Engine(model, IdTokenizer(), block_size=8, max_num_seqs=4, keep_history=True, **kw)


def test_the_plan_puts_each_layer_in_its_group(models: tuple[Any, Llama]) -> None:
    _, ours = models
    eng = engine(ours)
    kinds = [g.kind for g in eng.cache.groups]
    assert kinds == [GroupKind.FULL, GroupKind.SLIDING_WINDOW] and eng.cache.groups[1].window == WINDOW
    places = eng.layout.of(ours.layer_names)
    assert [p.group for p in places] == [1, 0, 1, 0]  # sliding layers in the window group
    assert [p.slot for p in places] == [0, 0, 1, 1]  # two page tensors, each shared by one layer of each group
    assert len(eng.pool.k) == 2 and eng.rank.plan.groups.layers_per_group == 2
    # the pool's bytes per block are the grouping plan's: 2 layer slots of K and V
    slot_bytes = 2 * ours.config.num_kv_heads * ours.config.head_dim * 4 * 8  # K and V, fp32, 8 tokens
    assert eng.sizing.page_bytes == 2 * slot_bytes == eng.rank.plan.groups.bytes_per_block


@pytest.mark.slow
def test_one_request_at_a_time_past_the_window(models: tuple[Any, Llama]) -> None:
    hf, ours = models
    for prompt in prompts(1, 100, 1) + prompts(1, 37, 2) + prompts(1, 60, 3):
        eng = engine(ours)
        (c,) = eng.generate([("p", prompt, SamplingParams(temperature=0.0, max_tokens=40))])
        assert c.token_ids == reference(hf, prompt, 40)
        # the window group let blocks go mid-request: at most window / block size + 1 held, the full group all
        held = [_held(kv, 1) for kv in eng.kv_history or []]
        full = [_held(kv, 0) for kv in eng.kv_history or []]
        assert max(held) <= WINDOW // 8 + 1 < max(full)
        assert eng.state.kv.free_blocks == eng.cache.usable_blocks  # and every block came back


def _held(kv: Any, group: int) -> int:
    return sum(sum(1 for b in row[group] if b) for rid in kv.requests.keys() for row in request_blocks(kv, rid))


@pytest.mark.slow
def test_batched_with_preemption_chunked_prefill_and_prefix_hits(models: tuple[Any, Llama]) -> None:
    """Three prompts share a 48-token prefix (two windows' worth), three do not; a pool too small for all six,
    prefill chunks of 32 tokens: each completion equals transformers' run of that prompt alone."""
    hf, ours = models
    shared = prompts(1, 48, 4)[0]
    batch = prompts(3, 20, 5, prefix=shared) + prompts(3, 50, 6)
    eng = engine(ours, kv_cache_memory_bytes=23 * 8192, max_num_batched_tokens=32)  # 22 usable blocks
    done = eng.generate([(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=30)) for i, p in enumerate(batch)])
    for p, c in zip(batch, done):
        assert c.token_ids == reference(hf, p, 30), c.request_id
    assert eng.stats.preemptions > 0
    assert max(c.cached_tokens for c in done[:3]) >= 40  # the shared prefix was a hit in the full group
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks


def test_a_hybrid_model_refuses_one_group() -> None:
    from pagedkv.core.config import GroupSpec, InvalidConfig
    from pagedkv.models.llama import random_llama

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        max_position=128,
        layer_types=tuple(TYPES[:2]),
        sliding_window=8,
    )
    model = random_llama(cfg)
    with pytest.raises(InvalidConfig, match="sliding-window layers"):
        model._attention(GroupSpec("full"))  # noqa: SLF001
    with pytest.raises(ValueError, match="positive sliding_window"):
        LlamaConfig(**{**_fields(cfg), "sliding_window": None})
    with pytest.raises(ValueError, match="not served"):
        LlamaConfig(**{**_fields(cfg), "layer_types": ("full_attention", "chunked_attention")})
    with pytest.raises(ValueError, match="model_type"):
        LlamaConfig.from_hf_config({"model_type": "gemma3", "vocab_size": 1})


def _fields(cfg: LlamaConfig) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


@pytest.mark.slow
def test_grow_prefill_serves_prompts_whose_whole_reservation_does_not_fit(
    models: tuple[Any, Llama], tmp_path: Any
) -> None:
    """A 32-block pool: a 150-token prompt reserved whole needs 22 blocks in each group (44) and is
    UNSCHEDULABLE; with grow_prefill its window group holds a window and a chunk (22 + 8), so it runs,
    preempting as chunks grow, and every completion is transformers'. Its trace replays digest for digest."""
    import io

    from pagedkv.core.verify.trace import replay

    hf, ours = models
    shared = prompts(1, 48, 4)[0]
    batch = prompts(2, 20, 5, prefix=shared) + prompts(2, 150, 6)
    outcome = {}
    block_bytes = 2 * 2 * ours.config.num_kv_heads * ours.config.head_dim * 4 * 8  # 2 slots of K and V, 8 tokens
    for grow in (False, True):
        trace = io.StringIO()
        eng = engine(
            ours, kv_cache_memory_bytes=33 * block_bytes, max_num_batched_tokens=32, grow_prefill=grow, trace=trace
        )
        done = eng.generate([(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=20)) for i, p in enumerate(batch)])
        eng.finish_trace()
        outcome[grow] = [str(c.finish_reason) for c in done]
        if grow:
            for p, c in zip(batch, done):
                assert c.token_ids == reference(hf, p, 20), c.request_id
            assert eng.stats.preemptions > 0 and done[1].cached_tokens >= 40
            lines = trace.getvalue().splitlines()
            assert '"grow_prefill": true' in lines[0]
            assert all(ev.divergence is None for ev in replay(lines))
    assert outcome[False] == ["length", "length", "UNSCHEDULABLE", "UNSCHEDULABLE"]
    assert outcome[True] == ["length"] * 4


@pytest.mark.slow
def test_the_host_tier_serves_a_hybrid_model(models: tuple[Any, Llama]) -> None:
    """Issue 66: three conversations of five turns (each turn's prompt its whole history, 40 to about 150 tokens)
    in a pool of 39 blocks that cannot keep them all: with a host tier, the window group's visible blocks and the
    full group's come back from it on a hit. Every answer equals transformers' run of its prompt alone, with the
    tier and without it, and the tier more than doubles the prefix hit rate (0.14 -> 0.74, measured)."""
    hf, ours = models
    page = 2 * 2 * ours.config.num_kv_heads * ours.config.head_dim * 4 * 8  # (two layer slots of K and V, fp32)

    def conversations(gib: float | None) -> tuple[list[tuple[list[int], list[int]]], Engine]:
        eng = engine(ours, kv_cache_memory_bytes=40 * page, kv_offloading_size=gib, max_num_batched_tokens=64)
        history, out = prompts(3, 40, 11), []
        for turn in range(5):
            asks = [(f"c{i}t{turn}", h, SamplingParams(temperature=0.0, max_tokens=12)) for i, h in enumerate(history)]
            for i, done in enumerate(eng.generate(asks)):
                out.append((history[i], done.token_ids))
                history[i] = history[i] + list(done.token_ids) + prompts(1, 16, 100 + 10 * turn + i)[0]
        return out, eng

    plain, without = conversations(None)
    tiered, tier = conversations(0.003)
    assert [ids for _, ids in tiered] == [ids for _, ids in plain]
    for prompt, ids in tiered:
        assert ids == reference(hf, prompt, 12)
    pages = tier.host_pages
    assert pages is not None and pages.loaded > 0
    assert tier.state.kv.prefix_hit_rate >= 2 * without.state.kv.prefix_hit_rate > 0
