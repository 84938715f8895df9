"""A whole serving run replays from its trace: the same plans and digests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.app.cli import main
from pagedkv.core import CacheConfig
from pagedkv.core.scheduler import SchedulerConfig, SeqRequest, new_scheduler, on_output, schedule, sched_digest, submit
from pagedkv.core.spec import RowSpec
from pagedkv.core.verify.record import end_event, output_event, scheduler_header, submit_event
from pagedkv.core.verify.trace_ops import plan_json
from tests.core.test_scheduler import model


def record(tmp_path: Path) -> tuple[Path, list[dict[str, object]]]:
    cache = CacheConfig(block_size=2, num_blocks=11, enable_prefix_caching=True)
    sched = SchedulerConfig(max_num_batched_tokens=10)
    s = new_scheduler(cache, sched)
    lines: list[dict[str, object]] = [scheduler_header(cache, sched)]
    arrivals = [SeqRequest(f"r{i}", tuple(range(5 * i, 5 * i + 4 + i)), max_tokens=6) for i in range(4)]
    arrivals.insert(2, SeqRequest("img", rows=(RowSpec(6, prefix_len=4, target_len=2, spans=((4, 6),)),), steps=4))
    expected = []
    for step in range(60):
        if arrivals:
            req = arrivals.pop(0)
            s = submit(s, req).unwrap()
            lines.append({**submit_event(req), "expect": {"ok": True, "digest": sched_digest(s)}})
        if step == 9 and "r1" in s.live:
            from pagedkv.core.scheduler import cancel

            s = cancel(s, "r1").unwrap()
            lines.append({"op": "cancel", "request": "r1", "expect": {"digest": sched_digest(s)}})
        s, plan = schedule(s).unwrap()
        expected.append(plan_json(plan))
        lines.append(
            {
                "op": "schedule",
                "expect": {"plan": plan_json(plan), "digest": sched_digest(s), "free_blocks": s.kv.free_blocks},
            }
        )
        sampled = {rid: model(s.live[rid].prompt + s.live[rid].output) for rid in plan.samples}
        stop = [rid for rid, tok in sampled.items() if tok == 0]  # an "EOS"
        s, _ = on_output(s, sampled, stop).unwrap()
        lines.append({**output_event(sampled, stop), "expect": {"digest": sched_digest(s)}})
        if not s.live and not arrivals:
            break
    lines.append(end_event(len(lines) - 1))
    path = tmp_path / "serving.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path, expected


def test_a_recorded_serving_run_replays_with_the_same_plans_and_digests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, plans = record(tmp_path)
    assert any(p["preempted"] for p in plans), "the run should exercise preemption"
    assert any(p["diffusion"] for p in plans)
    assert main(["replay", "--check", str(path)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    # and in another process, under another hash seed
    res = subprocess.run(
        [sys.executable, "-m", "pagedkv.app.cli", "replay", "--json", str(path)],
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "7", "PATH": ""},
    )
    assert res.returncode == 0, res.stderr
    got = [json.loads(line)["plan"] for line in res.stdout.splitlines() if json.loads(line)["op"] == "schedule"]
    assert got == plans


def test_scheduler_ops_are_refused_in_a_core_trace_and_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        json.dumps({"pagedkv_trace": 1, "config": {"block_size": 2, "num_blocks": 5}})
        + "\n"
        + json.dumps({"op": "schedule"})
        + "\n"
    )
    assert main(["replay", "--json", str(p)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["error"]["code"] == "INVALID" and "without a scheduler" in out["error"]["message"]
    p.write_text(
        json.dumps(scheduler_header(CacheConfig(block_size=2, num_blocks=5), SchedulerConfig()))
        + "\n"
        + json.dumps({"op": "admit", "request": "a", "rows": [{"num_tokens": 1}]})
        + "\n"
        + json.dumps({"op": "output", "sampled": [["x", 1]]})
        + "\n"
        + json.dumps({"op": "output", "sampled": []})
        + "\n"
        + json.dumps(end_event(3))
        + "\n"
    )
    assert main(["replay", "--json", str(p)]) == 0
    a, b, c, end = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert a["error"]["code"] == "INVALID" and "with a scheduler" in a["error"]["message"]
    assert b["error"]["code"] == "INVALID" and "computed no token" in b["error"]["message"]  # not in a plan
    assert c["ok"] is True and c["finished"] == []  # nothing was scheduled: an empty output is fine
    assert end["op"] == "end" and end["ok"] is True
