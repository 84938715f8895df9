"""Issue 29, part 5: every integer field bounded where it is read, typed failures everywhere: the core's
transitions, its lookup, replay and the worker answer a refusal (or nothing, for a lookup) to inputs no
engine sends, never an exception, and the state is as it was."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from returns.result import Failure

from pagedkv.app.cli import main
from pagedkv.core import (
    CacheConfig,
    RequestSpec,
    RowSpec,
    admit,
    append,
    append_many,
    commit,
    decode_step,
    digest,
    initial_state,
    publish,
)
from pagedkv.core.rules.prefix import find_hit
from pagedkv.shell.errors import ShellError
from pagedkv.shell.worker import Worker

HUGE = 10**5000  # past Python's 4,300-digit limit for str(int): a message that formats it raises


def state() -> Any:
    s = initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True))
    return admit(s, RequestSpec("a", (RowSpec.of_tokens([1, 2, 3]),))).unwrap().state


@pytest.mark.parametrize(
    "call",
    [
        lambda s: append(s, "a", [HUGE]),
        lambda s: append(s, "a", [-HUGE]),
        lambda s: append_many(s, [("a", [HUGE])]),
        lambda s: append(s, "a", [[HUGE]]),
        lambda s: commit(s, "a", [HUGE]),
        lambda s: decode_step(s, ["a"], [HUGE]),
        lambda s: admit(s, RequestSpec("b", (RowSpec(8, prefix_len=10**4400, target_len=10**4400),))),
        lambda s: admit(s, RequestSpec("b", (RowSpec(8, spans=((10**4400, 10**4401),)),))),
        lambda s: admit(s, RequestSpec("b", (RowSpec(8, spans=((HUGE, HUGE, 3),)),))),
        lambda s: admit(s, RequestSpec("b", (RowSpec(HUGE),))),
        lambda s: admit(s, RequestSpec("b", (RowSpec(4, tokens=(-1, 2, 3, 4)),))),
    ],
)
def test_huge_and_negative_integers_are_refused_with_a_message(call: Any) -> None:
    s = state()
    before = digest(s)
    result = call(s)
    assert result.failure().code.value == "INVALID" and result.failure().message
    assert digest(s) == before


def test_a_lookup_of_ids_no_admission_takes_finds_nothing() -> None:
    s = state()
    for tokens in ((-1, 2, 3, 4, 5), (HUGE, 2, 3, 4, 5), (1.5, 2, 3, 4, 5)):
        assert find_hit(s, RequestSpec("b", (RowSpec(5, tokens=tokens),))).num_blocks == 0  # type: ignore[arg-type]


def test_replay_of_4300_digit_diffusion_lengths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An admit (and a submit) whose prefix_len and target_len have 4,300 digits each: a typed refusal."""
    big = "1" * 4300
    header = {"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9}}
    row = '{"num_tokens": 8, "prefix_len": ' + big + ', "target_len": ' + big + "}"
    lines = [json.dumps(header), '{"op": "admit", "request": "a", "rows": [' + row + "]}"]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[0])
    assert out["error"]["code"] == "INVALID"
    sched = {"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9}, "scheduler": {}}
    lines = [json.dumps(sched), '{"op": "submit", "request": "a", "rows": [' + row + '], "steps": 2}']
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["error"]["code"] == "INVALID"


@pytest.mark.parametrize(
    "field, value",
    [
        ("seq_len", 4.0),
        ("query_len", 4.0),
        ("kv_start_pos", 0.0),
        ("seq_len", HUGE),
        ("row", "0"),
        ("block_ids", 5),
        ("slots", None),
        ("segments", None),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_the_worker_refuses_malformed_rows_and_writes_nothing(field: str, value: Any) -> None:
    cfg = CacheConfig(block_size=4, num_blocks=9)
    s = admit(initial_state(cfg), RequestSpec("a", (RowSpec(4),))).unwrap().state
    meta = publish(s, ["a"], "prefill").unwrap().effect
    w = Worker(cfg, max_rows=2, max_blocks_per_row=2, max_tokens=8)
    with pytest.raises(ShellError, match="INVALID"):
        w.install(replace(meta, rows=(replace(meta.rows[0], **{field: value}),)))
    assert not w.rows and len(w.free_rows) == 2
    for name, bad in (("generation", 1.0), ("generation", HUGE), ("epoch", "0")):
        with pytest.raises(ShellError, match="INVALID"):
            w.install(replace(meta, **{name: bad}))
    assert w.install(meta).num_rows == 1


# Issue 45: wrong container types reached raw exceptions (or were read as something else: a str as its
# characters' ids, ``Placeholders(2)`` as a count, a NaN or negative reserve as room), and checks were
# ``assert``s that ``python -O`` strips. Every value below is refused as a typed INVALID (or, for ids, as
# UNKNOWN_REQUEST), the state unchanged, under -O too (``test_the_refusals_hold_under_python_O``).
WRONG = [
    None,
    1,
    -1,
    "ab",
    "a",
    b"a",
    1.5,
    float("nan"),
    [None],
    ["a"],
    [[None]],
    {"a": 1},
    True,
    [["a"]],
    [1.5],
    {"a"},
    object(),
]


def _calls(s: Any) -> dict[str, Any]:
    from pagedkv.core import (
        Placeholders,
        cache_ahead_many,
        commit_decode,
        commit_many,
        fill,
        fill_many,
        release,
        release_many,
        truncate,
        truncate_many,
    )

    return {
        "admit reserve": lambda v: admit(s, RequestSpec("b", (RowSpec.of_tokens([1, 2]),)), reserve=v),
        "admit spec": lambda v: admit(s, v),
        "append rows": lambda v: append(s, "a", v),
        "append Placeholders": lambda v: append(s, "a", Placeholders(2)),
        "append_many": lambda v: append_many(s, v),
        "decode ids": lambda v: decode_step(s, v, [1]),
        "decode tokens": lambda v: decode_step(s, ["a"], v),
        "commit": lambda v: commit(s, "a", v),
        "commit_many": lambda v: commit_many(s, v),
        "commit_decode": lambda v: commit_decode(s, v),
        "release reason": lambda v: release(s, "a", v),
        "release_many": lambda v: release_many(s, v, "finished"),
        "publish ids": lambda v: publish(s, v, "prefill"),
        "publish phase": lambda v: publish(s, ["a"], v),
        "publish limits": lambda v: publish(s, ["a"], "prefill", query_limits=v),
        "fill": lambda v: fill(s, "a", v),
        "fill_many": lambda v: fill_many(s, v),
        "truncate": lambda v: truncate(s, "a", v),
        "truncate_many": lambda v: truncate_many(s, v),
        "cache_ahead_many": lambda v: cache_ahead_many(s, v),
    }


# (call, value) pairs of WRONG that are right for that call: request "a" named in a list, a reserve of 1, no
# token ids (a count), no query limits or a mapping of them
VALID = {
    ("admit reserve", "1"),
    ("publish limits", "None"),
    ("publish limits", "{'a': 1}"),
    ("decode tokens", "None"),
    ("decode ids", "['a']"),
    ("commit_decode", "['a']"),
    ("publish ids", "['a']"),
    ("release_many", "['a']"),
}


@pytest.mark.parametrize("name", list(_calls(None)))
def test_every_wrong_type_is_a_typed_refusal_with_the_state_unchanged(name: str) -> None:
    s = state()
    before, call = digest(s), _calls(s)[name]
    for v in WRONG:
        try:
            result = call(v)
        except Exception as e:  # noqa: BLE001 - the point: none may escape
            raise AssertionError(f"{name}({v!r:.40}) raised {type(e).__name__}: {e}") from None
        if (name, repr(v)) in VALID:
            assert result.unwrap() is not None, (name, v)
            continue
        assert isinstance(result, Failure), (name, v)
        assert result.failure().code.value in ("INVALID", "UNKNOWN_REQUEST"), (name, v, result)
        assert digest(s) == before, (name, v)


def test_a_reserve_that_is_not_a_count_never_hands_out_the_null_block() -> None:
    """``admit(reserve=-1)`` once passed the capacity check with one block short: AssertionError in the pool,
    and under ``python -O`` the null block 0 handed out and ``free_blocks`` at -1."""
    s = initial_state(CacheConfig(block_size=4, num_blocks=3))  # two usable blocks
    for reserve in (-1, float("nan"), 0.5, True):
        err = admit(s, RequestSpec("a", (RowSpec(12),)), reserve=reserve).failure()  # (three blocks: one short)
        assert err.code.value == "INVALID" and err.field == "reserve", reserve
    assert admit(s, RequestSpec("a", (RowSpec(12),))).failure().code.value == "UNSCHEDULABLE"


def test_more_groups_than_the_prefix_index_keeps_is_an_invalid_config() -> None:
    from pagedkv.core import GroupSpec, InvalidConfig

    CacheConfig(block_size=4, num_blocks=9, groups=tuple(GroupSpec(f"g{i}") for i in range(64)))
    with pytest.raises(InvalidConfig, match="at most 64 KV cache groups"):
        CacheConfig(block_size=4, num_blocks=9, groups=tuple(GroupSpec(f"g{i}") for i in range(65)))


def test_the_scheduler_refuses_wrong_types_and_outputs_for_requests_outside_the_plan() -> None:
    """``on_output`` once took tokens and endings for requests the plan did not sample (ignored in silence) and
    raised on a non-mapping; ``on_tokens`` ended a prefilling request with an InvariantError."""
    from pagedkv.core.scheduler import (
        SchedulerConfig,
        SeqRequest,
        new_scheduler,
        on_output,
        on_tokens,
        sched_digest,
        schedule,
        submit,
    )

    st = new_scheduler(CacheConfig(block_size=4, num_blocks=9), SchedulerConfig(max_num_seqs=4))
    st = submit(submit(st, SeqRequest("a", (1, 2, 3), max_tokens=3)).unwrap(), SeqRequest("w", (9,) * 32)).unwrap()
    st, plan = schedule(st).unwrap()
    assert plan.samples == ("a",) and "w" in st.live  # (w waits: the pool holds 8 blocks)
    before = sched_digest(st)
    cases = [(on_output, v, ()) for v in WRONG if not isinstance(v, dict)]
    cases += [(on_output, {"a": 5}, v) for v in ("a", "ab", 1, None, [["a"]], b"a")]
    cases += [
        (on_output, {"a": 5, "w": 6}, ()),
        (on_output, {"a": 5, "nobody": 6}, ()),
        (on_output, {"a": 5}, ["w"]),
        (on_tokens, {"a": 5}, ()),
        (on_tokens, {}, ["a"]),
        (on_tokens, [], ()),
        (on_tokens, {}, "a"),
    ]
    for fn, sampled, finished in cases:
        try:
            result = fn(st, sampled, finished)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"{fn.__name__}({sampled!r:.30}, {finished!r:.30}) raised {e!r}") from None
        assert result.failure().code.value == "INVALID", (fn.__name__, sampled, finished)
        assert sched_digest(st) == before
    for bad in (-1, 1.5, b"ab", "ab"):
        assert submit(st, SeqRequest("b", bad)).failure().code.value == "INVALID", bad  # type: ignore[arg-type]
    assert submit(st, SeqRequest("b", [1, 2])).unwrap().seqs["b"].prompt == (1, 2)  # (a list is kept as a tuple)
    st, ended = on_output(st, {"a": 5}, ["a"]).unwrap()
    assert ended == (("a", "finished"),)


def test_the_library_holds_no_assert_statement() -> None:
    """``python -O`` strips ``assert``: an input check written as one vanishes, an invariant check too. Input is
    refused with a typed error; a broken invariant raises ``InvariantError``."""
    import ast

    root = Path(__file__).resolve().parents[2] / "pagedkv"
    found = [
        f"{p.relative_to(root.parent)}:{node.lineno}"
        for p in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert found == []


@pytest.mark.slow
def test_the_refusals_hold_under_python_O() -> None:
    """The core's refusal tests and the engine's fault and edge tests, run again by ``python -O`` (asserts
    stripped from the library; pytest rewrites the tests' own, so they still check)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    files = [
        "tests/core/test_bad_input.py",
        "tests/shell/test_engine_faults.py",
        "tests/shell/test_engine_edges.py",
        "tests/shell/test_engine_step_faults.py",
        "tests/core/test_scheduler.py",
        "tests/core/test_trace_end.py",
    ]
    run = subprocess.run(
        [
            sys.executable,
            "-O",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow",
            "-o",
            "addopts=",
            *files,
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
