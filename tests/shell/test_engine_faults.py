"""The engine through the faults and misuse of issue 17: each case failed before its fix."""

from __future__ import annotations

import io
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import pagedkv.shell.runner as runner_module
from pagedkv.core.verify.invariants import check_invariants
from pagedkv.core.verify.trace import replay

from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
from pagedkv.shell.engine import Engine
from pagedkv.shell.sampling import SamplingParams
from tests.shell.handed import keep_handed

CFG = replace(
    SMOLLM2_SHAPES,
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position=32,
)


def test_requests_that_reach_max_model_len_end_as_length_and_give_their_rows_back() -> None:
    """Issue 17, defect 1: the scheduler ends such a request in plan.finished; the engine kept its worker
    row, so after max_num_seqs of them every install failed ("0 buffer rows free")."""
    eng = Engine(random_llama(CFG), IdTokenizer(), kv_cache_memory_bytes=1 << 20, max_num_seqs=2, block_size=4)
    prompts = [
        (f"p{i}", [(5 * i + j) % 300 for j in range(20)], SamplingParams(temperature=0.0, max_tokens=50))
        for i in range(5)
    ]
    done = eng.generate(prompts)
    for c in done:
        # 12 positions fit after the prompt; the last one's logits still give a 13th token (kept, never cached)
        assert c.finish_reason == "length" and len(c.token_ids) == 32 - 20 + 1 and c.text, c
    assert not eng.worker.rows and len(eng.worker.free_rows) == eng.worker.max_rows
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks
    (again,) = eng.generate([("q", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))])  # and it still serves
    assert len(again.token_ids) == 4


def test_the_default_seed_is_the_same_in_every_process() -> None:
    """Issue 17, defect 9: an unseeded request's seed came from ``hash(str(id))``, which PYTHONHASHSEED
    changes; now it is the id's CRC-32."""
    code = "from pagedkv.shell.sampling import SamplingParams, request_seed; print(request_seed('req-7', SamplingParams()))"
    seeds = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(h), "PATH": ""},
        ).stdout
        for h in (1, 2, 3)
    }
    assert len(seeds) == 1


def test_generated_ids_never_collide_with_given_ones() -> None:
    """Issue 17, defect 8 (ids): ``generate`` named its requests ``req-{len(requests)}``, so a waiting
    ``req-1`` given to ``add_request`` made it raise DUPLICATE_REQUEST, and a finished one had its
    completion replaced."""
    eng = keep_handed(Engine(random_llama(CFG), IdTokenizer(), kv_cache_memory_bytes=1 << 20, block_size=4))
    eng.add_request("req-1", "", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))
    first = eng.generate(
        [
            ("a", [4, 5], SamplingParams(temperature=0.0, max_tokens=2)),
            ("b", [6], SamplingParams(temperature=0.0, max_tokens=2)),
        ]
    )
    assert [c.request_id for c in first] == ["req-0", "req-2"] and len(eng.handed["req-1"].token_ids) == 3
    (more,) = eng.generate([("c", [7], SamplingParams(temperature=0.0, max_tokens=2))])
    assert more.request_id == "req-3" and eng.handed["req-0"] is first[0]


class Faulty:
    """A model (or, through ``where``, a worker install or a sampler) that raises on its ``at``-th call."""

    def __init__(self, model: object, at: int) -> None:
        self.model, self.at, self.calls = model, at, 0
        for name in ("config", "device", "dtype", "kv_layers"):
            setattr(self, name, getattr(model, name))

    def tick(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"injected fault at call {self.at}")

    def forward(self, *a: object) -> object:
        self.tick()
        return self.model.forward(*a)  # type: ignore[attr-defined]


PROMPTS = [
    (f"p{i}", [(7 * i + j) % 300 for j in range(3 + 4 * i)], SamplingParams(temperature=0.0, max_tokens=6 + i % 3))
    for i in range(6)
]
SMALL = dict(kv_cache_memory_bytes=14 * 1024, max_num_seqs=3, block_size=4, max_num_batched_tokens=16)


SAMPLED = [
    (
        f"s{i}",
        [(5 * i + j) % 300 for j in range(2 + 5 * i)],
        SamplingParams(max_tokens=5 + i % 4, temperature=0.9, top_p=0.9, seed=i),
    )
    for i in range(6)
]


def serve(
    model: object, faulty: Faulty | None = None, where: str = "forward", trace: object = None, prompts: list = PROMPTS
) -> Engine:
    eng = keep_handed(Engine(faulty if where == "forward" and faulty else model, IdTokenizer(), trace=trace, **SMALL))  # type: ignore[arg-type]
    if faulty is not None and where != "forward":
        target = {"install": (eng.worker, "install"), "sample": (runner_module, "sample_batch")}.get(where)
        if target is not None:
            obj, name = target
            real = getattr(obj, name)

            def hooked(*a: object, **k: object) -> object:
                faulty.tick()
                return real(*a, **k)

            setattr(obj, name, hooked)
    on_token = (lambda rid, tok: faulty.tick()) if faulty is not None and where == "callback" else None
    for rid, ids, p in prompts:
        eng.add_request(rid, "", ids, p)
    while eng.has_unfinished():
        eng.step(on_token)
    return eng


