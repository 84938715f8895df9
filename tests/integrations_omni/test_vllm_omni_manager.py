"""pagedkv's vLLM-Omni manager in lockstep with vLLM-Omni 0.30's own ``DiffusionKVCacheManager`` (over vLLM 0.30's
``KVCacheManager``): the same calls on both, compared after each: what ``reserve_request`` gives (metadata, ``None``,
``DiffusionKVAdmissionError``), every row's block ids and cached prefix length, the whole free queue in order, the
allocation generations (each manager's, in the order they were handed out), and pagedkv's invariants. Named
scenarios, then fuzzed request streams (CFG rows, shared prefixes, caching on and off, tight pools that evict and
turn requests away, requests past ``max_model_len`` or the pool, frees in any order, one or two groups)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm_omni.diffusion.diffusion_kv.manager", reason="vLLM-Omni 0.30 is not installed here")

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm_omni.diffusion.diffusion_kv.manager import DiffusionKVAdmissionError, DiffusionKVCacheManager
from vllm_omni.diffusion.diffusion_kv.request import DiffusionKVContext, DiffusionKVRequest

from pagedkv.core import free_queue
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.integrations.vllm_omni.manager import PagedKVDiffusionManager

# (prefix_len, target_len, cache token ids; or, for a row its caller keys by hashes and gives no ids, its hashes)
Row = tuple[int, int, tuple[int, ...] | tuple[bytes, ...]]


def kv_config(num_blocks: int, block_size: int, groups: int = 1) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{g}"], spec) for g in range(groups)],
    )


def kv_requests(pid: str, rows: list[Row], **kw: Any) -> list[DiffusionKVRequest]:
    """A public request's CFG sequences, one a row (``kw``: more of ``DiffusionKVRequest``'s fields, each row's)."""
    return [
        DiffusionKVRequest(
            f"{pid}-{i}",
            sequence_id=i,
            prefix_len=p,
            target_len=t,
            seq_len=p + t,
            **({"block_hashes": list(toks)} if toks and type(toks[0]) is bytes else {"cache_token_ids": toks}),
            **kw,
        )
        for i, (p, t, toks) in enumerate(rows)
    ]


@dataclass
class Lockstep:
    """Both managers over one configuration, every call made on both and compared."""

    num_blocks: int
    block_size: int
    caching: bool
    max_model_len: int = 512
    groups: int = 1
    theirs: Any = None
    ours: Any = None
    generations: dict[str, list[int]] = field(default_factory=lambda: {"theirs": [], "ours": []})

    def __post_init__(self) -> None:
        kw = dict(
            max_model_len=self.max_model_len,
            scheduler_block_size=self.block_size,
            hash_block_size=self.block_size,
            enable_prefix_caching=self.caching,
        )
        self.theirs = DiffusionKVCacheManager(kv_config(self.num_blocks, self.block_size, self.groups), **kw)
        self.ours = PagedKVDiffusionManager(kv_config(self.num_blocks, self.block_size, self.groups), **kw)

    def reserve(self, pid: str, rows: list[Row], contexts: bool = False) -> object:
        """Both reservations; their outcome ("never", None, or each row's (block ids, cached prefix length))."""
        outs = []
        for name, m in (("theirs", self.theirs), ("ours", self.ours)):
            reqs = kv_requests(pid, rows, kv_contexts=(DiffusionKVContext("ctx", "cross", 4),) if contexts else ())
            try:
                md = m.reserve_request(pid, reqs)
            except DiffusionKVAdmissionError:
                outs.append("never")
                continue
            if md is None:
                outs.append(None)
                continue
            assert md.request_id == pid and [s.sequence_id for s in md.sequences] == list(range(len(rows)))
            assert m.has_request(pid) and m.get_metadata(pid) is md
            self.generations[name].append(md.allocation_generation)
            outs.append(
                [(s.block_ids, s.cached_prefix_len, s.prefix_len, s.target_len, s.seq_len) for s in md.sequences]
            )
        assert outs[0] == outs[1], f"{pid}: vLLM-Omni {outs[0]}, pagedkv {outs[1]}"
        self.check()
        return outs[0]

    def publish(self, pid: str) -> None:
        self.theirs.publish_request(pid)
        self.ours.publish_request(pid)
        self.check()

    def free(self, pid: str) -> None:
        self.theirs.free_request(pid)
        self.ours.free_request(pid)
        assert not self.theirs.has_request(pid) and not self.ours.has_request(pid)
        self.check()

    def check(self) -> None:
        pool = self.theirs.native_manager.block_pool
        theirs = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert list(free_queue(self.ours.state)) == theirs  # the free queue, block for block, in order
        assert check_invariants(self.ours.state) == []
        for gens in self.generations.values():  # (normalized: each strictly increasing in the order handed out)
            assert gens == sorted(set(gens))


