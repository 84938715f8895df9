"""pagedkv's core as vLLM's KV cache manager, against vLLM's own, under vLLM's real v1 Scheduler.

The same workload (200 requests: shared system prompts, decode growth, preemption in a small pool,
finished and aborted requests, resets of the prefix cache) runs through vLLM 0.33's ``Scheduler`` with
its own ``KVCacheManager`` and through ``PagedKVScheduler`` (the same scheduler, pagedkv's manager), step
by step: identical scheduled requests and token counts, identical block ids, identical prefix hits,
identical preemptions and endings, identical KV events after vLLM's own msgspec types encode and decode
them, identical usage and prefix-cache stats. Skipped where vLLM is not installed (CI); run in
../shared/peers' venv (``pip install pytest hypothesis`` there):

    /work/peers-venv/bin/python -m pytest -q tests/test_vllm_manager.py
"""

from __future__ import annotations

import pytest

from bench.vllm_workload import Layout, Workload, drive, make_scheduler, vllm_available

pytestmark = pytest.mark.skipif(vllm_available() is not None, reason=vllm_available() or "")

CASES = {  # name: (pool blocks, layout, workload options, scheduler options)
    "full attention, 60 blocks": (60, Layout(), {}, {}),
    "full + window 32, 60 blocks": (60, Layout(windows=(32,)), {}, {}),
    "full + windows 32 and 64, 90 blocks": (90, Layout(windows=(32, 64)), {}, {}),
    "full + window 16, 40 blocks, long chunks": (40, Layout(windows=(16,)), {"seed": 3}, {"max_num_batched_tokens": 512}),
    "full + window 48, watermark 0.1": (80, Layout(windows=(48,)), {"seed": 1}, {"watermark": 0.1}),
    "prefix caching off, window 32": (60, Layout(windows=(32,)), {"seed": 2}, {"caching": False}),
    "resets while busy and idle": (120, Layout(windows=(32,)), {"seed": 4, "reset_every": 7, "idle_after": 150}, {}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_pagedkv_manager_decides_as_vllms_own_step_by_step(name: str) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from pagedkv.integrations.vllm import PagedKVScheduler

    blocks, layout, work, options = CASES[name]
    theirs = drive(make_scheduler(Scheduler, blocks, layout, **options), Workload(**work))
    ours_sched = make_scheduler(PagedKVScheduler, blocks, layout, **options)
    ours = drive(ours_sched, Workload(**work))
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(theirs, ours)):
        for field in ("scheduled", "new_blocks", "hits", "preempted", "finished", "events", "stats"):
            assert getattr(b, field) == getattr(a, field), f"step {i}: {field} differs"
    # the workload did what it is for (a test that cannot fail proves nothing)
    assert len({r for rec in theirs for r in rec.scheduled}) == 200
    assert len({r for rec in theirs for r in rec.finished}) >= 199  # (the last step's endings are never reported)
    assert sum(1 for *_, abort in Workload(**work).requests if abort is not None) >= 18  # aborted mid-way
    assert sum(len(rec.preempted) for rec in theirs) > 0 or options.get("watermark")
    if options.get("caching", True):
        assert sum(1 for rec in theirs for rid, hit in rec.hits.items() if hit > 0) > 10
        assert any(type(ev).__name__ == "BlockRemoved" for rec in theirs for ev in rec.events)
        assert any(type(ev).__name__ == "BlockStored" for rec in theirs for ev in rec.events)
    if work.get("reset_every"):
        answers = [rec.stats[-1] for rec in theirs if len(rec.stats) == 9]
        assert True in answers and False in answers  # refused while blocks were held, done when idle
        assert any(type(ev).__name__ == "AllBlocksCleared" for rec in theirs for ev in rec.events)
    # the manager's state is a value the core's invariants hold on; nothing is left held
    from pagedkv.core.verify.invariants import check_invariants

    state = ours_sched.kv_cache_manager.state
    assert check_invariants(state) == [] and not state.requests
    assert state.num_free == blocks - 1


def test_pagedkv_hashes_are_vllms_sha256_cbor() -> None:
    """Each block a request computes is cached under the hash vLLM's request block hasher gave it."""
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401  (vLLM importable)

    from pagedkv.integrations.vllm import PagedKVScheduler

    sched = make_scheduler(PagedKVScheduler, 200, Layout())
    work = Workload(num_requests=12, abort_every=1000)
    seen: dict[str, list[bytes]] = {}

    def on_step(step: int) -> None:
        for rid, req in sched.requests.items():
            seen[rid] = [bytes(h) for h in req.block_hashes]

    drive(sched, work, on_step=on_step)
    cached = {h for (g, h), _ in sched.kv_cache_manager.state.cache.items()}
    assert all(len(h) == 32 for h in cached)
    computed = {h for hashes in seen.values() for h in hashes}
    assert computed and computed & cached == cached  # every cached hash is one vLLM computed


def test_what_the_manager_does_not_serve_is_refused_at_construction() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from pagedkv.integrations.vllm.manager import PagedKVCacheManager, Unsupported
    from pagedkv.integrations.vllm.scheduler import refusals

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(torch.float32,))
    cfg = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["m"], mamba)])  # fmt: skip
    with pytest.raises(Unsupported, match="MambaSpec"):
        PagedKVCacheManager(cfg, max_model_len=512, scheduler_block_size=16, hash_block_size=16)
    one = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], full)])
    with pytest.raises(Unsupported, match="EAGLE"):
        PagedKVCacheManager(one, max_model_len=512, scheduler_block_size=16, hash_block_size=16, use_eagle=True)
    with pytest.raises(Unsupported, match="hash block size"):
        PagedKVCacheManager(one, max_model_len=512, scheduler_block_size=16, hash_block_size=8)
    with pytest.raises(Unsupported, match="block size 16"):
        PagedKVCacheManager(one, max_model_len=512, scheduler_block_size=32, hash_block_size=32)
    manager = PagedKVCacheManager(one, max_model_len=512, scheduler_block_size=16, hash_block_size=16)
    with pytest.raises(Unsupported, match="no coordinator"):
        manager.coordinator  # noqa: B018  (the scheduler reaches it only on the refused paths)
    sched = make_scheduler(__import__("vllm.v1.core.sched.scheduler", fromlist=["Scheduler"]).Scheduler, 32, Layout())
    config = sched.vllm_config
    assert refusals(config) == []
    config.kv_transfer_config = object()
    assert refusals(config) == ["a KV connector (kv_transfer_config)"]
