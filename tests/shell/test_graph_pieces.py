"""``graph_pieces``: how the engine cuts a prefill forward that no captured bucket holds into pieces that one does
(issue 48: such forwards ran eagerly, 60-73 ms a step on an H200). Checked on the scheduler's own snapshots; the
GPU test (tests/gpu/test_triton.py) replays the pieces and compares tokens."""

from __future__ import annotations

from pagedkv.core import CacheConfig
from pagedkv.core.outputs.metadata import KVMetadata, Phase
from pagedkv.core.scheduler import SchedulerConfig, SeqRequest, new_scheduler, schedule, submit
from pagedkv.shell.runner import FLAT_READS, graph_pieces


def prefill(lengths: list[int], cached: int = 0) -> KVMetadata:
    """The one prefill snapshot of a step that takes in prompts of ``lengths`` (after a first request of ``cached``
    tokens ran, where given, so later rows read its blocks too)."""
    s = new_scheduler(
        CacheConfig(block_size=16, num_blocks=2048), SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192)
    )
    for i, n in enumerate(lengths):
        s = submit(s, SeqRequest(f"r{i}", tuple(range(7 * i, 7 * i + n)), max_tokens=4)).unwrap()
    _, plan = schedule(s).unwrap()
    (meta,) = [m for m in plan.metadata if m.phase is Phase.PREFILL]
    assert [r.query_len for r in meta.rows] == lengths
    return meta


def rows_of(pieces: list[KVMetadata]) -> list[object]:
    return [r for p in pieces for r in p.rows]


def test_a_forward_a_bucket_holds_is_one_piece() -> None:
    meta = prefill([100, 200, 212])
    assert graph_pieces(meta, 512) == [meta]


def test_requests_over_the_bucket_are_cut_between_them_in_order() -> None:
    lengths = [100, 105, 110, 115, 120, 125, 130, 135]  # 940 tokens
    meta = prefill(lengths)
    pieces = graph_pieces(meta, 512)
    assert rows_of(pieces) == list(meta.rows)  # every row once, in order: cut between requests only
    assert [[r.query_len for r in p.rows] for p in pieces] == [lengths[:4], lengths[4:]]  # 430 + 510
    assert all(p.num_query_tokens <= 512 for p in pieces)
    assert all(
        (p.generation, p.epoch, p.block_size, p.phase) == (meta.generation, meta.epoch, 16, Phase.PREFILL)
        for p in pieces
    )
    for a, b in zip(pieces, pieces[1:]):  # greedy: a piece ends only where the next row would not fit
        assert a.num_query_tokens + b.rows[0].query_len > 512


def test_a_row_no_bucket_takes_keeps_the_forward_whole() -> None:
    meta = prefill([100, 600, 50])
    assert graph_pieces(meta, 512) == [meta]


def test_reads_bound_a_piece_too() -> None:
    meta = prefill([300, 300, 300])  # each row reads 300 x 300 keys
    most = 4096
    pieces = graph_pieces(meta, most)
    assert all(sum(r.query_len * r.seq_len for r in p.rows) <= FLAT_READS for p in pieces)
    assert len(pieces) == (1 if 3 * 300 * 300 <= FLAT_READS else 2)
    big = prefill([1100, 1100])  # 1,210,000 reads a row: over FLAT_READS alone
    assert graph_pieces(big, most) == [big]


def test_no_graph_bucket_holds_more_rows_than_a_step_carries_tokens(smollm2: tuple[object, dict[str, object]]) -> None:
    """A decode bucket's rows are its tokens: with ``max_num_seqs`` 48 and 16 tokens a step, buckets stop at 16 (the
    48-row bucket's capture read 16 positions: a batch-invariant engine on the H200 failed at start-up)."""
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.graphs import GraphDecoder, buckets_for

    model, meta = smollm2
    eng = Engine(model, Tokenizer(meta), kv_cache_memory_bytes=8 << 20, max_num_seqs=48, max_num_batched_tokens=16)  # type: ignore[arg-type]
    assert GraphDecoder(model, eng.rank, eng.backend, buckets_for(48)).buckets == (1, 2, 4, 8, 16)
    wide = Engine(model, Tokenizer(meta), kv_cache_memory_bytes=8 << 20, max_num_seqs=48)  # type: ignore[arg-type]
    assert GraphDecoder(model, wide.rank, wide.backend, buckets_for(48)).buckets == buckets_for(48)


def decodes(meta: KVMetadata, n: int, seq_len: int) -> KVMetadata:
    """A decode snapshot of ``n`` rows of ``seq_len`` keys beside ``meta`` (its generation and epoch)."""
    from array import array

    from pagedkv.core.outputs.metadata import DecodeRows

    rows = DecodeRows(tuple(f"d{i}" for i in range(n)), ((1,),) * n, array("q", [seq_len] * n), array("q", range(n)))
    return KVMetadata(meta.generation, meta.epoch, meta.block_size, Phase.DECODE, rows)