def test_cfg_rows_share_the_shortest_rows_hit_and_publish_their_prefixes() -> None:
    lk = Lockstep(num_blocks=24, block_size=16, caching=True)
    cond, uncond = (40, 20, tuple(range(40))), (20, 20, tuple(range(100, 120)))
    first = lk.reserve("a", [cond, uncond])
    assert [r[1] for r in first] == [0, 0]  # type: ignore[index]
    lk.publish("a")
    lk.free("a")
    again = lk.reserve("b", [cond, uncond])
    assert [r[1] for r in again] == [16, 16]  # type: ignore[index]  # row 0 holds 32 cached tokens: the min is 16
    lk.publish("b")
    lk.publish("b")  # (twice: nothing more)
    lk.free("b")
    lk.theirs.close()
    lk.ours.close()


def test_without_caching_rows_go_back_in_physical_order() -> None:
    lk = Lockstep(num_blocks=40, block_size=8, caching=False)
    rows = [(30, 17, tuple(range(30))), (9, 17, tuple(range(9))), (0, 25, ())]
    lk.reserve("a", rows)
    lk.reserve("b", rows[:2])
    lk.free("a")
    lk.reserve("c", rows)
    lk.free("b")
    lk.free("c")


def test_a_request_that_does_not_fit_now_is_turned_away_as_vllm_omni_turns_it_away() -> None:
    """Three rows where two fit: vLLM-Omni gives the first two blocks (evicting cached prefixes), takes them back and
    requeues its hits; pagedkv's queue is the same after, and the request fits once blocks are freed."""
    lk = Lockstep(num_blocks=20, block_size=4, caching=True)
    shared = tuple(range(8))
    lk.reserve("a", [(8, 1, shared)])
    lk.publish("a")
    lk.free("a")
    lk.reserve("x", [(0, 40, ())])  # holds 10 blocks: 9 free, b needs 2 hits and 9 fresh
    rows = [(8, 12, shared)] * 3
    assert lk.reserve("b", rows) is None
    lk.free("x")
    assert lk.reserve("b", rows) not in (None, "never")


def test_what_can_never_fit_is_refused_with_vllm_omnis_error() -> None:
    lk = Lockstep(num_blocks=12, block_size=4, caching=True, max_model_len=64)
    assert lk.reserve("long", [(60, 8, tuple(range(60)))]) == "never"  # past max_model_len
    assert lk.reserve("big", [(20, 20, tuple(range(20)))] * 2) == "never"  # 20 blocks: 11 usable
    assert lk.reserve("ctx", [(4, 4, (1, 2, 3, 4))], contexts=True) == "never"  # independent contexts
    assert lk.reserve("ok", [(4, 4, (1, 2, 3, 4))]) not in (None, "never")


