"""Issue 17, defect 6: ``pagedkv replay`` on hostile files. A bad header is exit 2 with one line; a bad
event line is an INVALID result; never a traceback, never exit 1 (which means an expect diverged) for
input it could not read."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pagedkv.app.cli import main

TRACES = sorted((Path(__file__).parent / "traces").glob("*.jsonl"))
HOSTILE = [
    "1" * 4400,
    "-" + "9" * 5000,
    str(10**30),
    str(10**9),
    str(2**64),
    '"\\ud800"',
    '"a\\udfff"',
    "1e999",
    "[" * 3000,
    "null",
    "{}",
    '""',
]


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("num_blocks", "1" + "0" * 4400, "not JSON"),
        ("num_blocks", str(10**30), "num_blocks"),
        ("num_blocks", str(10**9), "num_blocks"),
        ("hash_namespace", '"\\ud800"', "hash_namespace"),
    ],
)
def test_a_hostile_header_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: str, says: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "%s": %s}}\n' % (field, value))
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagedkv replay: ") and says in err and "\n" not in err, err[:300]


def mutate(lines: list[str], rng: random.Random) -> list[str]:
    """One trace with a few of its numbers, strings or lines replaced by hostile text."""
    out = list(lines)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(out))
        line = out[i]
        spots = [k for k, ch in enumerate(line) if ch.isdigit() or ch == '"']
        how = rng.random()
        if how < 0.7 and spots:
            k = rng.choice(spots)
            end = k + 1
            while end < len(line) and (line[end].isdigit() if line[k].isdigit() else line[end] != '"'):
                end += 1
            out[i] = line[:k] + rng.choice(HOSTILE) + line[end + (0 if line[k].isdigit() else 1) :]
        elif how < 0.85:
            out[i] = line[: rng.randrange(len(line) + 1)]
        else:
            out.insert(
                i,
                json.dumps({"op": rng.choice(["admit", "submit", "cancel", "schedule"]), "request": "x"}).replace(
                    '"x"', rng.choice(HOSTILE)
                ),
            )
    return out


@pytest.mark.slow
def test_two_thousand_mutated_traces_never_raise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(17)
    sources = [p.read_text().splitlines() for p in TRACES]
    path = tmp_path / "m.jsonl"
    codes: dict[int, int] = {}
    for n in range(2000):
        lines = mutate(sources[n % len(sources)], rng)
        path.write_text("\n".join(lines) + "\n")
        for args in (
            (["replay", str(path)], ["replay", "--json", str(path)]) if n % 4 == 0 else (["replay", str(path)],)
        ):
            rc = main(args)  # an exception here fails the test: that is the point
            codes[rc] = codes.get(rc, 0) + 1
            captured = capsys.readouterr()
            if rc == 2:
                assert captured.err.count("\n") == 1 and captured.err.startswith("pagedkv replay: "), captured.err[:300]
    assert set(codes) <= {0, 1, 2} and codes.get(2, 0) > 0 and codes.get(1, 0) > 0, codes
