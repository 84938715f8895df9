"""Block hashes a caller already computed (vLLM's ``request.block_hashes``): the core takes them instead of hashing
again (``RequestSpec.block_hashes`` at the lookup and admission, ``cache_ahead_many(hashes=...)``), the same state
digest for digest; with ``check_given_hashes`` a wrong one is refused with ``INVALID`` and nothing changes."""

from __future__ import annotations

from dataclasses import replace

from pagedkv.core import (
    CacheConfig,
    ErrorCode,
    KVState,
    RequestSpec,
    RowSpec,
    admit,
    cache_ahead_many,
    digest,
    initial_state,
    release,
)
from pagedkv.core.rules.prefix import find_hit

PROMPT = list(range(100, 137))  # 9 full blocks of 4, and one token


def _config(check: bool = False) -> CacheConfig:
    return CacheConfig(
        block_size=4,
        num_blocks=64,
        enable_prefix_caching=True,
        caching_point="schedule",
        block_hash="sha256_cbor",
        check_given_hashes=check,
    )


def _cached(cfg: CacheConfig, rid: str = "a", hashes: dict[str, tuple[bytes, ...]] | None = None) -> KVState:
    s = admit(initial_state(cfg), RequestSpec(rid, (RowSpec.of_tokens(PROMPT),))).unwrap().state
    return cache_ahead_many(s, [(rid, [len(PROMPT)])], hashes=hashes).unwrap().state


def _hashes(s: KVState) -> tuple[bytes, ...]:
    row = s.rows[s.requests["a"].slots[0]]
    return tuple(row.hash_at(j) for j in range(row.num_hashed))


def test_given_hashes_give_the_state_the_core_computes() -> None:
    for check in (False, True):
        own = _cached(_config(check))
        given = _cached(_config(check), hashes={"a": _hashes(own)})
        assert digest(given) == digest(own) and len(_hashes(own)) == 9
        # the lookup and the admission of a second request that shares the prompt, hashes given
        done = release(own, "a", "finished").unwrap().state
        spec = RequestSpec("b", (RowSpec.of_tokens(PROMPT),))
        with_given = replace(spec, block_hashes=_hashes(own))
        assert find_hit(done, with_given).num_blocks == find_hit(done, spec).num_blocks == 9
        assert digest(admit(done, with_given).unwrap().state) == digest(admit(done, spec).unwrap().state)


def test_a_wrong_hash_is_taken_unchecked_and_refused_checked() -> None:
    own = _cached(_config())
    wrong = (b"\x00" * 32,) + _hashes(own)[1:]
    trusted = _cached(_config(), hashes={"a": wrong})
    assert _hashes(trusted)[0] == wrong[0]  # (unchecked, the caller's word is taken: its hashes are the chain)
    s = admit(initial_state(_config(True)), RequestSpec("a", (RowSpec.of_tokens(PROMPT),))).unwrap().state
    refused = cache_ahead_many(s, [("a", [len(PROMPT)])], hashes={"a": wrong}).failure()
    assert refused.code is ErrorCode.INVALID and "block_hashes[0] is not the hash of block 0" in refused.message
    done = release(own, "a", "finished").unwrap().state
    checked = replace(done, config=_config(True))
    spec = RequestSpec("b", (RowSpec.of_tokens(PROMPT),), block_hashes=wrong)
    assert admit(checked, spec).failure().code is ErrorCode.INVALID


def test_malformed_given_hashes_are_invalid_and_change_nothing() -> None:
    s = initial_state(_config())
    row = RowSpec.of_tokens(PROMPT)
    for spec, says in (
        (RequestSpec("a", (row,), block_hashes=[b"x" * 32]), "a tuple of bytes"),  # type: ignore[arg-type]
        (RequestSpec("a", (row,), block_hashes=(b"short",)), "32-byte hashes"),
        (RequestSpec("a", (row, row), block_hashes=(b"x" * 32,)), "a single row's"),
    ):
        err = admit(s, spec).failure()
        assert err.code is ErrorCode.INVALID and says in err.message and err.field == "block_hashes"
    s = admit(s, RequestSpec("a", (row,))).unwrap().state
    for hashes in ({"a": (b"short",)}, {"a": "abc"}, ["a"]):
        err = cache_ahead_many(s, [("a", [len(PROMPT)])], hashes=hashes).failure()  # type: ignore[arg-type]
        assert err.code is ErrorCode.INVALID
    assert digest(s) == digest(admit(initial_state(_config()), RequestSpec("a", (row,))).unwrap().state)