def test_malformed_calls_are_value_errors_on_both_and_change_nothing() -> None:
    lk = Lockstep(num_blocks=12, block_size=4, caching=False)
    lk.reserve("a", [(4, 4, ())])
    for m in (lk.theirs, lk.ours):
        with pytest.raises(ValueError):
            m.reserve_request("a", [DiffusionKVRequest("z-0", sequence_id=0, prefix_len=1, target_len=1, seq_len=2)])
        with pytest.raises(ValueError):
            m.reserve_request("b", [DiffusionKVRequest("b-0", sequence_id=1, prefix_len=1, target_len=1, seq_len=2)])
        with pytest.raises(ValueError):
            m.reserve_request("c", [DiffusionKVRequest("a-0", sequence_id=0, prefix_len=1, target_len=1, seq_len=2)])
        with pytest.raises(ValueError):
            m.reserve_request("", [DiffusionKVRequest("d-0", sequence_id=0, prefix_len=1, target_len=1, seq_len=2)])
        with pytest.raises(KeyError):
            m.get_metadata("nobody")
    lk.check()


class Hooks:
    """What a fuzzed stream does beside the managers (test_vllm_omni_worker.py: a worker for each)."""

    again = 0.0  # how often a reservation takes the id of a request freed before (its old snapshot: stale)

    def start(self, lk: Lockstep) -> None: ...

    def reserved(self, lk: Lockstep, pid: str) -> None: ...

    def freeing(self, lk: Lockstep, pid: str) -> None: ...


