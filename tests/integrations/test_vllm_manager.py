"""pagedkv's core as vLLM's KV cache manager, against vLLM's own, under vLLM's real v1 Scheduler.

The same workload (200 requests: shared system prompts, decode growth, preemption in a small pool,
finished and aborted requests, resets of the prefix cache) runs through vLLM's ``Scheduler`` (0.33 or 0.34, the
release installed; CI runs both) with
its own ``KVCacheManager`` and through ``PagedKVScheduler`` (the same scheduler, pagedkv's manager), step
by step: identical scheduled requests and token counts, identical block ids, identical prefix hits,
identical preemptions and endings, identical KV events after vLLM's own msgspec types encode and decode
them, identical usage and prefix-cache stats. Skipped where vLLM is not installed; CI runs them in
environments of their own (``.ci/vllm_env.sh VENV 0.33.0`` and ``0.34.0``) where a skip is a failure:

    PAGEDKV_REQUIRE_VLLM=1 VENV/bin/python -m pytest -q tests/integrations
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.integrations.vllm_harness import (
    Layout,
    Workload,
    differential,
    drive,
    drive_reading_state,
    fuzzed,
    make_scheduler,
    vllm_available,
)

pytestmark = pytest.mark.skipif(vllm_available() is not None, reason=vllm_available() or "")

CASES = {  # name: (pool blocks, layout, workload options, scheduler options)
    "full attention, 60 blocks": (60, Layout(), {}, {}),
    "full + window 32, 60 blocks": (60, Layout(windows=(32,)), {}, {}),
    "full + windows 32 and 64, 90 blocks": (90, Layout(windows=(32, 64)), {}, {}),
    "full + window 16, 40 blocks, long chunks": (
        40,
        Layout(windows=(16,)),
        {"seed": 3},
        {"max_num_batched_tokens": 512},
    ),
    "full + window 48, watermark 0.1": (80, Layout(windows=(48,)), {"seed": 1}, {"watermark": 0.1}),
    "prefix caching off, window 32": (60, Layout(windows=(32,)), {"seed": 2}, {"caching": False}),
    "resets while busy and idle": (120, Layout(windows=(32,)), {"seed": 4, "reset_every": 7, "idle_after": 150}, {}),
    # issue 28: long hits under windows (the core once counted a window group whole and refused them for good)
    "long hits under window 16, 40 blocks, 64-token chunks": (
        40,
        Layout(windows=(16,)),
        {"seed": 5, "long_prompts": 0.4, "repeats": 0.4, "max_prompt": 440},
        {"max_num_batched_tokens": 64},
    ),
    "1,700-token prompts under window 16, 200 blocks": (
        200,
        Layout(windows=(16,)),
        {"seed": 6, "long_prompts": 0.3, "repeats": 0.3, "max_prompt": 1800, "num_requests": 80},
        {},
    ),
    "long hits under windows 32 and 64, 300 blocks": (
        300,
        Layout(windows=(32, 64)),
        {"seed": 7, "long_prompts": 0.5, "repeats": 0.4, "max_prompt": 1500},
        {},
    ),
    "preemption back onto a cached prefix, 40 blocks": (
        40,
        Layout(windows=(32,)),
        {"seed": 8, "repeats": 0.5, "max_prompt": 300},
        {},
    ),
    "LoRA adapters and cache salts, sha256": (
        90,
        Layout(windows=(32,)),
        {"seed": 9, "lora_every": 3, "salt_every": 4, "repeats": 0.3},
        {"hash_algo": "sha256"},
    ),
    "LoRA adapters and cache salts, sha256_cbor": (90, Layout(), {"seed": 10, "lora_every": 3, "salt_every": 4}, {}),
    "kv_cache_report_mode full": (90, Layout(windows=(48,)), {"seed": 11, "report_every": 2, "repeats": 0.4}, {}),
    "KV cache residency metrics": (50, Layout(windows=(32,)), {"seed": 12, "repeats": 0.3}, {"metrics": True}),
    "xxhash, LoRA and salts": (90, Layout(), {"seed": 13, "lora_every": 3, "salt_every": 4}, {"hash_algo": "xxhash"}),
    "xxhash_cbor, window 64": (90, Layout(windows=(64,)), {"seed": 14}, {"hash_algo": "xxhash_cbor"}),
    # issue 34: a Mamba group in mamba_cache_mode="align" (a state block at each boundary, aligned prefill splits)
    "full + Mamba (align), 60 blocks": (60, Layout(mamba=1), {}, {}),
    "full + window 32 + Mamba, long prompts and repeats": (
        90,
        Layout(windows=(32,), mamba=1),
        {"seed": 16, "long_prompts": 0.3, "repeats": 0.4, "max_prompt": 600},
        {},
    ),
    "Mamba, 40 blocks, 64-token chunks, repeats, metrics": (
        40,
        Layout(mamba=1),
        {"seed": 17, "repeats": 0.5, "max_prompt": 300},
        {"max_num_batched_tokens": 64, "metrics": True},
    ),
    "Mamba, resets while busy and idle": (120, Layout(mamba=1), {"seed": 21, "reset_every": 5, "idle_after": 150}, {}),
    "Mamba, prefix caching off": (60, Layout(mamba=1), {"seed": 19}, {"caching": False}),
    "Mamba, LoRA, salts, report mode full": (
        90,
        Layout(mamba=1),
        {"seed": 20, "lora_every": 3, "salt_every": 4, "report_every": 3, "repeats": 0.3},
        {},
    ),
    # issue 61: vLLM 0.34's prefix-cache hit limit (a prompt scored from row 32 reads 32 cached tokens at most;
    # 0.33 reads it whole) and its cache-aware admission (the scheduler probes the manager's cache every step)
    "prompts scored from row 32, 60 blocks": (60, Layout(), {"seed": 30, "scored_every": 4, "repeats": 0.5}, {}),
    "prompts scored, window 32": (60, Layout(windows=(32,)), {"seed": 31, "scored_every": 4, "repeats": 0.5}, {}),
    "cache-aware admission, 60 blocks": (60, Layout(), {"seed": 32, "repeats": 0.4}, {"cache_aware": 8}),
    "cache-aware admission, window 32 and Mamba, scored prompts": (
        60,
        Layout(windows=(32,), mamba=1),
        {"seed": 33, "repeats": 0.4, "scored_every": 5},
        {"cache_aware": 8},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pagedkv_manager_decides_as_vllms_own_step_by_step(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from pagedkv.integrations.vllm import PagedKVScheduler

    blocks, layout, work, options = CASES[name]
    if options.get("hash_algo", "").startswith("xxhash"):
        pytest.importorskip("xxhash")
        monkeypatch.setenv("PYTHONHASHSEED", "7")  # (else vLLM seeds an xxhash chain at random, per scheduler)
    theirs = drive(make_scheduler(Scheduler, blocks, layout, **options), Workload(**work))
    ours_sched = make_scheduler(PagedKVScheduler, blocks, layout, **options)
    ours, read = drive_reading_state(ours_sched, Workload(**work))  # (decisions unchanged by the reads)
    assert len(ours) == len(theirs) and read > 0
    for i, (a, b) in enumerate(zip(theirs, ours)):
        for field in ("scheduled", "new_blocks", "hits", "preempted", "finished", "events", "stats"):
            assert getattr(b, field) == getattr(a, field), f"step {i}: {field} differs"
    # the workload did what it is for (a test that cannot fail proves nothing)
    n = work.get("num_requests", 200)
    assert len({r for rec in theirs for r in rec.scheduled}) == n
    assert len({r for rec in theirs for r in rec.finished}) >= n - 1  # (the last step's endings are never reported)
    assert sum(1 for *_, abort in Workload(**work).requests if abort is not None) >= n // 11 - 1  # aborted mid-way
    assert sum(len(rec.preempted) for rec in theirs) > 0 or options.get("watermark") or blocks >= 200
    stored = [ev for rec in theirs for ev in rec.events if type(ev).__name__ == "BlockStored"]
    if options.get("caching", True):
        assert sum(1 for rec in theirs for rid, hit in rec.hits.items() if hit > 0) > 10
        assert any(type(ev).__name__ == "BlockRemoved" for rec in theirs for ev in rec.events) or blocks >= 200
        assert stored
    if work.get("reset_every"):
        answers = [rec.stats[-1] for rec in theirs if len(rec.stats) == 10]
        assert True in answers and False in answers  # refused while blocks were held, done when idle
        assert any(type(ev).__name__ == "AllBlocksCleared" for rec in theirs for ev in rec.events)
    if work.get("long_prompts") and layout.windows:  # hits long enough that the window groups hold nulls below
        assert max(hit for rec in theirs for hit in rec.hits.values()) > 8 * max(layout.windows)
    if work.get("lora_every"):
        assert {ev.lora_name for ev in stored} >= {None, "adapter-1", "adapter-2"}
        assert any(keys and "tenant-0" in keys for ev in stored for keys in ev.extra_keys or ())
    if work.get("report_every"):  # a reused block announced again: a hash stored more than once
        hashes = [h for ev in stored for h in ev.block_hashes]
        assert len(hashes) > len(set(hashes))
    if options.get("metrics"):
        assert sum(len(rec.stats[8]) for rec in theirs if rec.stats) > 20  # eviction events, vLLM's count
    if layout.mamba:  # running requests' new state blocks with the null block between, state blocks cached
        assert any(0 in ids[-1] for rec in theirs for rid, ids in rec.new_blocks.items() if ids and rid not in rec.hits)
        assert not options.get("caching", True) or any(ev.kv_cache_spec_kind == "mamba" for ev in stored)
    # the manager's state is a value the core's invariants hold on; nothing is left held
    from pagedkv.core.verify.invariants import check_invariants

    state = ours_sched.kv_cache_manager.state
    assert check_invariants(state) == [] and not state.requests
    assert state.free_blocks == blocks - 1


def test_the_hit_limit_and_the_cache_probe_do_what_the_release_says() -> None:
    """vLLM 0.34: a request scoring its prompt from row 32 hits 32 tokens at most, and cache-aware admission probes
    the manager (``get_num_cached_tokens``), which takes no reference and makes no event; vLLM 0.33: the scored
    prompt is read whole and nothing probes. The same through vLLM's manager and pagedkv's (the cases above)."""
    from pagedkv.integrations.vllm import PagedKVScheduler, version
    from pagedkv.integrations.vllm.manager import PagedKVCacheManager

    newer = version.at_least("0.34")
    work = Workload(seed=30, scored_every=4, repeats=0.5)
    scored = {rid for rid, *_ in work.requests if int(rid[1:]) % 4 == 3}
    records = drive(make_scheduler(PagedKVScheduler, 60, Layout()), work)
    hits = [hit for rec in records for rid, hit in rec.hits.items() if rid in scored]
    assert hits and (max(hits) == 32 if newer else max(hits) > 32), sorted(set(hits))
    probes: list[int] = []
    real = PagedKVCacheManager.get_num_cached_tokens

    def probe(self: Any, request: Any) -> int:
        self._flush()  # (the queued blocks cached first: what the probe itself may do, so it changes nothing then)
        state, events = self._state, list(self._stream._events)
        got = real(self, request)
        assert self._state is state and self._stream._events == events  # (no transition: no reference, no event)
        probes.append(got)
        return got

    PagedKVCacheManager.get_num_cached_tokens = probe  # type: ignore[method-assign]
    try:
        drive(make_scheduler(PagedKVScheduler, 60, Layout(), cache_aware=8), Workload(seed=32, repeats=0.4))
    finally:
        PagedKVCacheManager.get_num_cached_tokens = real  # type: ignore[method-assign]
    assert (len(probes) > 100 and any(got > 0 for got in probes)) if newer else not probes


def test_a_vllm_release_outside_the_supported_ones_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from pagedkv.integrations.vllm import version
    from pagedkv.integrations.vllm.manager import PagedKVCacheManager, Unsupported

    one = Layout().kv_cache_config(32)
    for other in ("0.35.0", "0.32.1", "1.0.0"):
        monkeypatch.setattr(vllm, "__version__", other)
        version.release.cache_clear()
        with pytest.raises(Unsupported) as refused:
            PagedKVCacheManager(one, max_model_len=512, scheduler_block_size=16, hash_block_size=16)
        assert str(refused.value) == (
            "pagedkv's KV cache manager serves vLLM 0.33 and 0.34 (the two latest minor releases); "
            f"vLLM {other} is installed"
        )
    monkeypatch.undo()
    version.release.cache_clear()
    assert version.release() in version.SUPPORTED


@pytest.mark.parametrize("plant", ["no deferral", "no junction", "every position allocated"])
def test_each_align_mode_rule_is_needed(plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of vLLM's align-mode rules that the manager follows, taken away, makes the run depart from vLLM's:
    a hit on a state cached this step waits a step; the lookup reports where the full groups' hit ends (the
    scheduler ends a prefill chunk there, so the state at the shared prefix is cached); the group allocates
    its last position only."""
    from pagedkv.core.rules.kinds import FullAttention, MambaAlign
    from pagedkv.integrations.vllm import manager

    if plant == "no deferral":
        monkeypatch.setattr(manager.PagedKVCacheManager, "_state_cached_now", lambda self, state, spec: False)
    elif plant == "no junction":
        real = manager.find_hit
        monkeypatch.setattr(manager, "find_hit", lambda *a, **k: dataclasses.replace(real(*a, **k), full_blocks=0))
    else:
        monkeypatch.setattr(MambaAlign, "admitted", FullAttention.admitted)
    diff, steps, _ = differential(60, Layout(mamba=1), {"num_requests": 120}, {})
    assert diff is not None, f"{plant}: no difference in {steps} steps"


