"""``CacheConfig(kv_events=False)``: the same states, no KV cache events (vLLM's ``enable_kv_cache_events``)."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from pagedkv.core import (
    CacheConfig,
    InvalidConfig,
    KVState,
    RequestSpec,
    RowSpec,
    admit,
    decode_step,
    digest,
    initial_state,
    release_many,
    reset_prefix_cache,
)
from pagedkv.core.verify.record import policy_keys
from pagedkv.core.verify.trace import parse_trace_header

CONFIG = CacheConfig(block_size=4, num_blocks=24, enable_prefix_caching=True, free_queue="vllm", cache_duplicates=True)


def _run(cfg: CacheConfig, seed: int) -> list[tuple[str, tuple[Any, ...]]]:
    """A pool under pressure (prefix hits, blocks filling, evictions, releases, a cache reset): each step's
    digest and the events its effect reports."""
    rng = random.Random(seed)
    state: KVState = initial_state(cfg)
    prefix = [rng.randrange(50) for _ in range(6)]
    running: list[int] = []
    out: list[tuple[str, tuple[Any, ...]]] = []
    for i in range(60):
        if len(running) < 4:
            prompt = (prefix if rng.random() < 0.6 else []) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            got = admit(state, RequestSpec(i, (RowSpec.of_tokens(prompt),)))
            if got.value_or(None) is not None:
                state = got.unwrap().state
                running.append(i)
                out.append((digest(state), got.unwrap().effect.events))
        step = decode_step(state, running, [rng.randrange(50) for _ in running])
        if step.value_or(None) is None or rng.random() < 0.2:
            done = running[: 1 + rng.randrange(len(running))]
            released = release_many(state, done, "finished").unwrap()
            state, running = released.state, [r for r in running if r not in done]
            out.append((digest(state), ()))
            continue
        state = step.unwrap().state
        out.append((digest(state), step.unwrap().effect.events))
        if i == 40:
            cleared = reset_prefix_cache(state).unwrap()
            state = cleared.state
            out.append((digest(state), cleared.effect.events))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_without_events_the_states_are_the_same_and_no_event_is_reported(seed: int) -> None:
    on, off = _run(CONFIG, seed), _run(replace(CONFIG, kv_events=False), seed)
    assert [d for d, _ in on] == [d for d, _ in off]
    assert sum(len(e) for _, e in on) > 20  # stores, evictions and the reset are there to report
    assert all(e == () for _, e in off)


def test_the_trace_header_carries_it_only_when_off() -> None:
    assert "kv_events" not in policy_keys(CONFIG)
    assert policy_keys(replace(CONFIG, kv_events=False)) == {
        "free_queue": "vllm",
        "cache_duplicates": True,
        "kv_events": False,
    }
    header = '{"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "kv_events": false}}'
    assert parse_trace_header(header)[0].kv_events is False
    assert parse_trace_header('{"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9}}')[0].kv_events


def test_kv_events_must_be_a_boolean() -> None:
    with pytest.raises(InvalidConfig, match="kv_events must be a boolean"):
        CacheConfig(block_size=4, num_blocks=9, kv_events="no")  # type: ignore[arg-type]
