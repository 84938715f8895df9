"""Mamba2 + attention hybrids served from their own checkpoints (issue 34): transformers' random-init Bamba and
GraniteMoeHybrid (its pure-torch Mamba2 path; granite with experts, multipliers and RoPE), saved with
``save_pretrained``, give transformers' greedy tokens through the engine: batched and alone, prompts over several
blocks, prefill in chunks (the state carried from chunk to chunk), a prefix hit that takes a saved state over,
preemption by recompute in a pool too small for the batch, and a host tier that brings saved states back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the reference needs transformers (pip install -e '.[test]')")

from pagedkv.core.config import InvalidConfig  # noqa: E402
from pagedkv.core.rules.kinds import GroupKind
from pagedkv.models.hf import load_model  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams  # noqa: E402
from tests.models.test_hf_checkpoints import VOCAB, save_tokenizer  # noqa: E402

BLOCK = 16
PAGE_BYTES = 2 * BLOCK * 2 * 32 * 4  # a block's page: K and V of 16 tokens, 2 KV heads of 32, fp32


def hf_model(kind: str) -> Any:
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        mamba_expand=2,
        max_position_embeddings=512,
        initializer_range=0.25,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    if kind == "bamba":  # RoPE on half of each head, attention at layer 1
        model = transformers.BambaForCausalLM(
            transformers.BambaConfig(intermediate_size=96, attn_layer_indices=[1], tie_word_embeddings=False, **common)
        )
    else:  # experts beside the shared MLP, every multiplier away from 1
        cfg = transformers.GraniteMoeHybridConfig(
            intermediate_size=32,
            shared_intermediate_size=48,
            num_local_experts=4,
            layer_types=["mamba", "attention", "mamba", "mamba"],
            num_experts_per_tok=2,
            position_embedding_type="rope",
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.0,
            **common,
        )
        model = transformers.GraniteMoeHybridForCausalLM(cfg)
    with torch.no_grad():  # A, dt's bias and D start at values that hide mistakes (1, 1, 1): give them others
        for name, p in model.named_parameters():
            if "A_log" in name:
                p.uniform_(-1, 1)
            elif "dt_bias" in name:
                p.normal_(0, 0.5)
            elif name.endswith(".D"):
                p.normal_(0, 1)
    return model.eval()


@pytest.fixture(scope="module", params=["bamba", "granite"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any, Path]:
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    save_tokenizer(path)
    model, tok, _ = load_model(str(path))
    return hf, model, tok, path


def reference(hf: Any, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def engine(model: Any, tok: Any, **kw: Any) -> Engine:
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    return Engine(model, tok, block_size=BLOCK, max_num_seqs=4, **kw)


def test_the_plan_gives_attention_a_group_and_each_mamba_layer_a_state_group(checkpoint: tuple[Any, ...]) -> None:
    _, model, tok, _ = checkpoint
    eng = engine(model, tok)
    assert [g.kind for g in eng.cache.groups] == [GroupKind.FULL] + [GroupKind.MAMBA] * 3
    assert [p.group for p in eng.layout.of(model.layer_names)] == [1, 0, 2, 3]
    pool, state = eng.pool, model.state_shape
    # a state lives in the same pages as K and V (one buffer a slot): a block is either
    assert pool.conv[0].untyped_storage().data_ptr() == pool.k[0].untyped_storage().data_ptr()
    assert pool.conv[0].shape[1:] == state.conv == (128 + 2 * 2 * 8, 3) and pool.ssm[0].shape[1:] == (4, 32, 8)
    page = 2 * BLOCK * 2 * 32  # K and V of 16 tokens, 2 KV heads of 32
    assert state.elements <= page and pool.bytes == eng.cache.num_blocks * page * 4 == eng.sizing.total_bytes
    pool.ssm[0][5].fill_(1.0)  # block 5's state is block 5's page: its K half and V half hold it
    assert pool.k[0][5].abs().sum() + pool.v[0][5].abs().sum() == state.ssm[0] * state.ssm[1] * state.ssm[2]


def test_greedy_tokens_equal_transformers_batched_and_alone(checkpoint: tuple[Any, ...]) -> None:
    hf, model, tok, _ = checkpoint
    batch = prompts((70, 45, 9), 1)
    want = [reference(hf, p, 12) for p in batch]
    got = engine(model, tok).generate([("", p, SamplingParams(temperature=0.0, max_tokens=12)) for p in batch])
    assert [c.token_ids for c in got] == want
    assert any(len(set(w)) > 4 for w in want)
    for p, w in zip(batch, want):
        (c,) = engine(model, tok).generate([("", p, SamplingParams(temperature=0.0, max_tokens=12))])
        assert c.token_ids == w


def test_chunked_prefill_carries_the_state_across_chunks(checkpoint: tuple[Any, ...]) -> None:
    hf, model, tok, _ = checkpoint
    batch = prompts((70, 45), 2)
    eng = engine(model, tok, max_num_batched_tokens=24)  # 70 tokens in chunks of at most 24
    got = eng.generate([("", p, SamplingParams(temperature=0.0, max_tokens=8)) for p in batch])
    assert [c.token_ids for c in got] == [reference(hf, p, 8) for p in batch]


def test_a_prefix_hit_takes_the_saved_state_over(checkpoint: tuple[Any, ...]) -> None:
    """A request that ends with 48 tokens computed (3 blocks) saves its state there; a longer prompt of the same 48
    tokens hits all 3 blocks and starts from that state. One that ends at 47 saves none: no hit at all, though
    its first 2 attention blocks are cached."""
    hf, model, tok, _ = checkpoint
    (first,) = prompts((40,), 3)
    eng = engine(model, tok)
    (a,) = eng.generate([("a", first, SamplingParams(temperature=0.0, max_tokens=9))])  # computes 40 + 8 = 48 tokens
    (more,) = prompts((10,), 4)
    longer = first + a.token_ids[:8] + more
    (b,) = eng.generate([("b", longer, SamplingParams(temperature=0.0, max_tokens=6))])
    assert b.cached_tokens == 48 and b.token_ids == reference(hf, longer, 6)
    eng = engine(model, tok)
    eng.generate(
        [("a", first, SamplingParams(temperature=0.0, max_tokens=8))]
    )  # 47 computed: no state at a block's end
    (c,) = eng.generate([("c", longer, SamplingParams(temperature=0.0, max_tokens=6))])
    assert c.cached_tokens == 0 and c.token_ids == b.token_ids


def test_preemption_by_recompute_in_a_small_pool(checkpoint: tuple[Any, ...]) -> None:
    hf, model, tok, _ = checkpoint
    batch = prompts((50, 44, 38, 60), 5)
    # 20 usable blocks: each request holds its attention blocks and 3 state blocks, 4 of them do not fit
    eng = engine(model, tok, kv_cache_memory_bytes=21 * PAGE_BYTES, max_num_batched_tokens=64)
    got = eng.generate([(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=24)) for i, p in enumerate(batch)])
    assert eng.stats.preemptions > 0
    assert [c.token_ids for c in got] == [reference(hf, p, 24) for p in batch]
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks


# a pool of 24 usable blocks, prompts in chunks of 64
TIER_POOL: dict[str, Any] = dict(kv_cache_memory_bytes=25 * PAGE_BYTES, max_num_batched_tokens=64)


def conversations(eng: Engine) -> list[tuple[list[int], list[int], int]]:
    """Three conversations of four turns through ``eng``, each turn's prompt its history (40 tokens, then each
    answer's 8 computed tokens and 24 new ones: a turn ends on a block's end, where its state is saved); per
    request (prompt, answer, cached tokens)."""
    history, out = prompts((40, 40, 40), 11), []
    for turn in range(4):
        asks = [(f"c{i}t{turn}", h, SamplingParams(temperature=0.0, max_tokens=9)) for i, h in enumerate(history)]
        for i, done in enumerate(eng.generate(asks)):
            out.append((history[i], done.token_ids, done.cached_tokens))
            history[i] = history[i] + list(done.token_ids[:8]) + prompts((24,), 100 + 10 * turn + i)[0]
    return out


def test_the_host_tier_brings_saved_states_back(checkpoint: tuple[Any, ...]) -> None:
    """Issue 66: three conversations of four turns (each turn's prompt its history, 40 to 136 tokens, each ending
    where a block ends once 8 answer tokens are computed: a state is saved there) in a pool of 24 blocks that cannot
    keep them all. With a host tier an evicted saved state (and the attention blocks before it) is kept and a hit
    loads it into a fresh state block: every answer equals transformers' run of its prompt alone, with the tier and
    without it, and the tier more than triples the prefix hit rate (0.21 -> 0.68, measured: the last turn hits all
    112 tokens of its history instead of none)."""
    hf, model, tok, _ = checkpoint
    without, tier = engine(model, tok, **TIER_POOL), engine(model, tok, kv_offloading_size=0.001, **TIER_POOL)
    plain, tiered = conversations(without), conversations(tier)
    assert [ids for _, ids, _ in tiered] == [ids for _, ids, _ in plain]
    for prompt, ids, _ in tiered:
        assert ids == reference(hf, prompt, 9)
    assert [hit for *_, hit in tiered][-3:] == [112] * 3 and [hit for *_, hit in plain][-3:] == [0] * 3
    pages = tier.host_pages
    assert pages is not None and pages.loaded > 0
    assert tier.state.kv.prefix_hit_rate >= 3 * without.state.kv.prefix_hit_rate > 0


def test_generate_serves_the_directory(checkpoint: tuple[Any, ...], capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.app.cli import main

    hf, _, _, path = checkpoint
    assert (
        main(["generate", "--model", str(path), "--chat", "What is 2+2?", "--max-tokens", "5", "--threads", "1"]) == 0
    )
    assert f"{path.name} ({type(hf).__name__})" in capsys.readouterr().out


def test_speculation_and_fp8_pages_are_refused_with_the_reason(
    checkpoint: tuple[Any, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedkv.app.cli import main

    _, model, tok, path = checkpoint
    with pytest.raises(InvalidConfig, match="Mamba states"):
        engine(model, tok, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(InvalidConfig, match="fp8 pages beside Mamba states"):
        engine(model, tok, kv_cache_dtype="fp8")
    assert main(["generate", "--model", str(path), "--kv-cache-dtype", "fp8", "hi"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "fp8 pages beside Mamba states are not served" in line
