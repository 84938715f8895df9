"""The core's block hashes byte for byte as every hash kind vLLM offers (``prefix_caching_hash_algo``): the
xxhash kinds need the xxhash package, which vLLM installs, so they run in CI's vLLM environment (a skip there is
a failure) and skip elsewhere with the reason."""

from __future__ import annotations

import pytest

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, commit, hash_block, initial_state, root_hash

KEYS = (("lora", "ad", "/p"), ("mm", "img", -1), ("cache_salt", "s"))
VLLM_HASHES = {  # algo: (block [1..4], block [5..8] after it, block [1..4] with KEYS), each from NONE_HASH
    "sha256": (
        "52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a",
        "bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde",
        "e08eabff71505439410e1a0707db921cd431070eaf7edb0d62f683b5d25d92e4",
    ),
    "sha256_cbor": (
        "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
        "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1",
        "94aa62868572b019848ae9e77d1f73373723395c321873772859afb5f460955c",
    ),
    "xxhash": (
        "70410442fe39dc79de6e69e5d3153abe",
        "7061a0ef4dbdfbd3395c4d47235a72fd",
        "a271894e48d92cc086a87705cb94be5b",
    ),
    "xxhash_cbor": (
        "47d46a11b8224574dbb8a1b02b1374b7",
        "67e530479fcb10185401db165c03c9ac",
        "da3d40941548874f287b6446aa08cc22",
    ),
}


@pytest.mark.parametrize("algo", sorted(VLLM_HASHES))
def test_every_hash_kind_vllm_offers_is_byte_equal_to_vllms(algo: str) -> None:
    """Values computed with vLLM 0.33's ``get_hash_fn_by_name(algo)`` and ``hash_block_tokens`` (NONE_HASH from
    the seed "vllm-none-hash"), extra keys as vLLM builds them (a LoRA adapter, a multimodal input starting
    one token before the block, a cache salt)."""
    if algo.startswith("xxhash"):
        pytest.importorskip("xxhash", reason="the xxhash kinds need the xxhash package (vLLM installs it)")
    root = root_hash("vllm-none-hash", algo)
    first = hash_block(root, [1, 2, 3, 4], (), algo)
    assert (
        first.hex(),
        hash_block(first, [5, 6, 7, 8], (), algo).hex(),
        hash_block(root, [1, 2, 3, 4], KEYS, algo).hex(),
    ) == VLLM_HASHES[algo]
    cfg = CacheConfig(
        block_size=4, num_blocks=9, enable_prefix_caching=True, block_hash=algo, hash_namespace="vllm-none-hash"
    )
    spec = RequestSpec(
        "a",
        (RowSpec.of_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9]),),
        (KEYS[0],),
        content=(("img", 3, 2),),
        first_block_keys=(KEYS[2],),
    )
    step = commit(admit(initial_state(cfg), spec).unwrap().state, "a", [9]).unwrap()
    block0 = (KEYS[0], ("mm", "img", 3), KEYS[2])  # the adapter, the input from its offset 3, the salt
    assert [ev.extra_keys for ev in step.effect.events] == [block0, (KEYS[0], ("mm", "img", -1))]
    assert step.effect.events[0].block_hash == hash_block(root, [1, 2, 3, 4], block0, algo)
