"""Trace contract version 1, pinned through the `pagedkv replay` command."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.app.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cfg_and_decode.jsonl"
HEADER = {"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9}}
KEYS = ["i", "op", "ok", "error", "generation", "free_blocks", "digest"]


def write(tmp_path: Path, events: list[object], header: object = HEADER) -> Path:
    p = tmp_path / "t.jsonl"
    lines = [json.dumps(header)] + [e if isinstance(e, str) else json.dumps(e) for e in events]
    p.write_text("\n".join(lines) + "\n")
    return p


def run(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[dict], str]:
    code = main(["replay", str(path), "--json"])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_the_shipped_example_replays_clean(capsys: pytest.CaptureFixture[str]) -> None:
    code, results, err = run(EXAMPLE, capsys)
    assert code == 0, err
    assert [r["i"] for r in results] == list(range(len(results)))
    for r in results:
        assert list(r)[:7] == KEYS
    assert [r["error"]["code"] for r in results if not r["ok"]] == [
        "INVALID",
        "NO_CAPACITY",
        "UNSCHEDULABLE",
        "UNSCHEDULABLE",
        "UNKNOWN_REQUEST",
    ]


def test_result_objects_have_exactly_the_contract_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(
        tmp_path,
        [
            {"op": "admit", "request": "a", "rows": [{"tokens": [1, 2, 3, 4, 5]}]},
            {"op": "append", "request": "a", "num_tokens": [1]},
            {"op": "commit", "request": "a", "computed": [3]},
            {"op": "publish", "requests": ["a"], "phase": "prefill"},
            {"op": "release", "request": "a", "reason": "finished"},
            {"op": "reset"},
            {"op": "reset_prefix_cache"},
        ],
    )
    code, rs, _ = run(p, capsys)
    assert code == 0
    assert [sorted(r) for r in rs] == [
        sorted(KEYS + ["cached_tokens", "blocks"]),
        sorted(KEYS + ["blocks"]),
        sorted(KEYS + ["blocks"]),
        sorted(KEYS + ["rows"]),
        sorted(KEYS),
        sorted(KEYS),
        sorted(KEYS),
    ]
    assert rs[0]["cached_tokens"] == [0] and rs[0]["blocks"] == [[[1, 2]]]
    assert rs[1]["blocks"] == [[[1, 2]]] and rs[1]["generation"] == 1  # 6 tokens still fit 2 blocks
    assert rs[3]["rows"] == [
        {
            "request": "a",
            "row": 0,
            "seq_len": 6,
            "query_len": 3,
            "kv_start_pos": 3,
            "block_ids": [[1, 2]],
            "slots": [7, 8, 9],
            "segments": [{"causal": True, "q": [3, 6], "kv_end": 6}],
        }
    ]
    assert rs[4]["generation"] == 2 and rs[4]["free_blocks"] == 8
    assert rs[5]["generation"] == 2 and rs[5]["free_blocks"] == 8


def test_failed_event_changes_nothing_and_nulls_its_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(
        tmp_path,
        [
            {"op": "admit", "request": "a", "rows": [{"num_tokens": 8}]},
            {"op": "admit", "request": "b", "rows": [{"num_tokens": 40}]},
            {"op": "append", "request": "b", "num_tokens": [1]},
            {"op": "publish", "requests": ["b"], "phase": "decode"},
        ],
    )
    code, rs, _ = run(p, capsys)
    assert code == 0
    first = rs[0]
    for r in rs[1:]:
        assert not r["ok"]
        assert (r["generation"], r["free_blocks"], r["digest"]) == (
            first["generation"],
            first["free_blocks"],
            first["digest"],
        )
    assert rs[1]["error"]["code"] == "UNSCHEDULABLE" and rs[1]["error"]["permanent"] is True
    assert rs[1]["cached_tokens"] is None and rs[1]["blocks"] is None
    assert rs[2]["error"]["code"] == "UNKNOWN_REQUEST" and rs[2]["blocks"] is None
    assert rs[3]["rows"] is None
    assert rs[1]["error"]["message"].startswith("line 3: ")


def test_malformed_lines_are_invalid_with_their_line_and_replay_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = write(
        tmp_path,
        [
            "{not json",
            "[1, 2]",
            {"op": "fly"},
            {"op": "admit", "request": "a", "rows": [{"num_tokens": 4, "tokens": [1, 2, 3, 4]}]},
            {"op": "admit", "request": "a", "rows": [{"num_tokens": "4"}]},
            {"op": "admit", "request": ["a"], "rows": [{"num_tokens": 4}]},
            {"op": "append", "request": "a", "tokens": [1]},
            {"op": "release", "request": "a", "reason": "bored"},
            {"op": "commit", "computed": [1]},
            {"op": "admit", "request": "a", "rows": [{"num_tokens": 4}], "expect": {"ok": True}},
        ],
    )
    code, rs, err = run(p, capsys)
    assert code == 0, err
    assert [r["i"] for r in rs] == list(range(10))
    for k, r in enumerate(rs[:9]):
        assert r["error"]["code"] == "INVALID", r
        assert r["error"]["message"].startswith(f"line {k + 2}: "), r
    assert rs[0]["op"] is None and rs[2]["op"] == "fly"
    assert rs[9]["ok"] and rs[9]["generation"] == 1


def test_expect_divergence_exits_1_and_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(
        tmp_path,
        [
            {"op": "admit", "request": "a", "rows": [{"num_tokens": 4}], "expect": {"blocks": [[[1]]]}},
            {"op": "admit", "request": "b", "rows": [{"num_tokens": 4}], "expect": {"blocks": [[[7]]], "ok": True}},
            {"op": "admit", "request": "c", "rows": [{"num_tokens": 4}], "expect": {"error": {"code": "NO_CAPACITY"}}},
            {"op": "release", "request": "a", "reason": "finished", "expect": {"ok": True}},
        ],
    )
    code, rs, err = run(p, capsys)
    assert code == 1
    assert "line 3" in err and "blocks[0][0][0]: expected 7, got 2" in err
    assert len(rs) == 4  # replay keeps going after a divergence


def test_subset_matching_of_objects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(
        tmp_path,
        [
            {"op": "admit", "request": 7, "rows": [{"num_tokens": 5}], "expect": {"ok": True, "generation": 1}},
            {
                "op": "publish",
                "requests": [7],
                "phase": "prefill",
                "expect": {"rows": [{"slots": [4, 5, 6, 7, 8], "segments": [{"causal": True}]}]},
            },
            {"op": "admit", "request": 7, "rows": [{"num_tokens": 1}], "expect": {"ok": 0}},
        ],
    )
    code, rs, err = run(p, capsys)
    assert code == 1 and "line 4" in err and "ok: expected 0, got false" in err  # true/false are not integers


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        json.dumps({"pagedkv_trace": 2, "config": {"block_size": 4, "num_blocks": 9}}),
        json.dumps({"pagedkv_trace": True, "config": {"block_size": 4, "num_blocks": 9}}),
        json.dumps({"pagedkv_trace": 1, "config": {"block_size": 0, "num_blocks": 9}}),
        json.dumps(
            {"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "groups": [{"name": "g", "kind": "x"}]}}
        ),
        json.dumps({"pagedkv_trace": 1}),
    ],
)
def test_a_bad_header_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], header: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(header + "\n" + json.dumps({"op": "reset"}) + "\n")
    assert main(["replay", str(p), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "line 1" in err


def test_unknown_header_keys_are_ignored_and_defaults_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(
        tmp_path,
        [{"op": "admit", "request": "a", "rows": [{"num_tokens": 4}] * 5}],
        header={"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "colour": "blue"}},
    )
    code, rs, _ = run(p, capsys)
    assert code == 0 and rs[0]["ok"]  # max_rows_per_request defaults to unlimited


def test_digests_are_stable_across_processes() -> None:
    """Equal states give equal digests in any process: hash randomisation must not leak in."""
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run(
            [sys.executable, "-m", "pagedkv.app.cli", "replay", str(EXAMPLE), "--json"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        outs.append([json.loads(line)["digest"] for line in res.stdout.splitlines()])
    assert outs[0] == outs[1]
    assert len(set(outs[0])) > 5


def test_readable_table_without_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["i", "line", "op", "result"]
    assert "NO_CAPACITY" in out and "0 diverged from expect" in out


def test_replay_draws_a_page_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the page map needs matplotlib (pip install 'pagedkv[plot]')")
    out = tmp_path / "map.png"
    assert main(["replay", str(EXAMPLE), "--page-map", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_admit_keys_decide_hits_as_vllm_keys_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Trace contract: ``extra_keys`` (strings or lists), ``content`` and ``first_block_keys`` on admit. A salt
    keys only block 0, yet the chain carries it: a salted request never hits an unsalted one's blocks; the
    same salt hits; an image touching only the second block leaves the first shared."""
    cfg = {"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 17, "enable_prefix_caching": True}}
    toks = list(range(1, 11))
    row = {"rows": [{"tokens": toks}]}

    def admitted(rid: str, **keys: object) -> list[object]:
        return [{"op": "admit", "request": rid, **row, **keys}, {"op": "commit", "request": rid, "computed": [10]}]

    p = write(
        tmp_path,
        [
            *admitted("plain"),
            *admitted("salted", first_block_keys=[["cache_salt", "s"]]),
            *admitted("salted-again", first_block_keys=[["cache_salt", "s"]]),
            *admitted("lora", extra_keys=[["lora", "a", "/p"]]),
            *admitted("image", content=[["img", 5, 2]]),
            {"op": "admit", "request": "bad", **row, "content": [["img", -1, 2]]},
            {"op": "admit", "request": "bad2", **row, "extra_keys": [{"not": "a key"}]},
        ],
        cfg,
    )
    code, rs, _ = run(p, capsys)
    assert code == 0
    cached = [r["cached_tokens"] for r in rs if r["op"] == "admit"]
    assert cached == [[0], [0], [8], [0], [4], None, None]
    assert [r["error"]["code"] for r in rs[-2:]] == ["INVALID", "INVALID"]
