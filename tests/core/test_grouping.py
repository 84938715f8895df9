"""Grouping layers into KV cache groups, and sizing the pool from a byte budget."""

import pytest

from pagedkv.core import RequestSpec, RowSpec, admit, commit, initial_state, request_blocks
from pagedkv.core.config import InvalidConfig
from pagedkv.core.grouping import LayerKind, LayerSpec, num_blocks_for_budget, plan_groups


def swa(i: int, window: int = 128) -> LayerSpec:
    return LayerSpec(f"swa{i}", LayerKind.SLIDING_WINDOW, kv_heads=8, head_dim=128, window=window)


def full(i: int) -> LayerSpec:
    return LayerSpec(f"full{i}", kv_heads=8, head_dim=128)


def test_52_window_and_10_full_layers_make_groups_of_10_the_last_padded() -> None:
    plan = plan_groups([swa(i) for i in range(52)] + [full(i) for i in range(10)], 16)
    assert plan.layers_per_group == 10
    assert [(g.kind.value, len(g.layers)) for g in plan.groups] == [("full", 10)] + [("sliding_window", 10)] * 5 + [
        ("sliding_window", 2)
    ]
    assert plan.padding_slots == 8
    assert plan.waste_fraction == pytest.approx(8 / 70)
    assert plan.page_bytes == 16 * 2 * 8 * 128 * 2  # 64 KiB: K and V, bf16
    assert plan.bytes_per_block == 10 * plan.page_bytes
    cfg = plan.cache_config(num_blocks_for_budget(1 << 30, plan))
    assert cfg.num_blocks == (1 << 30) // (10 * 65536) and len(cfg.groups) == 7


def test_a_uniform_model_is_one_group_and_sizing_matches_smollm2() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32 on the CPU
    plan = plan_groups([LayerSpec(f"l{i}", kv_heads=3, head_dim=64, dtype_bytes=4) for i in range(30)], 16)
    assert len(plan.groups) == 1 and plan.layers_per_group == 30 and plan.waste_fraction == 0
    assert num_blocks_for_budget(1 << 30, plan) == (1 << 30) // (30 * 16 * 2 * 3 * 64 * 4)


def test_kv_sharing_layers_get_no_blocks() -> None:
    layers = [full(i) for i in range(4)] + [LayerSpec("x", kv_heads=8, head_dim=128, kv_sharing_target="full1")]
    plan = plan_groups(layers, 16)
    assert plan.shared == (("x", "full1"),)
    assert [g.layers for g in plan.groups] == [("full0", "full1", "full2", "full3")]
    with pytest.raises(InvalidConfig, match="shares KV"):
        plan_groups([full(0), LayerSpec("y", kv_sharing_target="nope")], 16)


def test_state_layers_raise_the_attention_block_size() -> None:
    layers = [full(i) for i in range(2)] + [LayerSpec(f"m{i}", LayerKind.MAMBA, state_bytes=300_000) for i in range(6)]
    plan = plan_groups(layers, 16)
    # 4096 bytes per token: 64 tokens hold 262144 < 300000, 80 tokens hold 327680
    assert plan.block_size == 80 and plan.page_bytes == 327_680 and plan.state_padding_bytes == 27_680
    assert plan.layers_per_group == 2 and sum(g.kind is LayerKind.MAMBA for g in plan.groups) == 3
    cfg = plan.cache_config(100)  # the core allocates the state groups: one block a row in each
    assert [g.kind.value for g in cfg.groups] == ["full", "mamba", "mamba", "mamba"] and cfg.block_size == 80
    s = admit(initial_state(cfg), RequestSpec("a", (RowSpec(200),))).unwrap().state
    assert cfg.usable_blocks - s.free_blocks == 3 + 3  # 3 blocks of 80 tokens, 3 states


def test_refusals() -> None:
    with pytest.raises(InvalidConfig, match="do not divide"):
        plan_groups([full(0), LayerSpec("odd", kv_heads=1, head_dim=96)], 16)  # 4096 and 384 bytes per token
    with pytest.raises(InvalidConfig, match="at least 2"):
        num_blocks_for_budget(100, plan_groups([full(0)], 16))
    with pytest.raises(InvalidConfig, match="unique"):
        plan_groups([full(0), full(0)], 16)


def test_a_planned_hybrid_pool_runs_in_the_core() -> None:
    plan = plan_groups([swa(i, window=32) for i in range(4)] + [full(i) for i in range(4)], 16)
    s = initial_state(plan.cache_config(40))
    s = admit(s, RequestSpec("a", (RowSpec(112),))).unwrap().state
    s = commit(s, "a", [112]).unwrap().state
    full_ids, swa_ids = request_blocks(s, "a")[0]
    assert sum(map(bool, full_ids)) == 7 and sum(map(bool, swa_ids)) == 2


def test_mla_pages_unify_beside_plain_kv_pages() -> None:
    """An MLA layer's page holds (block_size, latent_dim); beside K/V pages its block takes more tokens."""
    mla = [LayerSpec(f"mla{i}", LayerKind.MLA, latent_dim=512 + 64) for i in range(4)]  # DeepSeek-V2: 576, bf16
    plan = plan_groups(mla, 16)
    assert plan.page_bytes == 16 * 576 * 2 and plan.groups[0].block_size == 16
    mixed = plan_groups(mla + [LayerSpec(f"full{i}", kv_heads=1, head_dim=576) for i in range(4)], 16)
    # K/V: 2 * 576 * 2 = 2304 bytes per token, MLA 1152: the MLA group takes 32 tokens per block, one page size
    assert [(g.kind.value, g.block_size) for g in mixed.groups] == [("mla", 32), ("full", 16)]
    assert mixed.page_bytes == 16 * 2304
    with pytest.raises(InvalidConfig, match="one block size"):
        mixed.cache_config(100)
