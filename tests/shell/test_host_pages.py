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
    """Three conversations of ``turns`` turns, each turn's prompt its whole history: every answer, and the engine."""
    eng = Engine(model, tok, **{"kv_cache_memory_bytes": 10 << 20, "max_num_seqs": 3, "kv_offloading_size": gib, **kw})
    out, errors = through_faults(eng, tok, turns)
    assert errors == 0
    return out, eng


def fail_once(monkeypatch: pytest.MonkeyPatch, copy: str, message: str) -> list[tuple[Any, ...]]:
    """``HostPages``' ``copy`` (``_load`` or ``_store``) raising ``message`` the first time; the failed call's
    arguments once it has."""
    from pagedkv.shell.host_pages import HostPages

    real, calls = getattr(HostPages, copy), []

    def flaky(self: HostPages, *args: Any) -> None:
        if not calls:
            calls.append(args)
            raise RuntimeError(message)
        real(self, *args)

    monkeypatch.setattr(HostPages, copy, flaky)
    return calls


def through_faults(eng: Engine, tok: Any, turns: int = 3) -> tuple[list[Any], int]:
    """``conversations``' turns on ``eng``, a request a fault ended served again: every answer, and how many
    requests a fault ended."""
    history: list[list[dict[str, str]]] = [[] for _ in range(3)]
    errors, out = 0, []
    for turn in range(turns):
        asks = []
        for c in range(3):
            history[c].append({"role": "user", "content": f"Tell me about topic {c}, part {turn}."})
            asks.append(
                ("", tok.encode(tok.apply_chat_template(history[c])), SamplingParams(temperature=0.0, max_tokens=10))
            )
        for c, done in enumerate(eng.generate(asks)):
            if done.finish_reason == "error":
                errors += 1
                done = eng.generate([asks[c]])[0]  # (served again)
            history[c].append({"role": "assistant", "content": tok.decode(done.token_ids)})
            out.append(done.token_ids)
    return out, errors


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


@pytest.mark.slow
def test_a_tier_that_keeps_contents_seen_twice_stores_less_and_answers_the_same(
    smollm2: tuple[Any, dict[str, Any]],
) -> None:
    """``kv_offloading_store_threshold=2`` (vLLM's store_threshold): the same tokens as without a tier, fewer blocks
    stored than the tier that keeps every evicted one (a history's blocks go to the host once a later turn used
    them), and still more of each prompt hit than without the tier."""
    from pagedkv.models.tokenizer import Tokenizer

    model, meta = smollm2
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    plain, without = conversations(model, tok, None, turns=4)
    every, tier = conversations(model, tok, 0.05, turns=4)
    picked, picky = conversations(model, tok, 0.05, turns=4, kv_offloading_store_threshold=2)
    assert picked == plain == every
    assert picky.host_pages is not None and tier.host_pages is not None
    assert 0 < picky.host_pages.stored < tier.host_pages.stored and picky.host_pages.loaded > 0
    assert tier.state.kv.prefix_hit_rate >= picky.state.kv.prefix_hit_rate > without.state.kv.prefix_hit_rate


