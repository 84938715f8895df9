"""KV events in vLLM's wire format: the bytes equal those vLLM 0.33's own msgspec types encode for the
same events (tests/integrations/data/vllm_events.msgpack, written by tests/integrations/data/make_vllm_events_golden.py where vLLM
is installed), vLLM's decoder reads them where vLLM is here, and the int64 hashes are stable across
processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("msgspec", reason="vLLM's event format needs msgspec (pip install 'pagedkv[vllm]')")

from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, commit, initial_state  # noqa: E402
from pagedkv.integrations.vllm.events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode,
    encode,
    int64_hash,
    to_vllm,
    to_vllm_batch,
)
from tests.integrations.vllm_events_scenario import CONFIG, events  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "vllm_events.msgpack"
ROOT = Path(__file__).resolve().parents[2]


def batch() -> object:
    return to_vllm_batch(events(), CONFIG, ts=1700000000.25, data_parallel_rank=0)


def test_the_bytes_are_the_ones_vllms_types_encode() -> None:
    wire = encode(batch())  # type: ignore[arg-type]
    assert wire == GOLDEN.read_bytes()
    assert decode(wire) == batch()


def test_what_the_events_say() -> None:
    b = batch()
    kinds = [type(e).__name__ for e in b.events]  # type: ignore[attr-defined]
    assert kinds == ["BlockStored"] * 2 + ["BlockRemoved"] * 4 + ["BlockStored"] * 2 + ["AllBlocksCleared"]
    full, window = b.events[:2]  # type: ignore[attr-defined]
    assert (full.group_idx, full.kv_cache_spec_kind, full.kv_cache_spec_sliding_window) == (0, "full_attention", None)
    assert (window.group_idx, window.kv_cache_spec_kind, window.kv_cache_spec_sliding_window) == (
        1,
        "sliding_window",
        8,
    )
    assert full.block_hashes == window.block_hashes and len(full.block_hashes) == 3  # one chain, one event a group
    assert full.token_ids == list(range(12)) and full.parent_block_hash is None and full.block_size == 4
    assert full.medium == "GPU" and full.lora_id is None


def test_a_chain_continues_from_its_parent() -> None:
    cfg = CacheConfig(block_size=2, num_blocks=9, enable_prefix_caching=True)
    s = admit(initial_state(cfg), RequestSpec("a", (RowSpec.of_tokens([1, 2, 3, 4, 5]),))).unwrap().state
    first = commit(s, "a", [2]).unwrap()
    second = commit(first.state, "a", [4]).unwrap()
    (a,) = to_vllm(first.effect.events, cfg)
    (b,) = to_vllm(second.effect.events, cfg)
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored)
    assert b.parent_block_hash == a.block_hashes[-1] and b.token_ids == [3, 4]
    assert isinstance(to_vllm([first.effect.events[0], *second.effect.events], cfg)[0], BlockStored)
    assert len(to_vllm([*first.effect.events, *second.effect.events], cfg)) == 1  # one chain: merged


def test_int64_hashes_are_stable_across_processes() -> None:
    here = [e.block_hashes for e in batch().events if not isinstance(e, AllBlocksCleared)]  # type: ignore[attr-defined]
    code = (
        "from tests.integrations.vllm_events_scenario import CONFIG, events; "
        "from pagedkv.integrations.vllm.events import to_vllm; "
        "print([e.block_hashes for e in to_vllm(events(), CONFIG) if hasattr(e, 'block_hashes')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    )
    assert out.stdout.strip() == str(here)
    assert (
        all(0 <= h < 2**64 for hs in here for h in hs) and int64_hash(b"\x00" * 8 + b"\x01" * 8) == 0x0101010101010101
    )
    assert isinstance(batch().events[2], BlockRemoved)  # type: ignore[attr-defined]


def test_vllms_own_decoder_reads_them() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed here")
    import msgspec

    theirs = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(encode(batch()))  # type: ignore[arg-type]
    ours = batch()
    assert [type(e).__name__ for e in theirs.events] == [type(e).__name__ for e in ours.events]  # type: ignore[attr-defined]
    assert [msgspec.structs.asdict(e) for e in theirs.events] == [msgspec.structs.asdict(e) for e in ours.events]  # type: ignore[attr-defined]


def test_zmq_loopback_every_batch_in_order_and_replay_of_the_missed() -> None:
    """A subscriber decoding with vLLM's event types (ours where vLLM is absent: the same bytes) gets every
    batch in order; a replay request from a sequence number returns the batches from there on, then the
    end marker, as vLLM's replay socket does."""
    zmq = pytest.importorskip("zmq", reason="publishing needs pyzmq (pip install 'pagedkv[vllm]')")
    import msgspec

    from pagedkv.integrations.vllm.publish import END_SEQ, ZmqEventPublisher

    try:
        from vllm.distributed.kv_events import KVEventBatch as Batch  # the consumer's own types, where vLLM is
    except ImportError:
        from pagedkv.integrations.vllm.events import KVEventBatch as Batch
    decoder = msgspec.msgpack.Decoder(Batch)
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv", buffer_steps=4)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    try:
        import time

        time.sleep(0.3)  # the slow-joiner: a SUB sees only what is sent after it joined
        sent = []
        for k in range(6):
            b = to_vllm_batch(events(), CONFIG, ts=float(k))
            sent.append(b)
            pub.publish(b)
        got = []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while len(got) < 6 and poller.poll(5000):
            topic, seq, payload = sub.recv_multipart()
            got.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
        assert [(t, s) for t, s, _ in got] == [(b"kv", k) for k in range(6)]  # every batch, in order
        assert [b.ts for _, _, b in got] == [float(k) for k in range(6)]
        assert all(b.data_parallel_rank == 0 for _, _, b in got)  # filled in, as vLLM's publisher does
        assert [type(e).__name__ for e in got[0][2].events] == [type(e).__name__ for e in sent[0].events]
        req = ctx.socket(zmq.DEALER)
        req.connect(pub.replay_endpoint)
        req.send_multipart((b"", (3).to_bytes(8, "big")))  # "I missed everything from seq 3"
        replies = []
        while req.poll(5000):
            frames = req.recv_multipart()
            replies.append(frames)
            if frames[2] == END_SEQ:
                break
        assert [int.from_bytes(f[2], "big") for f in replies[:-1]] == [3, 4, 5]
        assert [decoder.decode(f[3]).ts for f in replies[:-1]] == [3.0, 4.0, 5.0]
        assert replies[-1] == [b"", b"", END_SEQ, b""]
        req.send_multipart((b"", (0).to_bytes(8, "big")))  # older than the 4 kept: what is left, from 2
        kept = []
        while req.poll(5000):
            frames = req.recv_multipart()
            if frames[2] == END_SEQ:
                break
            kept.append(int.from_bytes(frames[2], "big"))
        assert kept == [2, 3, 4, 5]
        req.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pub.publish(sent[0])


