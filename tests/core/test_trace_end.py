"""Issue 45: a trace has an end. A recorded trace cut mid-line, cut at half its length, with a junk line inserted
or appended, or with a line lost, once replayed as "N events, 1 refused, 0 diverged", exit 0. Its header now
promises an end record (``"end_record": true``) and its last line counts the events before it: anything else
diverges. A trace recorded before (no promise, the scheduler's old digest) still replays as it did."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pagedkv.app.cli import main
from pagedkv.core import CacheConfig
from pagedkv.core.scheduler import SchedulerConfig, SeqRequest, new_scheduler, on_output, schedule, submit
from pagedkv.core.verify.trace import replay
from pagedkv.shell.recorder import Recorder

OLD_TRACE = Path(__file__).resolve().parents[2] / "examples" / "shared_prefix_trace.jsonl"


def recorded() -> list[str]:
    """A serving run through the scheduler, recorded as the engine records it (its expects included)."""
    cfg, sched = CacheConfig(block_size=2, num_blocks=12, enable_prefix_caching=True), SchedulerConfig(max_num_seqs=2)
    out = io.StringIO()
    rec, s = Recorder(out, cfg, sched), new_scheduler(cfg, sched)
    for i in range(4):
        req = SeqRequest(f"r{i}", tuple(range(i, i + 5)), max_tokens=4)
        s = submit(s, req).unwrap()
        rec.submit(req, s)
    while s.live:
        s, plan = schedule(s).unwrap()
        rec.schedule(s, plan)
        sampled = {rid: 7 for rid in plan.samples}
        s, ended = on_output(s, sampled).unwrap()
        rec.output(sampled, (), s, ended)
    rec.end()
    return out.getvalue().splitlines()


def replayed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], text: str | None = None
) -> tuple[int, str]:
    path = tmp_path / "t.jsonl"
    path.write_text(text if text is not None else "\n".join(lines) + "\n")
    code = main(["replay", str(path)])
    return code, capsys.readouterr().err


def test_a_whole_trace_replays_and_says_where_it_ends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = recorded()
    head, last = json.loads(lines[0]), json.loads(lines[-1])
    assert head["config"]["end_record"] is True and head["config"]["scheduler"]["digest"] == "live"
    assert last == {"op": "end", "events": len(lines) - 2}
    results = list(replay(lines, check=True))
    assert results[-1].result["op"] == "end" and all(r.divergence is None and not r.violations for r in results)
    assert replayed(tmp_path, capsys, lines) == (0, "")


@pytest.mark.parametrize("cut", ["half its bytes", "mid-line", "its end record", "half its lines"])
def test_a_trace_cut_short_diverges(cut: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = recorded()
    text = "\n".join(lines) + "\n"
    cuts = {
        "half its bytes": text[: len(text) // 2],
        "mid-line": text[: len(text) - len(lines[-2]) // 2 - len(lines[-1]) - 2],
        "its end record": "\n".join(lines[:-1]) + "\n",
        "half its lines": "\n".join(lines[: len(lines) // 2]) + "\n",
    }
    code, err = replayed(tmp_path, capsys, lines, cuts[cut])
    assert code == 1 and "without the end record its header promises: it was cut short" in err, err


@pytest.mark.parametrize(
    "change",
    ["junk inserted", "an event inserted", "an event lost", "junk appended", "an event appended", "the count changed"],
)
def test_lines_lost_or_added_diverge(change: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = recorded()
    k = len(lines) // 2
    changed = {
        "junk inserted": lines[:k] + ["}{ junk"] + lines[k:],
        "an event inserted": lines[:k] + ['{"op": "schedule"}'] + lines[k:],
        "an event lost": lines[:k] + lines[k + 1 :],
        "junk appended": lines + ["junk"],
        "an event appended": lines + ['{"op": "schedule"}'],
        "the count changed": lines[:-1] + [json.dumps({"op": "end", "events": len(lines) - 1})],
    }[change]
    code, err = replayed(tmp_path, capsys, changed)
    assert code == 1, err
    said = (
        "after the end record"
        if "appended" in change
        else "lost or inserted"
        if change in ("junk inserted", "the count changed")
        else ""
    )
    assert said in err, err


def test_the_missing_end_is_reported_in_its_place_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = recorded()[:-1]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", "--json", str(path)]) == 1
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(rows) == len(lines) and rows[-1]["op"] == "end" and rows[-1]["i"] == len(lines) - 1
    assert rows[-1]["ok"] is False and rows[-1]["error"]["code"] == "INVALID"
    assert rows[-1]["digest"] == rows[-2]["digest"]


def test_a_trace_recorded_before_the_end_record_replays_as_it_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its header promises no end and its scheduler digest covered every ended request: replay keeps that
    record itself, so its digests hold; cut short, it cannot tell (it never could)."""
    lines = OLD_TRACE.read_text().splitlines()
    assert "end_record" not in lines[0] and '"digest"' not in json.loads(lines[0])["config"]["scheduler"]
    assert replayed(tmp_path, capsys, lines) == (0, "")
    assert replayed(tmp_path, capsys, lines[: len(lines) // 2]) == (0, "")


@pytest.mark.parametrize(
    "config, says", [({"end_record": "yes"}, "end_record"), ({"scheduler": {"digest": "history"}}, "digest")]
)
def test_a_bad_promise_is_a_bad_header(
    config: dict[str, object], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    head = {"pagedkv_trace": 1, "config": {"block_size": 2, "num_blocks": 9, **config}}
    code, err = replayed(tmp_path, capsys, [json.dumps(head)])
    assert code == 2 and says in err and len(err.splitlines()) == 1