def test_a_failed_load_ends_its_step_and_nothing_it_touched_is_read(
    smollm2: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that raises fails its step's requests (``error``), the engine goes on; the blocks it was loading
    were never in the device index, so the next turn computes or loads them anew: the same tokens as without the
    tier."""
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.host_pages import HostPages

    model, meta = smollm2
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    plain, _ = conversations(model, tok, None)
    failed = fail_once(monkeypatch, "_load", "a host-to-device copy failed")
    eng = Engine(model, tok, kv_cache_memory_bytes=10 << 20, max_num_seqs=3, kv_offloading_size=0.05)
    out, errors = through_faults(eng, tok)
    assert failed and errors and out == plain


def test_batched_copies_mean_what_the_recorded_order_means() -> None:
    """Stores first, then loads, a batch closed where that would change what a copy reads or writes: over random
    copy sequences (orders the core never records included), pages and slots end as the copies done one by one
    leave them (tests/gpu/test_host_tier_cuda.py runs the same on CUDA's streams)."""
    copies_as_recorded("cpu")


def copies_as_recorded(device: str, seeds: int = 200) -> None:
    """``test_batched_copies_mean_what_the_recorded_order_means`` on ``device``."""
    import random

    import torch

    from pagedkv.core import CacheConfig
    from pagedkv.core.outputs.events import BlockOffloaded, BlockOnloaded
    from pagedkv.shell.host_pages import HostPages
    from pagedkv.shell.pool import PagePool

    h = bytes(16)
    for seed in range(seeds):
        rng = random.Random(seed)
        pool = PagePool(CacheConfig(block_size=2, num_blocks=6), num_layers=2, kv_heads=1, head_dim=2, device=device)
        for t in [*pool.k, *pool.v]:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
        pages = HostPages(pool, 4)
        want_dev = [t.cpu().clone() for t in [*pool.k, *pool.v]]
        want_host = torch.zeros((4, 4, *pool.k[0].shape[1:]))  # (page tensor, slot, ...)
        events = []
        for _ in range(rng.randrange(1, 9)):
            block, slot = rng.randrange(1, 6), rng.randrange(4)
            if rng.random() < 0.5:
                events.append(BlockOffloaded(h, 0, block, slot))
                for i, d in enumerate(want_dev):
                    want_host[i, slot] = d[block]
            else:
                events.append(BlockOnloaded(h, 0, slot, block))
                for i, d in enumerate(want_dev):
                    d[block] = want_host[i, slot]
        pages.apply(events)
        pages.settle()  # (every store's copy to the host issued and landed: ``send`` comes after a forward's launch)
        if device != "cpu":
            torch.cuda.synchronize()
        got_host = torch.cat([host.transpose(0, 1) for _, host in pages.sides])  # (a host side: slots, layers, ...)
        assert torch.equal(got_host, want_host), (seed, events)
        assert all(torch.equal(a.cpu(), b) for a, b in zip([*pool.k, *pool.v], want_dev)), (seed, events)


def test_a_slot_whose_store_failed_is_never_read() -> None:
    """A store that raises leaves its slots unwritten: a load of one raises (``ShellError``: its step's requests
    fail) and writes nothing; a store that writes the slot again makes it readable."""
    import torch

    from pagedkv.core import CacheConfig
    from pagedkv.core.outputs.events import BlockOffloaded, BlockOnloaded
    from pagedkv.shell.errors import ShellError
    from pagedkv.shell.host_pages import HostPages
    from pagedkv.shell.pool import PagePool

    h = bytes(16)
    pool = PagePool(CacheConfig(block_size=2, num_blocks=6), num_layers=2, kv_heads=1, head_dim=2)
    for t in [*pool.k, *pool.v]:
        t.copy_(torch.randn(t.shape))
    pages = HostPages(pool, 4)
    real = HostPages._store

    def broken(self: HostPages, blocks: list[int], slots: list[int]) -> None:
        raise RuntimeError("a device-to-host copy failed")

    HostPages._store = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError):
            pages.apply([BlockOffloaded(h, 0, 1, 2)])
    finally:
        HostPages._store = real  # type: ignore[method-assign]
    before = [t.clone() for t in [*pool.k, *pool.v]]
    with pytest.raises(ShellError, match=r"host slots \[2\] were never written"):
        pages.apply([BlockOnloaded(h, 0, 2, 3)])
    assert all(torch.equal(a, b) for a, b in zip([*pool.k, *pool.v], before))
    pages.apply([BlockOffloaded(h, 0, 4, 2), BlockOnloaded(h, 0, 2, 3)])
    assert all(torch.equal(t[3], t[4]) for t in [*pool.k, *pool.v])


def test_a_failed_store_is_forgotten_by_the_core_and_the_trace_replays(
    smollm2: tuple[Any, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that raises fails its step; the engine has the core drop the tier's entries it could not write
    (``forget_host``, recorded in the trace), so the next turns hit only what was written: the same tokens as
    without the tier, and the recorded trace replays digest for digest."""
    import io
    import json

    from pagedkv.core.verify.trace import replay
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.host_pages import HostPages

    model, meta = smollm2
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    plain, _ = conversations(model, tok, None)
    failed = fail_once(monkeypatch, "_store", "a device-to-host copy failed")  # (blocks, slots) of the failed one
    trace = io.StringIO()
    eng = Engine(model, tok, kv_cache_memory_bytes=10 << 20, max_num_seqs=3, kv_offloading_size=0.05, trace=trace)
    out, errors = through_faults(eng, tok)
    eng.finish_trace()
    assert failed and errors and out == plain
    lines = trace.getvalue().splitlines()
    (forget,) = [json.loads(line) for line in lines if '"op": "forget_host"' in line]
    assert forget["slots"] == sorted(failed[0][1]) and forget["expect"]["forgotten"] >= 1
    assert all(ev.divergence is None for ev in replay(lines))


def test_the_store_gather_kernel_reads_what_index_select_reads() -> None:
    """shell.host_copy's gather (the stores' read on CUDA) in Triton's interpreter on the CPU (a process of its own:
    the interpreter is chosen when Triton is first imported): every page dtype's bytes, pages of a size in 32-bit
    words and not (fp8), a block named twice, none; on a GPU, tests/gpu/test_host_tier_cuda.py's copies check it."""
    import os
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("triton", reason="the gather is a Triton kernel (pip install triton)")
    code = """
        import torch
        from pagedkv.shell.host_copy import gather_pages

        for dt, page in ((torch.bfloat16, (4, 2, 8)), (torch.float32, (2, 3)), (torch.float8_e4m3fn, (3, 1, 2))):
            pages = (torch.randn(5, 11, *page) * 3).to(dt)
            at = torch.tensor([3, 0, 10, 3, 7])
            got = gather_pages(pages, at)
            want = pages.transpose(0, 1).index_select(0, at)
            assert got.shape == want.shape and got.dtype == dt and got.is_contiguous()
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), dt
            assert gather_pages(pages, at[:0]).shape == (0, 5, *page)
        """
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
