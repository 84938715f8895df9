"""The host tier on CUDA (issue 51): its copies on their own stream, pinned host pages. Bytes stored and loaded back
through the engine's own pool exactly, a slot stored and loaded in one step included; SmolLM2 conversations whose
histories outgrow the pool give the same tokens with the tier as without it (batch-invariant, bf16: a block loaded
back holds the bits a recompute would give) while the tier is stored to and loaded from."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

from pagedkv.core.outputs.events import BlockOffloaded, BlockOnloaded  # noqa: E402
from pagedkv.models.llama import Llama  # noqa: E402
from pagedkv.models.tokenizer import Tokenizer  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from tests.shell.test_host_pages import conversations, copies_as_recorded  # noqa: E402


def test_batched_copies_mean_what_the_recorded_order_means_on_cuda() -> None:
    """Random copy sequences on the store and load streams (a store's copy over the bus still on its way when a
    later load reads its slot, a slot a load still reads written by a later store): as the copies one by one."""
    copies_as_recorded("cuda", seeds=100)


@pytest.fixture(scope="module")
def smollm2_bf16() -> tuple[Llama, Tokenizer]:
    model, meta = Llama.smollm2(device="cuda", dtype=torch.bfloat16)
    return model, Tokenizer(meta)


def test_bytes_go_to_the_host_and_back_on_the_copy_stream(smollm2_bf16: tuple[Llama, Tokenizer]) -> None:
    model, tok = smollm2_bf16
    eng = Engine(model, tok, kv_cache_memory_bytes=64 << 20, kv_offloading_size=0.01)
    pages, pool = eng.host_pages, eng.pool
    assert pages is not None and pages.stream is not None and pages.sides[0][1].is_pinned()
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in [*pool.k, *pool.v]:
        t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(t.dtype))
    want = [t[[3, 4, 5]].clone() for t in [*pool.k, *pool.v]]
    h = bytes(16)
    # blocks 3, 4, 5 to slots 0, 1, 2; then, in the same step, slot 1 back into block 7 (a store, then its load)
    pages.apply(
        [BlockOffloaded(h, 0, 3, 0), BlockOffloaded(h, 0, 4, 1), BlockOffloaded(h, 0, 5, 2), BlockOnloaded(h, 0, 1, 7)]
    )
    for t in [*pool.k, *pool.v]:  # (the forward's stream overwrites the stored blocks after the copies)
        t[[3, 4, 5]] = 0
    pages.apply([BlockOnloaded(h, 0, 0, 9), BlockOnloaded(h, 0, 2, 10)])
    torch.cuda.synchronize()
    for t, w in zip([*pool.k, *pool.v], want):
        assert torch.equal(t[7], w[1]) and torch.equal(t[9], w[0]) and torch.equal(t[10], w[2])
    pages.settle()
    assert (pages.stored, pages.loaded, pages.pending) == (3, 3, [])


def test_the_same_tokens_with_the_tier_on_cuda(smollm2_bf16: tuple[Llama, Tokenizer]) -> None:
    model, tok = smollm2_bf16
    kw = {"batch_invariant": True, "kv_cache_memory_bytes": 6 << 20}
    plain, without = conversations(model, tok, None, turns=4, **kw)
    tiered, tier = conversations(model, tok, 0.05, turns=4, **kw)
    assert tier.host_pages is not None and tier.host_pages.stored and tier.host_pages.loaded
    assert tier.state.kv.prefix_hit_rate > without.state.kv.prefix_hit_rate
    assert tiered == plain


def test_stores_shed_under_back_pressure_lose_hits_never_tokens(smollm2_bf16: tuple[Llama, Tokenizer]) -> None:
    """Issue 66: with no room for stores on their way (``max_in_flight_bytes=0``), every store this step does not load
    back is shed rather than waited for: the core forgets its entry (``forget_host``), so no hit loads it, and the
    tokens are those of the run without the tier."""
    from typing import Any

    model, tok = smollm2_bf16
    kw: dict[str, Any] = {"batch_invariant": True, "kv_cache_memory_bytes": 6 << 20}
    plain, _ = conversations(model, tok, None, turns=4, **kw)
    real = Engine.__init__

    def tight(self: Engine, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        if self.host_pages is not None:
            self.host_pages.max_in_flight_bytes = 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "__init__", tight)
        tiered, tier = conversations(model, tok, 0.05, turns=4, **kw)
    pages = tier.host_pages
    assert pages is not None and pages.shed > 0 and not pages.unwritten
    assert tiered == plain
