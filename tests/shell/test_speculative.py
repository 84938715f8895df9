"""Speculative decoding in the engine (issue 32): n-gram drafts verified in one forward give the tokens the
engine gives without them (greedy and seeded), batched, alone and through preemption; the verification is
the standard rejection rule; the proposer finds what a brute-force search finds; a recorded run replays."""

from __future__ import annotations

import io
import random
from array import array
from dataclasses import replace

import pytest
import torch

from pagedkv.core.config import InvalidConfig
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.core.verify.trace import replay
from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams, sample_batch
from pagedkv.shell.speculative import Speculation, SpeculativeConfig, accepted, lookup

CFG = replace(
    SMOLLM2_SHAPES,
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position=160,
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def model() -> object:
    torch.manual_seed(0)
    return random_llama(CFG)


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves (so drafts are found), of several lengths."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [r.randrange(1, CFG.vocab_size) for _ in range(r.randint(2, 6))]
        out.append((motif * 12)[: r.randint(8, 40)])
    return out


def _run(model: object, prompts: list[list[int]], params: SamplingParams, spec: object, **kw: object) -> tuple:
    eng = Engine(model, IdTokenizer(), speculative_config=spec, block_size=4, **kw)
    done = eng.generate([(f"p{i}", p, params) for i, p in enumerate(prompts)])
    assert not check_invariants(eng.state.kv)
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks and not eng.worker.rows  # everything back
    return [c.token_ids for c in done], [c.finish_reason for c in done], eng


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(max_tokens=40, temperature=0.9, seed=5),
        SamplingParams(max_tokens=40, temperature=1.3, top_k=8, top_p=0.9, seed=11),
    ],
)
def test_speculation_gives_the_tokens_decoding_gives_batched_and_alone(model: object, params: SamplingParams) -> None:
    prompts = _prompts(6, seed=1)
    want, reasons, _ = _run(model, prompts, params, None, max_num_seqs=8)
    got, got_reasons, eng = _run(model, prompts, params, NGRAM, max_num_seqs=8)
    assert got == want and got_reasons == reasons
    st = eng.stats
    assert st.verifies and 0 < st.accepted_tokens < st.draft_tokens  # drafts were taken and refused
    assert st.generated_tokens == sum(map(len, want))
    if not params.temperature:  # (the random model, greedy, repeats itself: drafts save steps)
        assert st.steps < _run(model, prompts, params, None)[2].stats.steps
    for p, w in zip(prompts, want):  # alone
        assert _run(model, [p], params, NGRAM)[0] == [w]


def test_speculation_through_preemption_and_a_small_budget(model: object) -> None:
    """A pool too small for every request at once preempts (by recompute); a token budget of 6 trims drafts."""
    prompts = _prompts(5, seed=2)
    params = SamplingParams(max_tokens=48, temperature=0.7, seed=3)
    want, _, ref = _run(
        model, prompts, params, None, kv_cache_memory_bytes=CFG_POOL, max_num_seqs=5, max_num_batched_tokens=64
    )
    got, _, eng = _run(
        model, prompts, params, NGRAM, kv_cache_memory_bytes=CFG_POOL, max_num_seqs=5, max_num_batched_tokens=64
    )
    assert got == want and eng.stats.preemptions and eng.stats.verifies
    small, _, _ = _run(model, prompts, params, NGRAM, max_num_batched_tokens=48, max_num_seqs=5)
    assert small == want


CFG_POOL = 2 * 4 * 2 * 32 * 4 * 2 * 40  # K and V, 2 layers, 2 heads of 32 (fp32), blocks of 4: 40 blocks