@pytest.fixture(scope="module")
def tiny() -> object:
    return random_llama(CFG, seed=5)


def test_a_fault_inside_a_step_fails_its_requests_and_the_engine_serves_on(tiny: object) -> None:
    """Issue 17, defect 2: an exception between schedule and on_output left the plan pending and every
    later step raised UnwrapFailedError; now the step's requests end with reason error and the rest run."""
    clean = serve(tiny)
    trace = io.StringIO()
    eng = serve(tiny, Faulty(tiny, at=3), trace=trace)
    eng.finish_trace()
    failed = [c for c in (eng.handed[rid] for rid, _, _ in PROMPTS) if c.finish_reason == "error"]
    assert failed and all("injected fault at call 3" in (c.error or "") for c in failed)
    for rid, _, _ in PROMPTS:
        c = eng.handed[rid]
        if c.finish_reason != "error":
            assert c.token_ids == clean.handed[rid].token_ids
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks and not eng.worker.rows
    assert all(
        r.result.get("error") is None and r.divergence is None and not r.violations
        for r in replay(trace.getvalue().splitlines(), check=True)
    )
    (again,) = eng.generate([("new", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))])
    assert len(again.token_ids) == 4 and again.finish_reason == "length"


@pytest.mark.slow
def test_two_hundred_injected_faults(tiny: object) -> None:
    """A fault at every call of the forward, the install, the sampler and the streaming callback, in a
    greedy and a seeded sampled workload, with a pool small enough to preempt: after each the invariants
    hold, the pool and the worker rows are whole when every request has ended, a request the fault did not
    end gives exactly its fault-free tokens, one it ended keeps only tokens the scheduler received, and the
    engine serves a new request."""
    faults = 0
    for prompts in (PROMPTS, SAMPLED):
        clean = serve(tiny, prompts=prompts)
        assert clean.stats.preemptions > 0
        want = {rid: clean.handed[rid].token_ids for rid, _, _ in prompts}
        for where in ("forward", "install", "sample", "callback"):
            count = Faulty(tiny, 0)
            serve(tiny, count, where, prompts=prompts)  # how many such calls a fault-free run makes
            for at in range(1, count.calls + 1):
                faulty = Faulty(tiny, at)
                eng = serve(tiny, faulty, where, prompts=prompts)
                faults += 1
                assert check_invariants(eng.state.kv) == []
                assert eng.state.kv.free_blocks == eng.cache.usable_blocks and not eng.worker.rows, (where, at)
                ended = [rid for rid, _, _ in prompts if eng.handed[rid].finish_reason == "error"]
                assert ended, (where, at)
                for rid, _, _ in prompts:
                    got = eng.handed[rid].token_ids
                    assert got == (want[rid][: len(got)] if rid in ended else want[rid]), (where, at, rid)
                faulty.at = 0  # no more faults
                (again,) = eng.generate([("new", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))])
                assert len(again.token_ids) == 3
    assert faults >= 200, faults
    print(f"{faults} injected faults")


def test_misuse_is_a_typed_error_and_changes_nothing(tiny: object) -> None:
    """Issue 17, defect 8: cancel of an unknown, finished or already cancelled id, a duplicate id, an empty
    prompt, max_tokens 0, a negative token id and one at or past the vocabulary (it reached the embedding)
    are each a ShellError with the core's code and message, and the engine's state is as it was."""
    from pagedkv.core.scheduler import sched_digest
    from pagedkv.shell.errors import ShellError

    eng = Engine(tiny, IdTokenizer(), kv_cache_memory_bytes=1 << 20, block_size=4)  # type: ignore[arg-type]
    eng.add_request("done", "", [1, 2], SamplingParams(temperature=0.0, max_tokens=2))
    while eng.has_unfinished():
        eng.step()
    eng.add_request("live", "", [3, 4], SamplingParams(temperature=0.0, max_tokens=2))
    eng.add_request("gone", "", [5], SamplingParams(temperature=0.0, max_tokens=2))
    eng.cancel("gone")
    before = sched_digest(eng.state)
    zero_tokens = SamplingParams(temperature=0.0, max_tokens=1)
    zero_tokens.max_tokens = 0  # (refused when built; set in place, as vLLM's params may be, refused when added)
    cases = [
        (lambda: eng.cancel("nobody"), "UNKNOWN_REQUEST"),
        (lambda: eng.cancel("done"), "UNKNOWN_REQUEST"),
        (lambda: eng.cancel("gone"), "UNKNOWN_REQUEST"),
        (lambda: eng.add_request("live", "", [1], SamplingParams(temperature=0.0, max_tokens=64)), "DUPLICATE_REQUEST"),
        (lambda: eng.add_request("e", "", [], SamplingParams(temperature=0.0, max_tokens=64)), "non-empty"),
        (lambda: eng.add_request("m", "", [1], zero_tokens), "max_tokens"),
        (lambda: eng.add_request("n", "", [-1], SamplingParams(temperature=0.0, max_tokens=64)), "INVALID"),
        (lambda: eng.add_request("v", "", [1, 300], SamplingParams(temperature=0.0, max_tokens=64)), "vocabulary"),
        (
            lambda: eng.generate(
                [
                    ("ok", [1], SamplingParams(temperature=0.0, max_tokens=64)),
                    ("v", [299, 300], SamplingParams(temperature=0.0, max_tokens=64)),
                ]
            ),
            "vocabulary",
        ),
    ]
    for call, says in cases:
        with pytest.raises(ShellError, match=says):
            call()
        assert sched_digest(eng.state) == before and set(eng.requests) == {"live"}  # (ended requests are not kept)


