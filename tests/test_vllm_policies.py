"""vLLM's block-pool policies as options of the core (CacheConfig.free_queue, reset_prefix_cache), off by
default: freed blocks without a hash go to the head of the free queue (reused first, vLLM's prepend_n),
and reset_prefix_cache is refused while any block is held. Pinned on examples, replayed from trace
headers; the model checker and the caching state machine explore both."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main
from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, commit, digest, initial_state, release
from pagedkv.core import free_queue, reset_prefix_cache
from pagedkv.core.config import InvalidConfig
from pagedkv.core.errors import ErrorCode
from pagedkv.core.verify.alphabet import CheckConfig
from pagedkv.core.verify.check import check
from pagedkv.core.verify.trace import replay


def run(policy: str) -> list[int]:
    """Admit 10 tokens (blocks 1, 2, 3), compute 8 (blocks 1 and 2 hashed), release: the free queue."""
    s = initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True, free_queue=policy))
    s = admit(s, RequestSpec("a", (RowSpec.of_tokens(list(range(10))),))).unwrap().state
    s = commit(s, "a", [8]).unwrap().state
    return free_queue(release(s, "a", "finished").unwrap().state)


def test_freed_blocks_without_a_hash_go_to_the_head_under_vllm() -> None:
    assert run("tail") == [4, 5, 6, 7, 8, 3, 2, 1]  # pagedkv's default: all to the tail, tail first
    assert run("vllm") == [3, 4, 5, 6, 7, 8, 2, 1]  # block 3 (no hash) first, the hashed ones last
    s = initial_state(CacheConfig(block_size=4, num_blocks=9, free_queue="vllm"))  # no caching: all to the head
    s = admit(s, RequestSpec("a", (RowSpec(10),))).unwrap().state
    assert free_queue(release(s, "a", "finished").unwrap().state) == [3, 2, 1, 4, 5, 6, 7, 8]


def test_reset_prefix_cache_when_idle_waits_for_the_blocks() -> None:
    cfg = CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True, reset_prefix_cache="when_idle")
    s = admit(initial_state(cfg), RequestSpec("a", (RowSpec.of_tokens(list(range(8))),))).unwrap().state
    s = commit(s, "a", [8]).unwrap().state
    before = digest(s)
    err = reset_prefix_cache(s).failure()
    assert err.code is ErrorCode.BLOCKS_IN_USE and not err.permanent and "2 are" in err.message
    assert digest(s) == before
    s = release(s, "a", "finished").unwrap().state
    assert reset_prefix_cache(s).unwrap().effect.dropped == 2
    always = admit(initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True)),
                   RequestSpec("a", (RowSpec.of_tokens(list(range(8))),))).unwrap().state  # fmt: skip
    assert reset_prefix_cache(always).unwrap().state.requests  # the default: works while requests run


def test_policies_are_checked_and_come_from_the_trace_header(tmp_path: object) -> None:
    with pytest.raises(InvalidConfig, match="free_queue must be one of 'tail', 'vllm'"):
        CacheConfig(block_size=4, num_blocks=9, free_queue="lifo")
    with pytest.raises(InvalidConfig, match="reset_prefix_cache"):
        CacheConfig(block_size=4, num_blocks=9, reset_prefix_cache=True)  # type: ignore[arg-type]
    header = {"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "enable_prefix_caching": True,
                                             "free_queue": "vllm", "reset_prefix_cache": "when_idle"}}
    lines = [header, {"op": "admit", "request": "a", "rows": [{"tokens": list(range(10))}]},
             {"op": "commit", "request": "a", "computed": [8]},
             {"op": "reset_prefix_cache", "expect": {"ok": False, "error": {"code": "BLOCKS_IN_USE"}}},
             {"op": "release", "request": "a", "reason": "finished"},
             {"op": "admit", "request": "b", "rows": [{"num_tokens": 1}], "expect": {"blocks": [[[3]]]}}]
    results = list(replay([json.dumps(x) for x in lines], check=True))
    assert all(r.divergence is None and not r.violations for r in results), [r.divergence for r in results]
    from pathlib import Path

    bad = Path(str(tmp_path)) / "bad.jsonl"
    bad.write_text(json.dumps({"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "free_queue": 1}}))
    assert main(["replay", str(bad)]) == 2


@pytest.mark.parametrize("cfg", [CheckConfig(usable_blocks=5, requests=2, free_queue="vllm"),
                                 CheckConfig(usable_blocks=5, requests=2, reset_when_idle=True)])  # fmt: skip
def test_the_checker_explores_each_policy(cfg: CheckConfig) -> None:
    result = check(cfg)
    assert result.exhaustive and not result.violation
    default = check(CheckConfig(usable_blocks=5, requests=2))
    assert result.states != default.states  # another state space, not the default's again