def test_event_hashes_as_bytes_when_vllm_sends_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` vLLM's events carry the 32-byte hashes; so do pagedkv's."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    diff, steps, _ = differential(
        60,
        Layout(windows=(32,)),
        {"seed": 15, "num_requests": 60, "lora_every": 3, "salt_every": 4},
        {"hash_algo": "sha256"},
    )
    assert diff is None and steps > 50
    from vllm.v1.core.sched.scheduler import Scheduler

    stored = [
        ev
        for rec in drive(make_scheduler(Scheduler, 60, Layout(), hash_algo="sha256"), Workload(num_requests=20))
        for ev in rec.events
        if type(ev).__name__ == "BlockStored"
    ]
    assert stored and all(type(h) is bytes and len(h) == 32 for ev in stored for h in ev.block_hashes)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_fuzzed_configurations_are_identical_to_the_end(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded configurations (tests/integrations/vllm_harness.fuzzed: windows, pool sizes from tight to roomy, chunk sizes,
    the watermark, caching on or off, every hash kind, LoRA, salts, report mode, metrics, long and repeated
    prompts, resets): vLLM's scheduler decides the same with pagedkv's manager as with its own, to the end.
    ``python -m tests.integrations.vllm_harness FIRST COUNT`` runs more."""
    blocks, layout, work, options = fuzzed(seed)
    if options["hash_algo"].startswith("xxhash"):
        pytest.importorskip("xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    diff, steps, manager = differential(blocks, layout, work, options)
    assert diff is None
    from pagedkv.core.verify.invariants import check_invariants

    assert check_invariants(manager.state) == [] and not manager.state.requests


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


@pytest.mark.parametrize(
    "ids",
    [[], [5], [0, 23, 24, 255, 256, 65535, 65536, 131071, 131072, 2**32 + 5, 2**64 - 1], list(range(131_060, 131_080))],
)
def test_the_sha256_cbor_block_hash_is_vllms_for_any_ids(ids: list[int]) -> None:
    """The CBOR pagedkv hashes (table heads for token ids, computed heads past the table) is cbor2's, and the
    hash vLLM's ``sha256_cbor`` gives, for ids at every head width and past the table."""
    from array import array

    import cbor2
    from vllm.utils.hashing import sha256_cbor

    from pagedkv.core.rules.hashing import hash_packed_cbor, root_hash

    parent = root_hash("vllm-none-hash", "sha256_cbor")
    for extra in (None, ("lora-1", "salt")):
        assert hash_packed_cbor(parent, array("Q", ids).tobytes(), cbor2.dumps(extra, canonical=True)) == sha256_cbor(
            (parent, tuple(ids), extra)
        )


def test_what_the_manager_does_not_serve_is_refused_at_construction() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from pagedkv.integrations.vllm.manager import PagedKVCacheManager, Unsupported
    from pagedkv.integrations.vllm.scheduler import refusals

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(torch.float32,))
    cfg = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["m"], mamba)],
    )
    with pytest.raises(Unsupported, match="MambaSpec"):
        PagedKVCacheManager(cfg, max_model_len=512, scheduler_block_size=16, hash_block_size=16)
    one = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], full)])
    with pytest.raises(Unsupported, match="multi-module MTP"):
        PagedKVCacheManager(
            one, max_model_len=512, scheduler_block_size=16, hash_block_size=16, num_prefill_lookahead=3
        )
    with pytest.raises(Unsupported, match="block drop with lookahead hashes"):
        PagedKVCacheManager(
            one,
            max_model_len=512,
            scheduler_block_size=16,
            hash_block_size=16,
            use_eagle=True,
            num_hash_lookahead_tokens=1,
        )
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


def _managers(max_model_len: int = 32) -> tuple[Any, Any, Any]:
    """vLLM's own KVCacheManager and pagedkv's over one 16-block pool (full + window 32), and a request maker."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from pagedkv.integrations.vllm.manager import PagedKVCacheManager

    init_none_hash(sha256_cbor)
    config = Layout(windows=(32,)).kv_cache_config(16)
    kw = dict(
        max_model_len=max_model_len,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=True,
        enable_kv_cache_events=True,
    )
    hasher = get_request_block_hasher(16, sha256_cbor)

    def request(rid: str, tokens: list[int]) -> Any:
        return Request(
            rid, tokens, SamplingParams(temperature=0.0, max_tokens=4), pooling_params=None, block_hasher=hasher
        )

    return KVCacheManager(config, **kw), PagedKVCacheManager(config, hash_algo="sha256_cbor", **kw), request


def _ids(blocks: Any) -> Any:
    return None if blocks is None else blocks.get_block_ids()


@pytest.mark.parametrize("n, max_model_len", [(40, 32), (33, 32)])
def test_an_allocation_past_max_model_len_is_refused_with_nothing_allocated(n: int, max_model_len: int) -> None:
    """Issue 45: a request holding more tokens than max_model_len. vLLM's own manager allocates a row cut at
    max_model_len (a 100-token prompt past 64: 16 blocks, usage 0.0 -> 0.5) that its scheduler then computes
    past; pagedkv's refuses it (ManagerError) and changes nothing, and the next calls go on as if it never
    came. (Before issue 28 the core refused the caching after admitting: the request was left admitted.)"""
    from pagedkv.core import digest
    from pagedkv.integrations.vllm.stream import ManagerError

    theirs, ours, request = _managers(max_model_len)
    tokens = list(range(1, n + 1))
    assert theirs.allocate_slots(request("long", tokens), n) is not None and theirs.usage > 0  # (vLLM's: held)
    before, events = digest(ours.state), ours.take_events()
    with pytest.raises(ManagerError, match=f"has {n} tokens, over max_model_len {max_model_len}"):
        ours.allocate_slots(request("long", tokens), n)
    assert digest(ours.state) == before and ours.usage == 0.0 and ours.take_events() == [] and not events
    assert "long" not in ours._len and not ours.state.requests
    ours.free(request("long", tokens))  # (unknown to the core: nothing to do)
    assert _ids(ours.allocate_slots(request("ok", tokens[:max_model_len]), max_model_len)) is not None


def test_a_refused_call_leaves_the_manager_as_it_was() -> None:
    """A call the core refuses raises ManagerError and changes nothing: the state, the events, the row lengths;
    the next calls go on as if it never came."""
    from pagedkv.core import digest
    from pagedkv.integrations.vllm.stream import ManagerError

    _, ours, request = _managers(max_model_len=64)
    first = request("a", list(range(1, 21)))
    ours.allocate_slots(first, 20)
    before, events = digest(ours.state), len(ours.take_events())
    bad = request("b", list(range(100, 139)))
    with pytest.raises(ManagerError, match="hit is 0 tokens, the scheduler's 16"):
        ours.allocate_slots(bad, 8, num_new_computed_tokens=16)  # a hit the cache does not hold
    assert digest(ours.state) == before and ours.take_events() == [] and "b" not in ours._len and events
    ours.free(bad)  # (unknown to the core: nothing to do, as vLLM's free of a request it never allocated)
    assert _ids(ours.allocate_slots(bad, 39)) == ([5, 6, 7], [8, 9, 10])
    assert digest(ours.state) != before


@pytest.mark.parametrize("lookahead", [0, 1, 2])
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_multimodal_lora_and_salted_requests_hash_as_vllms(algo: str, lookahead: int) -> None:
    """A request with a LoRA adapter, three images (one spanning a block boundary, one starting right after a
    block, in its lookahead) and a cache salt: the core's chain, from the keys the manager reads off the
    request, is ``request.block_hashes`` byte for byte; with EAGLE's lookahead hashes too (each block's hash
    covers the ``lookahead`` tokens after it and the images they touch)."""
    if algo == "xxhash":
        pytest.importorskip("xxhash")
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from pagedkv.core import admit, commit
    from pagedkv.integrations.vllm.manager import PagedKVCacheManager

    init_none_hash(get_hash_fn_by_name(algo))
    images = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(off, n))
        for ident, off, n in (("img-a", 3, 10), ("img-b", 40, 30), ("img-c", 80, 5))
    ]
    request = Request(
        "mm",
        list(range(1, 101)),
        SamplingParams(temperature=0.0, max_tokens=4),
        pooling_params=None,
        block_hasher=get_request_block_hasher(16, get_hash_fn_by_name(algo), lookahead),
        mm_features=images,
        lora_request=LoRARequest("ad", 3, "/ad"),
        cache_salt="tenant",
    )
    manager = PagedKVCacheManager(
        Layout().kv_cache_config(32),
        max_model_len=512,
        scheduler_block_size=16,
        hash_block_size=16,
        hash_algo=algo,
        num_hash_lookahead_tokens=lookahead,
    )
    spec = manager._spec(request, request.all_token_ids, None)
    state = commit(admit(manager.state, spec).unwrap().state, "mm", [100]).unwrap().state
    ours = [state.rows[state.requests["mm"].slots[0]].hash_at(j) for j in range(6)]
    assert ours == [bytes(h) for h in request.block_hashes] and len(ours) == 6


@pytest.mark.parametrize("where", ["lookup", "cache_ahead"])
def test_vllm_block_hashes_are_taken_and_a_wrong_one_is_caught(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager hands the core vLLM's ``request.block_hashes`` instead of hashing every block again; under
    ``PAGEDKV_CHECK_HASHES=1`` (this directory's conftest) the core checks each. Planted: one byte of a hash
    vLLM gives flipped, at the lookup (the spec's ``block_hashes``) or at ``cache_ahead``: refused, named."""
    from pagedkv.integrations.vllm import manager

    def flipped(hashes: Any) -> tuple[bytes, ...]:
        return tuple(bytes([h[0] ^ 1]) + h[1:] if j == 0 else h for j, h in enumerate(hashes))

    if where == "lookup":
        real = manager.PagedKVCacheManager._spec

        def spec(self: Any, *a: Any, **k: Any) -> Any:
            s = real(self, *a, **k)
            return dataclasses.replace(s, block_hashes=flipped(s.block_hashes))

        monkeypatch.setattr(manager.PagedKVCacheManager, "_spec", spec)
    else:
        real_many = manager.cache_ahead_many
        monkeypatch.setattr(
            manager,
            "cache_ahead_many",
            lambda state, items, hashes: real_many(state, items, hashes={r: flipped(h) for r, h in hashes.items()}),
        )
    diff, steps, _ = differential(60, Layout(), {"num_requests": 40}, {})
    assert diff is not None and "block_hashes[0] is not the hash of block 0" in diff, diff