def test_a_forged_slot_cannot_write_into_another_requests_page() -> None:
    """Issue 17, defect 5: the worker took the snapshot's slot values as they came, so a slot inside
    another request's block made the K/V write overwrite that request's page (and string or out-of-range
    slots failed later, half-written). A slot must be where the row's block table puts its position:
    anything else is INVALID, and nothing is written."""
    from pagedkv.core import (
        CacheConfig,
        RequestSpec,
        RowSpec,
        admit,
        append_decode,
        commit_many,
        initial_state,
        publish,
    )
    from pagedkv.shell.errors import ShellError
    from pagedkv.shell.worker import Worker

    cfg = CacheConfig(block_size=4, num_blocks=9)
    s = initial_state(cfg)
    s = admit(s, RequestSpec("a", (RowSpec(4),))).unwrap().state
    s = admit(s, RequestSpec("b", (RowSpec(4),))).unwrap().state
    meta = publish(s, ["a", "b"], "prefill").unwrap().effect
    a, b = meta.rows
    d = append_decode(commit_many(s, [("a", [4]), ("b", [4])]).unwrap().state, ["a", "b"]).unwrap().state
    dec = publish(d, ["a", "b"], "decode").unwrap().effect
    w = Worker(cfg, max_rows=2, max_blocks_per_row=2, max_tokens=8)
    for forged in (
        replace(meta, rows=(a, replace(b, slots=a.slots[:3] + (a.slots[0],)))),  # into a's page
        replace(meta, rows=(a, replace(b, slots=b.slots[:3] + ("7",)))),  # not an integer
        replace(meta, rows=(a, replace(b, slots=b.slots[:3] + (-1,)))),
    ):
        before = [t.clone() for t in (w.row_tables, w.block_tables, w.seq_lens, w.slot_mapping, w.positions)]
        with pytest.raises(ShellError, match="is not the block table's"):
            w.install(forged)
        assert all(
            torch.equal(x, y)
            for x, y in zip(before, (w.row_tables, w.block_tables, w.seq_lens, w.slot_mapping, w.positions))
        )
        assert not w.rows and len(w.free_rows) == 2
    assert w.install(meta).slot_mapping.tolist() == [*a.slots, *b.slots]
    cols = dec.rows  # a decode forward's columns (the worker's fast path) are checked the same way
    from array import array

    bad = type(cols)(cols.request_ids, cols.block_ids, cols.seq_lens, array("q", [cols.slots[1], cols.slots[1]]))
    with pytest.raises(ShellError, match="is not the block table's"):
        w.install(replace(dec, rows=bad))
    assert w.install(dec).slot_mapping.tolist() == list(cols.slots)


def test_without_chunked_prefill_a_prompt_over_the_budget_runs_alone_and_the_buffers_hold_it(tiny: object) -> None:
    """Issue 17, defect 3: with chunked_prefill off the scheduler runs a prompt over max_num_batched_tokens
    alone in an otherwise empty step (documented in docs/scheduler.md); the worker's buffers were sized to
    the budget, so such a step could not be installed. Now they hold a whole prompt."""
    eng = Engine(
        tiny,
        IdTokenizer(),
        kv_cache_memory_bytes=1 << 20,
        block_size=4,
        max_num_batched_tokens=8,
        chunked_prefill=False,
    )  # type: ignore[arg-type]
    assert eng.state.config.chunked_prefill is False and eng.worker.max_tokens >= CFG.max_position
    long, short = [(i * 3) % 300 for i in range(20)], [1, 2, 3]
    done = eng.generate(
        [
            ("long", long, SamplingParams(temperature=0.0, max_tokens=3)),
            ("short", short, SamplingParams(temperature=0.0, max_tokens=3)),
        ]
    )
    assert [len(c.token_ids) for c in done] == [3, 3]
    ref = Engine(tiny, IdTokenizer(), kv_cache_memory_bytes=1 << 20, block_size=4)  # type: ignore[arg-type]
    assert [c.token_ids for c in done] == [
        c.token_ids
        for c in ref.generate(
            [
                ("long", long, SamplingParams(temperature=0.0, max_tokens=3)),
                ("short", short, SamplingParams(temperature=0.0, max_tokens=3)),
            ]
        )
    ]