def fuzz(seed: int, ticks: int = 150, hooks: Hooks | None = None) -> Lockstep:
    hooks = hooks or Hooks()
    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])
    lk = Lockstep(
        num_blocks=rng.randint(8, 64),
        block_size=bs,
        caching=rng.random() < 0.7,
        max_model_len=rng.choice([64, 128, 256]),
        groups=rng.choice([1, 1, 2]),  # (two full-attention groups: a block id a group, freed group by group)
    )
    hooks.start(lk)
    prompts = [tuple(rng.randrange(1000) for _ in range(rng.randint(1, 60))) for _ in range(5)]
    live: list[str] = []
    freed: list[str] = []
    for t in range(ticks):
        op = rng.random()
        if op < 0.55:
            again = [p for p in freed if p not in live] if hooks.again else []
            pid = rng.choice(again) if again and rng.random() < hooks.again else f"p{t}"
            target = rng.randint(1, 40)
            rows = []
            for i in range(rng.choice([1, 2, 2, 3])):
                if rng.random() < 0.15:  # keyed by its caller's hashes, no ids (an embedding's prefix): a chain
                    p, k = rng.randint(0, 48), rng.randrange(3)  # (as far as the prefix: test_vllm_omni_worker.py)
                    rows.append((p, target, tuple(bytes([k, j]) * 16 for j in range(rng.randint(0, p // bs)))))
                    continue
                fresh = tuple(rng.randrange(1000) for _ in range(rng.randint(0, 20)))
                toks = rng.choice(prompts) if i == 0 or rng.random() < 0.5 else fresh
                rows.append((len(toks), target, toks))
            got = lk.reserve(pid, rows)
            if isinstance(got, list):
                live.append(pid)
                hooks.reserved(lk, pid)
        elif op < 0.75 and live:
            lk.publish(rng.choice(live))
        elif live:
            pid = live.pop(rng.randrange(len(live)))
            hooks.freeing(lk, pid)
            lk.free(pid)
            freed.append(pid)
    return lk


@pytest.mark.parametrize("seed", range(120))
def test_fuzzed_request_streams_leave_both_pools_alike(seed: int) -> None:
    fuzz(seed)


def test_pagedkv_refuses_at_admission_the_rows_the_worker_cannot_hold() -> None:
    """With the adapter's row limit (``diffusion_kv_max_rows_per_request``, which vLLM-Omni checks only when the worker
    installs the rows), a request of more CFG rows is refused at admission ("never", nothing changed), where
    vLLM-Omni's manager reserves its blocks for an install that will fail."""
    kw = dict(max_model_len=256, scheduler_block_size=8, hash_block_size=8, enable_prefix_caching=True)
    theirs = DiffusionKVCacheManager(kv_config(40, 8), **kw)
    ours = PagedKVDiffusionManager(kv_config(40, 8), max_rows_per_request=2, **kw)
    rows = [DiffusionKVRequest(f"a-{i}", sequence_id=i, prefix_len=8, target_len=8, seq_len=16) for i in range(3)]
    assert theirs.reserve_request("a", rows) is not None
    before = ours.state
    with pytest.raises(DiffusionKVAdmissionError, match="rows"):
        ours.reserve_request(
            "a",
            [
                DiffusionKVRequest(r.request_id, sequence_id=r.sequence_id, prefix_len=8, target_len=8, seq_len=16)
                for r in rows
            ],
        )
    assert ours.state is before and not ours.has_request("a")
    assert ours.reserve_request("a", rows[:2]) is not None


@pytest.mark.parametrize("ids", [list(range(16)), []], ids=["with ids", "without ids"])
def test_rows_keyed_by_their_callers_hashes_hit_as_vllm_omnis(ids: list[int]) -> None:
    """A row whose identity is more than its ids (here its caller gives its block hashes, as a multimodal row's
    are built, or an embedding's prefix that has no ids) is keyed by those hashes on both managers: under other
    hashes it misses, under the same hashes it hits; one hash keys one block."""
    kw = dict(max_model_len=256, scheduler_block_size=8, hash_block_size=8, enable_prefix_caching=True)
    managers = (DiffusionKVCacheManager(kv_config(40, 8), **kw), PagedKVDiffusionManager(kv_config(40, 8), **kw))
    image = [bytes([1]) * 32, bytes([2]) * 32]
    other = [bytes([3]) * 32, bytes([4]) * 32]
    for pid, given, cached in (("a", image, 0), ("b", other, 0), ("c", image, 16), ("d", other[:1], 8)):
        for m in managers:
            row = DiffusionKVRequest(
                f"{pid}-0",
                sequence_id=0,
                prefix_len=16,
                target_len=8,
                seq_len=24,
                cache_token_ids=ids,
                block_hashes=given,
            )
            md = m.reserve_request(pid, [row])
            assert md.sequences[0].cached_prefix_len == cached, (type(m).__name__, pid)
            m.publish_request(pid)
            m.free_request(pid)
    pool = managers[0].native_manager.block_pool
    assert list(free_queue(managers[1].state)) == [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_multimodal_rows_hit_as_vllm_omnis_by_their_images() -> None:
    """CFG rows whose prefixes carry an image's tokens (a multimodal feature: an identifier at an offset): the same
    ids with another image miss, with the same image hit, on both managers, block for block."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    kw = dict(max_model_len=256, scheduler_block_size=8, hash_block_size=8, enable_prefix_caching=True)
    managers = (DiffusionKVCacheManager(kv_config(48, 8), **kw), PagedKVDiffusionManager(kv_config(48, 8), **kw))
    ids = list(range(24))
    for pid, image, cached in (("a", "cat", 0), ("b", "dog", 8), ("c", "cat", 24)):
        for m in managers:
            rows = [
                DiffusionKVRequest(
                    f"{pid}-{i}",
                    sequence_id=i,
                    prefix_len=24,
                    target_len=8,
                    seq_len=32,
                    cache_token_ids=ids,
                    mm_features=[MultiModalFeatureSpec(None, "image", image, PlaceholderRange(offset=8, length=16))],
                )
                for i in range(2)
            ]
            md = m.reserve_request(pid, rows)
            assert [q.cached_prefix_len for q in md.sequences] == [cached] * 2, (type(m).__name__, pid)
            m.publish_request(pid)
            m.free_request(pid)
    pool = managers[0].native_manager.block_pool
    assert list(free_queue(managers[1].state)) == [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