def test_verify_steps_go_one_query_token_a_row_where_the_buffers_hold_them(model: object) -> None:
    """A step of decodes and verifies runs the decode path (one query token a forward row: the decode kernel
    and its graphs); a rank without token rows runs them as varlen rows; both give decoding's tokens."""
    prompts = _prompts(4, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want, _, _ = _run(model, prompts, params, None, max_num_seqs=4)
    ref = Engine(model, IdTokenizer(), block_size=4, max_num_seqs=4)  # (a rank sized without speculation)
    for rank, flat in ((None, True), (ref.rank, False)):
        eng = Engine(model, IdTokenizer(), speculative_config=NGRAM, block_size=4, max_num_seqs=4, rank=rank)
        assert eng.worker.token_rows == (4 * 5 if flat else 0)
        laid: list[bool] = []
        install = eng.worker.install

        def spy(meta: object, token_rows: bool = False) -> object:
            laid.append(token_rows)
            return install(meta, token_rows=token_rows)  # type: ignore[arg-type]

        eng.worker.install = spy  # type: ignore[method-assign]
        done = eng.generate([(f"p{i}", p, params) for i, p in enumerate(prompts)])
        assert [c.token_ids for c in done] == want and eng.stats.verifies
        assert any(laid) is flat and len(laid) >= eng.stats.steps


def test_stop_tokens_and_max_tokens_cut_a_verify(model: object) -> None:
    prompts = _prompts(6, seed=4)
    for mt in (1, 2, 3, 7):
        params = SamplingParams(temperature=0.0, max_tokens=mt)
        assert _run(model, prompts, params, NGRAM)[0] == _run(model, prompts, params, None)[0]

    class StopAt(IdTokenizer):  # a stop token the random model samples now and then
        stop_token_ids = frozenset({7, 19, 33})

    for params in (
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(max_tokens=40, temperature=1.0, seed=2),
    ):
        runs = []
        for spec in (None, NGRAM):
            eng = Engine(model, StopAt(), speculative_config=spec, block_size=4, max_num_seqs=8)
            done = eng.generate([(f"p{i}", p, params) for i, p in enumerate(prompts)])
            runs.append([(c.token_ids, c.finish_reason) for c in done])
            assert eng.state.kv.free_blocks == eng.cache.usable_blocks
        assert runs[0] == runs[1] and any(r == "stop" for _, r in runs[0])


def test_verification_is_the_rejection_rule_for_a_point_mass_draft() -> None:
    """One position, a draft d: the draft is kept with probability p(d) and the token given out is drawn
    from p either way (p(d) kept, else p without d, renormalised), over 20,000 seeds."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0]] * 2)
    p = torch.softmax(logits[0], -1)
    n, draft = 20_000, 3
    params = SamplingParams(max_tokens=64, temperature=1.0)
    counts = torch.zeros(6)
    kept = 0
    for seeds in range(0, n, 1000):
        ids = sample_batch(
            logits.repeat(1000, 1),
            [params] * 2000,
            [s for s in range(seeds, seeds + 1000) for _ in (0, 1)],
            [0, 1] * 1000,
        ).tolist()
        for k in range(1000):
            toks = accepted([draft], ids[2 * k : 2 * k + 2])
            kept += len(toks) == 2
            counts[toks[0]] += 1
    freq = counts / n
    assert abs(kept / n - float(p[draft])) < 4 * (float(p[draft]) * (1 - float(p[draft])) / n) ** 0.5
    assert torch.all((freq - p).abs() < 4 * (p * (1 - p) / n).sqrt() + 1e-3), (freq, p)


def test_the_proposer_finds_the_latest_longest_earlier_ngram() -> None:
    def brute(ids: list[int], lo: int, hi: int, most: int) -> tuple[int, ...]:
        for n in range(min(hi, len(ids) - 1), lo - 1, -1):
            for i in range(len(ids) - n - 1, -1, -1):
                if ids[i : i + n] == ids[len(ids) - n :]:
                    return tuple(ids[i + n : i + n + most])
        return ()

    r = random.Random(0)
    for _ in range(3000):  # ids whose bytes match across id boundaries too (256, 65536 * k + 1)
        ids = [r.choice([1, 2, 3, 256, 257, 65536 * 3 + 1]) for _ in range(r.randint(1, 30))]
        lo = r.randint(1, 3)
        hi, most = r.randint(lo, 5), r.randint(1, 5)
        assert lookup(array("I", ids), lo, hi, most) == brute(ids, lo, hi, most)


def test_speculative_config_is_vllms_and_checked() -> None:
    assert SpeculativeConfig.of(None) is None
    assert SpeculativeConfig.of({"method": "ngram"}) == SpeculativeConfig()
    assert SpeculativeConfig.of('{"num_speculative_tokens": 2, "prompt_lookup_max": 1}') == SpeculativeConfig(
        "ngram", 2, 1, 1
    )
    for bad, says in (
        ({"method": "eagle"}, "not served"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"k": 1}, "unknown keys"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "above"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ):
        with pytest.raises(InvalidConfig, match=says):
            SpeculativeConfig.of(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match="not served"):  # the engine refuses it before it allocates
        Engine(random_llama(CFG), IdTokenizer(), speculative_config={"method": "mtp"})


def test_a_speculative_run_is_recorded_and_replays_digest_for_digest(model: object) -> None:
    trace = io.StringIO()
    eng = Engine(
        model,
        IdTokenizer(),
        speculative_config=NGRAM,
        block_size=4,
        trace=trace,
        max_num_seqs=4,
        kv_cache_memory_bytes=4 * CFG_POOL,
    )  # (a small pool: its digests and checks are quick)
    eng.generate(
        [(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=24)) for i, p in enumerate(_prompts(4, seed=6))]
    )
    eng.finish_trace()
    lines = trace.getvalue().splitlines()
    assert any('"drafts"' in line for line in lines) and any('"verify"' in line for line in lines)
    results = list(replay(lines, check=True))
    assert len(results) == len(lines) - 1
    assert all(r.result.get("ok") and r.divergence is None and not r.violations for r in results), results[-1]


def test_logits_rows_and_counters_follow_the_rows() -> None:
    class Row:
        def __init__(self, rid: str, start: int, end: int) -> None:
            self.request_id, self.kv_start_pos, self.seq_len = rid, start, end

    at, where = Speculation.logits_rows([Row("a", 0, 5), Row("b", 7, 10), Row("c", 3, 4)], {"b": (1, 2)}, base=2)
    assert at == [4, 5, 6, 7, 8] and where == {"a": 2, "b": 3, "c": 6}
