"""Latent (MLA) pages vs plain K/V pages for the same tokens: bytes per token and tokens per pool.

Plain K/V stores K and V per KV head (2 x kv_heads x head_dim values a token); MLA stores one
latent vector (kv_lora_rank + rope dim). The ratio is latent_dim / (2 x kv_heads x head_dim).

    python bench/mla_pages.py
"""

from __future__ import annotations

from pagedkv.core.grouping import LayerKind, LayerSpec, num_blocks_for_budget, plan_groups

BUDGET = 16 << 30  # 16 GiB of KV per rank
MODELS = [
    # (name, layers, latent_dim, kv_heads and head_dim of the plain K/V layout it replaces)
    ("DeepSeek-V2 (MLA 512+64 vs MHA 128x128)", 60, 576, 128, 128),
    ("DeepSeek-V2-Lite (512+64 vs 16x128)", 27, 576, 16, 128),
    ("pagedkv's MLA reference (16+4 vs 4x8)", 2, 20, 4, 8),
]


def main() -> None:
    print(f"bf16, block size 16, a {BUDGET >> 30} GiB budget per rank; baseline: plain K/V pages for the same model")
    print(f"{'model':<42} {'MLA B/token':>12} {'K/V B/token':>12} {'ratio':>7} {'MLA tokens':>12} {'K/V tokens':>12}")
    for name, layers, latent, kv_heads, head_dim in MODELS:
        mla = plan_groups([LayerSpec(f"l{i}", LayerKind.MLA, latent_dim=latent) for i in range(layers)], 16)
        kv = plan_groups([LayerSpec(f"l{i}", kv_heads=kv_heads, head_dim=head_dim) for i in range(layers)], 16)
        mla_tokens = (num_blocks_for_budget(BUDGET, mla) - 1) * 16
        kv_tokens = (num_blocks_for_budget(BUDGET, kv) - 1) * 16
        b_mla, b_kv = mla.bytes_per_block // 16, kv.bytes_per_block // 16
        print(f"{name:<42} {b_mla:>12} {b_kv:>12} {b_mla / b_kv:>7.4f} {mla_tokens:>12} {kv_tokens:>12}")


if __name__ == "__main__":
    main()