def test_the_engine_hands_each_steps_events_to_a_publisher() -> None:
    """A tiny random Llama through the engine with prefix caching: the events it hands on, replayed into an
    index of (group, hash), end with the core's own prefix cache; over ZMQ they arrive as vLLM batches."""
    pytest.importorskip("zmq", reason="publishing needs pyzmq (pip install 'pagedkv[vllm]')")
    from pagedkv.core.outputs.events import AllBlocksCleared as Cleared
    from pagedkv.core.outputs.events import BlockRemoved as Removed
    from pagedkv.core.outputs.events import BlockStored as Stored
    from pagedkv.models.gguf import LlamaConfig
    from pagedkv.models.llama import IdTokenizer, random_llama
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.sampling import SamplingParams

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        max_position=256,
    )
    steps: list[tuple[object, ...]] = []
    eng = Engine(
        random_llama(cfg),
        IdTokenizer(),
        block_size=4,
        kv_cache_memory_bytes=10 * 1024,  # 9 blocks
        max_num_seqs=2,
        on_kv_events=steps.append,
    )
    prompts = [list(range(1, 18)), list(range(1, 14)) + [40, 41], list(range(30, 52))]
    eng.generate([(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=6)) for i, p in enumerate(prompts)])
    index: dict[tuple[int, bytes], int] = {}
    for evs in steps:
        for e in evs:
            if isinstance(e, Stored):
                index[(e.group, e.block_hash)] = e.block_id
            elif isinstance(e, Removed):
                del index[(e.group, e.block_hash)]
            elif isinstance(e, Cleared):
                index.clear()
    assert index == dict(eng.state.kv.cache.items()) and index  # the stream is the cache, step by step
    assert any(isinstance(e, Removed) for evs in steps for e in evs)  # the small pool evicted

    from pagedkv.integrations.vllm.publish import ZmqEventPublisher, hook

    pub = ZmqEventPublisher("tcp://127.0.0.1:0", buffer_steps=64)
    send = hook(pub, eng.cache)
    for evs in steps:
        send(evs)  # type: ignore[arg-type]
    import time

    deadline = time.time() + 5
    while len(pub._buffer) < len(steps) and time.time() < deadline:  # noqa: SLF001 - sent by the thread
        time.sleep(0.01)
    assert [s for s, _ in pub._buffer] == list(range(len(steps)))  # noqa: SLF001
    assert all(decode(p).events for _, p in pub._buffer)  # noqa: SLF001
    pub.shutdown()


