"""The host tier served (issue 51): SmolLM2 conversations whose histories outgrow the pool, each turn's prompt its
whole history: the same tokens with the tier as without it (greedy, fp32), more of each prompt hit, the tier's
blocks stored and loaded back; in a pool that preempts too (beside the same pool without the tier: a recompute
may change the default path's last bits, docs/determinism.md)."""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams


def conversations(model: Any, tok: Any, gib: float | None, turns: int = 3, **kw: Any) -> tuple[list[Any], Engine]:
    eng = Engine(model, tok, **{"kv_cache_memory_bytes": 10 << 20, "max_num_seqs": 3, "kv_offloading_size": gib, **kw})
    history: list[list[dict[str, str]]] = [[] for _ in range(3)]
    out = []
    for turn in range(turns):
        asks = []
        for c in range(3):
            history[c].append({"role": "user", "content": f"Tell me about topic {c}, part {turn}."})
            asks.append(("", tok.encode(tok.apply_chat_template(history[c])), SamplingParams(max_tokens=10)))
        for c, done in enumerate(eng.generate(asks)):
            history[c].append({"role": "assistant", "content": tok.decode(done.token_ids)})
            out.append(done.token_ids)
    return out, eng


@pytest.mark.slow
def test_the_same_tokens_with_the_tier_and_more_of_each_prompt_hit(smollm2: tuple[Any, dict[str, Any]]) -> None:
    from pagedkv.models.tokenizer import Tokenizer

    model, meta = smollm2
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    plain, without = conversations(model, tok, None)
    tiered, tier = conversations(model, tok, 0.05)
    assert tiered == plain
    pages = tier.host_pages
    assert pages is not None and pages.stored > 0 and pages.loaded > 0
    assert tier.state.kv.prefix_hit_rate > without.state.kv.prefix_hit_rate
    small, preempting = conversations(model, tok, 0.05, kv_cache_memory_bytes=6 << 20)  # (a pool that preempts)
    assert preempting.stats.preemptions and preempting.host_pages and preempting.host_pages.loaded
    assert small == conversations(model, tok, None, kv_cache_memory_bytes=6 << 20)[0]


def test_a_failed_load_ends_its_step_and_nothing_it_touched_is_read(
    smollm2: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that raises fails its step's requests (``error``), the engine goes on; the blocks it was loading
    were never in the device index, so the next turn computes or loads them anew: the same tokens as without the
    tier."""
    from pagedkv.core.events import BlockOnloaded
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.host_pages import HostPages

    model, meta = smollm2
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    plain, _ = conversations(model, tok, None)
    real = HostPages._copy
    failed: list[int] = []

    def flaky(self: HostPages, kind: Any, run: Any) -> None:
        if kind is BlockOnloaded and not failed:
            failed.append(len(run))
            raise RuntimeError("a host-to-device copy failed")
        real(self, kind, run)

    monkeypatch.setattr(HostPages, "_copy", flaky)
    eng = Engine(model, tok, kv_cache_memory_bytes=10 << 20, max_num_seqs=3, kv_offloading_size=0.05)
    history: list[list[dict[str, str]]] = [[] for _ in range(3)]
    errors, out = 0, []
    for turn in range(3):
        asks = []
        for c in range(3):
            history[c].append({"role": "user", "content": f"Tell me about topic {c}, part {turn}."})
            asks.append(("", tok.encode(tok.apply_chat_template(history[c])), SamplingParams(max_tokens=10)))
        for c, done in enumerate(eng.generate(asks)):
            if done.finish_reason == "error":
                errors += 1
                done = eng.generate([asks[c]])[0]  # (served again)
            history[c].append({"role": "assistant", "content": tok.decode(done.token_ids)})
            out.append(done.token_ids)
    assert failed and errors and out == plain
