"""Issue 29, part 5: every integer field bounded where it is read, typed failures everywhere: the core's
transitions, its lookup, replay and the worker answer a refusal (or nothing, for a lookup) to inputs no
engine sends, never an exception, and the state is as it was."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pagedkv.app.cli import main
from pagedkv.core import (
    CacheConfig, RequestSpec, RowSpec, admit, append, append_many, commit, decode_step, digest, initial_state, publish,
)  # fmt: skip
from pagedkv.core.prefix import find_hit
from pagedkv.shell.errors import ShellError
from pagedkv.shell.worker import Worker

HUGE = 10**5000  # past Python's 4,300-digit limit for str(int): a message that formats it raises


def state() -> Any:
    s = initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True))
    return admit(s, RequestSpec("a", (RowSpec.of_tokens([1, 2, 3]),))).unwrap().state


@pytest.mark.parametrize("call", [
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
])  # fmt: skip
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


@pytest.mark.parametrize("field, value", [
    ("seq_len", 4.0), ("query_len", 4.0), ("kv_start_pos", 0.0), ("seq_len", HUGE), ("row", "0"),
    ("block_ids", 5), ("slots", None), ("segments", None),
], ids=lambda v: v if isinstance(v, str) else type(v).__name__)  # fmt: skip
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