def test_a_steps_decodes_ride_in_its_first_prefill_forward_that_holds_them() -> None:
    """``ride_along``: the decode rows lead the first prefill piece with room for them (every row once, in order),
    the decode forward gone; over the bucket or the reads, or of another generation, nothing rides."""
    from dataclasses import replace

    from pagedkv.shell.runner import ride_along

    lengths = [100, 105, 110, 115, 120, 125, 130, 135]
    pieces = graph_pieces(prefill(lengths), 512)  # 430 + 510 tokens
    d = decodes(pieces[0], 30, 200)
    out = ride_along([d, *pieces], 512)
    assert [lead for _, lead in out] == [d, None] and len(out) == 2
    assert list(out[0][0].rows) == [*d.rows, *pieces[0].rows] and out[1][0] == pieces[1]
    assert out[0][0].phase is Phase.PREFILL and out[0][0].num_query_tokens == 460
    full = decodes(pieces[0], 90, 200)  # (90 + 430 > 512, 90 + 510 too)
    assert ride_along([full, *pieces], 512) == [(full, None), *((p, None) for p in pieces)]
    long = decodes(pieces[0], 30, FLAT_READS // 30)  # (their reads fill the bound alone)
    assert all(lead is None for _, lead in ride_along([long, *pieces], 512))
    stale = replace(d, generation=d.generation + 1)
    assert all(lead is None for _, lead in ride_along([stale, *pieces], 512))
    assert ride_along([d], 512) == [(d, None)]
    # a forward that runs eagerly alone (over the bucket, or over the reads) holds them within ``eager`` tokens
    big = prefill([600])
    d, long = decodes(big, 30, 200), decodes(big, 30, FLAT_READS // 30)
    assert ride_along([d, big], 512) == [(d, None), (big, None)]  # (no eager room given: nothing rides)
    ((merged, lead),) = ride_along([d, big], 512, eager=630)
    assert lead is d and list(merged.rows) == [*d.rows, *big.rows] and merged.num_query_tokens == 630
    assert ride_along([d, big], 512, eager=629) == [(d, None), (big, None)]  # (630 tokens: over it)
    assert all(lead is None for _, lead in ride_along([full, *pieces], 512, eager=8192))  # (each piece replays)
    ((merged, lead),) = ride_along([long, big], 512, eager=8192)  # (reads: no bound where it runs eagerly)
    assert lead is long and merged.num_query_tokens == 630


def test_decode_rows_riding_in_an_eager_prompt_forward_get_their_own_tokens() -> None:
    """The CPU engine (no graphs: every forward eager) takes a prompt in while other rows decode: the step runs
    one forward, the decode rows leading the prompt's (``ride_along``'s eager room), and every request gets the
    tokens, finish reasons and logprobs it gets with nothing riding (the same schedule, two forwards a step)."""
    import pytest
    import torch

    from pagedkv.models.llama import IdTokenizer, random_llama
    from pagedkv.shell import runner
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.sampling import SamplingParams
    from tests.shell.test_speculative import CFG, _prompts

    torch.manual_seed(0)
    model = random_llama(CFG)
    prompts = _prompts(6, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)

    def serve(ride: bool) -> tuple[list[object], int]:
        rode = 0
        real = runner.ride_along

        def spy(forwards: list[KVMetadata], most: int, eager: int = 0) -> list[tuple[KVMetadata, object]]:
            nonlocal rode
            out = real(forwards, most, eager) if ride else [(f, None) for f in forwards]
            rode += any(lead is not None for _, lead in out)
            return out

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(runner, "ride_along", spy)
            eng = Engine(model, IdTokenizer(), block_size=4, kv_cache_memory_bytes=1 << 20, max_num_seqs=8)
            done = []
            for i, p in enumerate(prompts):  # (one arrives every other step: it is taken in while others decode)
                eng.add_request(f"p{i}", "", p, greedy)
                done += eng.step()
                done += eng.step()
            while eng.has_unfinished():
                done += eng.step()
        assert eng.state.kv.free_blocks == eng.cache.usable_blocks and not eng.worker.rows  # everything back
        got = sorted(
            (c.request_id, c.token_ids, c.finish_reason, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
            for c in done
        )
        return got, rode

    want, none = serve(False)
    got, rode = serve(True)
    assert none == 0 and rode >= 4, rode  # (a step took a prompt in beside decoding rows: it rode)
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert all(abs(a - b) < 1e-4 for g, w in zip(got, want) for a, b in zip(g[3], w[3]))