TIER = CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True, host_blocks=1)


def tier_events() -> list[object]:
    """A host tier of one block (core/store/host.py): a's third block evicted to it, then dropped for b's, then loaded
    back for c (b's prompt again): offloads, a removal from the tier, a load."""
    from pagedkv.core import release

    s = initial_state(TIER)
    out: list[object] = []
    for rid, toks in (("a", range(1, 14)), ("b", range(100, 113)), ("c", range(200, 213)), ("d", range(100, 113))):
        step = admit(s, RequestSpec(rid, (RowSpec.of_tokens(list(toks)),))).unwrap()
        out += step.effect.events
        s = release(commit(step.state, rid, [13]).unwrap().state, rid, "finished").unwrap().state
    return out


def test_the_host_tiers_events_go_out_as_vllms_cpu_tier_sends_them() -> None:
    """Against vLLM's own offloading connector events tracker where vLLM is installed: the same ``BlockStored`` and
    ``BlockRemoved`` (``medium="CPU"``, the hash and group alone), field for field; a load is announced by nobody."""
    from pagedkv.core.outputs.events import BlockOffloaded, BlockOnloaded, HostBlockRemoved

    core = tier_events()
    host = [e for e in core if isinstance(e, (BlockOffloaded, HostBlockRemoved))]
    assert any(isinstance(e, BlockOnloaded) for e in core) and {type(e) for e in host} == {
        BlockOffloaded,
        HostBlockRemoved,
    }
    ours = [e for e in to_vllm(core, TIER) if getattr(e, "medium", None) == "CPU"]
    assert len(ours) == len(host)  # (each alone: no two removals of the tier in a row here)
    assert all(e.block_size == 0 and e.token_ids == [] for e in ours if isinstance(e, BlockStored))
    base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed here")
    tracking = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading.events")
    import msgspec

    tracker = tracking.OffloadingEventsTracker(base.OffloadingKVEventsConfig(True, False))
    raw = [
        base.OffloadingEvent(
            keys=[base.make_offload_key(e.block_hash, e.group)],
            medium=base.Medium.CPU,
            removed=isinstance(e, HostBlockRemoved),
        )
        for e in host
    ]
    theirs = list(tracker.take_events(raw))
    assert [type(e).__name__ for e in theirs] == [type(e).__name__ for e in ours]
    assert [msgspec.structs.asdict(e) for e in theirs] == [msgspec.structs.asdict(e) for e in ours]
