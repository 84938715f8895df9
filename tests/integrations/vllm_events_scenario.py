"""One run through the core whose KV events cover every kind (stores in two groups, a window's drops,
evictions, a prefix-cache reset): shared by tests/integrations/test_vllm_events.py and the script that wrote
tests/integrations/data/vllm_events.msgpack with vLLM's own types."""

from __future__ import annotations

from pagedkv.core import CacheConfig, GroupKind, GroupSpec, RequestSpec, RowSpec, admit, commit, initial_state
from pagedkv.core import release, reset_prefix_cache
from pagedkv.core.outputs.events import KVEvent

CONFIG = CacheConfig(
    block_size=4,
    num_blocks=13,
    enable_prefix_caching=True,
    groups=(GroupSpec("full"), GroupSpec("swa", GroupKind.SLIDING_WINDOW, window=8)),
)


def events() -> list[KVEvent]:
    out: list[KVEvent] = []
    s = initial_state(CONFIG)
    for rid, toks in (("a", list(range(12))), ("b", list(range(100, 120)))):
        step = admit(s, RequestSpec(rid, (RowSpec.of_tokens(toks),))).unwrap()
        out += step.effect.events
        done = commit(step.state, rid, [len(toks)]).unwrap()
        out += done.effect.events
        s = release(done.state, rid, "finished").unwrap().state
    cleared = reset_prefix_cache(s).unwrap()
    return out + list(cleared.effect.events)
