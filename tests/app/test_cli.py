"""The command line as a new user meets it: every mistake one line naming it and exit 2 (1 only for a
divergence or a failed run), nothing lost when an optional output fails, traces that replay digest for
digest, and a page map that shows who holds what, what is shared and what was evicted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedkv.app import args as app_args
from pagedkv.app.cli import main

ROOT = Path(__file__).resolve().parents[2]
SHARED_TRACE = ROOT / "examples" / "shared_prefix_trace.jsonl"


def lines_of(path: Path, *objs: object) -> str:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return str(path)


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def prompt_files(tmp: Path) -> dict[str, str]:
    return {
        "neg": lines_of(tmp / "neg.jsonl", {"prompt": "a", "max_tokens": -5}),
        "abc": lines_of(tmp / "abc.jsonl", {"prompt": "a", "max_tokens": "abc"}),
        "frac": lines_of(tmp / "frac.jsonl", {"prompt": "a", "max_tokens": 2.7}),
        "bool": lines_of(tmp / "bool.jsonl", {"prompt": "a", "max_tokens": True}),
        "sys": lines_of(tmp / "sys.jsonl", {"prompt": "a", "system": 5}),
        "empty": lines_of(tmp / "empty.jsonl", {"prompt": ""}),
        "binary": str(_write_bytes(tmp / "bin.jsonl", bytes(range(128, 256)) * 4)),
        "noprompt": lines_of(tmp / "noprompt.jsonl", {"text": "a"}),
        "trailing": lines_of(tmp / "trailing.jsonl", '{"prompt": "a"} and more'),  # (a line starting with {: JSON)
        "line3": lines_of(tmp / "line3.jsonl", {"prompt": "a"}, "", {"prompt": "b"}, '{"prompt": "c", oops}'),
        "digits": lines_of(tmp / "digits.jsonl", '{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}"),
        "huge": lines_of(tmp / "huge.jsonl", {"prompt": "a", "max_tokens": 2**40}),
        "surrogate": lines_of(tmp / "surrogate.jsonl", '{"prompt": "a \\ud800 b"}'),
    }


# (argv, a phrase the one line must hold); {name} is a prompts file of prompt_files, {tmp} the folder
USAGE_ERRORS: list[tuple[list[str], str]] = [
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens: must be a positive integer up to 2,147,483,647, got '0'"),
    (["generate", "hi", "--max-tokens", "-1"], "--max-tokens"),
    (
        ["generate", "--prompts", "{neg}"],
        'neg.jsonl line 1: "max_tokens" must be an integer in [1, 2147483647], got -5',
    ),
    (["generate", "--prompts", "{abc}"], "\"max_tokens\" must be an integer in [1, 2147483647], got 'abc'"),
    (["generate", "--prompts", "{frac}"], "got 2.7"),
    (["generate", "--prompts", "{bool}"], "got True"),
    (["generate", "--prompts", "{digits}"], "digits.jsonl line 1: Exceeds the limit (4300 digits)"),
    (["generate", "--prompts", "{huge}"], '"max_tokens" must be an integer in [1, 2147483647], got 1099511627776'),
    (["generate", "--prompts", "{surrogate}"], 'surrogate.jsonl line 1: "prompt" is not valid UTF-8 text'),
    (["generate", "a \udcff b"], "prompt 1 of the command line is not valid UTF-8 text"),  # (argv bytes 0xff)
    (["generate", "hi", "--seed", str(10**30)], "--seed: must be an integer in [0, 2**63)"),
    (["generate", "a", "b", "--seed", str(2**63 - 1)], "2 requests pass 2**63"),
    (["generate", "hi", "--threads", str(10**20)], "--threads: must be an integer in [1, 1024] or auto"),
    (["generate", "hi", "--max-num-seqs", str(10**9)], "--max-num-seqs: must be a positive integer up to 4,096"),
    (["generate", "hi", "--trace", ""], "--trace: needs a file name"),
    (["generate", "hi", "--page-map", ""], "--page-map: needs a file name"),
    (["generate", "hi", "--backend", "triton"], "--backend triton runs on a CUDA device"),
    (["denoise", "--seed", str(10**30)], "--seed: must be an integer in [0, 2**63)"),
    (["denoise", "--blocks", str(10**9)], "--blocks: must be a positive integer up to 1,048,576"),
    (["check", "--blocks", str(10**9)], "--blocks: must be a positive integer up to 64"),
    (["check", "--requests", str(10**6)], "--requests: must be a positive integer up to 26"),
    (["check", "--out", "{tmp}/no/such/dir/c.jsonl"], "does not exist"),
    (["check", "--out", ""], "--out: needs a file name"),
    (["generate", "--prompts", "{sys}"], '"system" must be a string, got 5'),
    (["generate", "--prompts", "{empty}"], 'line 1: "prompt" is empty'),
    (["generate", "--prompts", "{noprompt}"], '"prompt" must be a string'),
    (["generate", "--prompts", "{trailing}"], "trailing.jsonl line 1 column 17: Extra data"),
    (["generate", "--prompts", "{line3}"], "line3.jsonl line 4 column 17"),  # the file's line, blank ones counted
    (["generate", "--prompts", "{tmp}/missing.jsonl"], "cannot read"),
    (["generate", "--prompts", "/dev/zero"], "/dev/zero line 1 is longer than 64 MiB"),  # (issue 45: read unbounded)
    (["generate", "--prompts", "{binary}"], "line 1 is not UTF-8 text"),
    (["generate", ""], "prompt 1 of the command line is empty"),
    (["generate"], "no prompts"),
    (["generate", "hi", "--kv-cache-memory", "0"], "--kv-cache-memory: must be a positive number"),
    (["generate", "hi", "--kv-cache-memory", "-1"], "--kv-cache-memory"),
    (["generate", "hi", "--kv-cache-memory", "nan"], "--kv-cache-memory"),
    (["generate", "hi", "--block-size", "0"], "--block-size"),
    (["generate", "hi", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["generate", "hi", "--temperature", "-0.5"], "--temperature"),
    (["generate", "hi", "--top-p", "0"], "--top-p: must be a number in (0, 1]"),
    (["generate", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "hi", "--top-k", "-1"], "--top-k"),
    (["generate", "hi", "--threads", "0"], "--threads"),
    (["generate", "hi", "--device", "tpu"], "--device: must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["generate", "hi", "--device", "mps"], "--device"),
    (["generate", "hi", "--dtype", "int8"], "--dtype"),
    (["generate", "hi", "--ranks", "0"], "--ranks"),
    (["generate", "hi", "--ranks", "-1"], "--ranks"),
    (["generate", "hi", "--ranks", "12"], "SmolLM2-135M has 9 query heads to split; use 1 to 9"),
    (["generate", "hi", "--ranks", "2", "--trace", "{tmp}/t.jsonl"], "use them with --ranks 1"),
    (["generate", "hi", "--trace", "{tmp}/no/such/dir/t.jsonl"], "--trace"),
    (["generate", "hi", "--page-map", "{tmp}/map.txt"], "must end in .png"),
    (["generate", "hi", "--page-map", "{tmp}/no/such/dir/map.png"], "no such directory"),
    (["generate", "hi", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["generate", "hi", "--long-prefill-token-threshold", "-1"], "--long-prefill-token-threshold"),
    (
        ["generate", "hi", "--speculative-config", '{{"method": "eagle"}}'],
        "method 'eagle' is not served",
    ),  # ({{: format)
    (["generate", "hi", "--speculative-config", "{{"], "--speculative-config: is not JSON"),
    (["generate", "hi", "--speculative-config", '{{"num_speculative_tokens": 0}}'], "num_speculative_tokens must be"),
    (["generate", "hi", "--speculative-config", '{{"prompt_lookup": 3}}'], "unknown keys ['prompt_lookup']"),
    (["generate", "hi", "--ranks", "2", "--speculative-config", "{{}}"], "use it with --ranks 1"),
    (["generate", "hi", "--async-scheduling", "--speculative-config", "{{}}"], "not served yet: use one of them"),
    (["generate", "hi", "--ranks", "2", "--async-scheduling"], "--async-scheduling is served by one engine"),
    (["generate", "hi", "--ranks", "2", "--batch-invariant"], "--batch-invariant is served by one engine"),
    (["generate", "hi", "--kv-offloading-size", "0"], "--kv-offloading-size"),
    (["generate", "hi", "--kv-offloading-backend", "lmcache"], "--kv-offloading-backend"),
    (["generate", "hi", "--kv-offloading-size", "1", "--no-prefix-caching"], "it needs prefix caching"),
    (["generate", "hi", "--kv-offloading-store-threshold", "2"], "it needs kv_offloading_size"),
    (
        ["generate", "hi", "--kv-offloading-size", "1", "--kv-offloading-store-threshold", "-1"],
        "must be a non-negative",
    ),
    (["check", "--host-store-threshold", "2"], "it needs host_blocks"),
    (["check", "--host-blocks", "1", "--host-tracker-size", "0"], "--host-tracker-size"),
    (["check", "--host-blocks", "1", "--no-prefix-caching"], "needs prefix caching"),
    (["check", "--host-blocks", "17"], "--host-blocks"),
    (["denoise", "--steps", "0"], "--steps"),
    (["denoise", "--image-tokens", "-5"], "--image-tokens"),
    (["denoise", "--blocks", "0"], "--blocks"),
    (["denoise", "--requests", "-1"], "--requests"),
    (["replay", "{tmp}/missing.jsonl"], "cannot read"),
    (["replay", "/dev/zero"], "/dev/zero line 1 is longer than 64 MiB"),
    (["replay", str(SHARED_TRACE), "--page-map", "{tmp}/x.txt"], "must end in .png"),
    (["check", "--max-states", "0"], "--max-states"),
    (["check", "--window", "-1"], "--window"),
    (["check", "--blocks", "0"], "--blocks"),
    (["nonsense"], "invalid choice"),
]


@pytest.mark.parametrize("argv, says", USAGE_ERRORS, ids=[" ".join(a)[:60] for a, _ in USAGE_ERRORS])
def test_a_mistake_is_one_line_and_exit_2(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {**prompt_files(tmp_path), "tmp": str(tmp_path)}
    argv = [a.format(**names) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()  # one line, nothing else
    assert line.startswith(f"pagedkv {argv[0]}: " if argv[0] != "nonsense" else "pagedkv: ")
    assert says in line, line
    assert not (tmp_path / "t.jsonl").exists()  # nothing written before the refusal


def test_cuda_asked_of_a_machine_without_it(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    for device in ("cuda", "cuda:0"):
        assert main(["generate", "hi", "--device", device]) == 2
        assert capsys.readouterr().err == f"pagedkv generate: --device {device}, but no CUDA device is available\n"


def test_no_matplotlib_is_said_before_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["generate", "hi", "--page-map", str(tmp_path / "m.png")]) == 2
    assert capsys.readouterr().err == "pagedkv generate: --page-map needs matplotlib: pip install 'pagedkv[plot]'\n"


def test_argument_errors_come_before_torch_and_without_a_traceback() -> None:
    """In a fresh process, as a user runs it: the flag's mistake is said before torch is imported."""
    code = (
        "import sys; from pagedkv.app.cli import main; rc = main(['generate', 'hi', '--max-tokens', '0']); "
        "print(rc, 'torch' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert res.stdout.split() == ["2", "False"]
    assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) == 1
    res = subprocess.run(
        [sys.executable, "-m", "pagedkv.app.cli", "denoise", "--steps", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert res.returncode == 2 and res.stdout == "" and len(res.stderr.splitlines()) == 1, res.stderr


def test_help_shows_defaults_and_every_option_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.app.cli import _parsers

    parser, generate = _parsers()
    for name in ("generate", "replay", "check", "denoise", "serve"):
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        assert "(default: None)" not in text
        if name in ("generate", "check", "denoise"):
            assert "(default: " in text
    sub = next(a for a in parser._actions if isinstance(a, app_args.argparse._SubParsersAction))
    for name, p in sub.choices.items():
        formatter = p._get_formatter()
        for action in p._actions:
            assert action.help, f"pagedkv {name} {action.option_strings or action.dest} has no help"
            said = (formatter._get_help_string(action) or "").replace("%(default)s", "")  # (stated once: issue 64)
            assert len(re.findall(r"\bdefault\b", said)) <= 1, f"pagedkv {name} {action.option_strings}: {said}"
    assert "--max-tokens N" in generate.format_help() and "generation config's, else 64)" in generate.format_help()
    families = " ".join(generate.format_help().split())  # (every family served: models.hf.ARCHITECTURES)
    assert all(f in families for f in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma 3", "Bamba", "granite-4.0-h"))


def test_prompts_come_anywhere_and_from_standard_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    from pagedkv.app.cli import _parsers
    from pagedkv.app.prompts import read_items

    _, generate = _parsers()
    args = generate.parse_intermixed_args(["first", "--max-tokens", "3", "second", "--chat", "third"])
    assert args.prompt == ["first", "second", "third"] and args.max_tokens == 3 and args.chat
    args.prompts = "-"
    stdin = io.TextIOWrapper(  # (JSON Lines and plain lines of text mixed: a line a prompt; bytes below)
        io.BytesIO(b'{"prompt": "fourth", "max_tokens": 5, "max_token": 9}\n\n  a plain line {x}\r\nlast')
    )
    monkeypatch.setattr(sys, "stdin", stdin)
    items = read_items(args)
    assert [(i["prompt"], i["max_tokens"]) for i in items] == [
        ("first", 3), ("second", 3), ("third", 3), ("fourth", 5), ("  a plain line {x}", 3), ("last", 3)
    ]  # fmt: skip
    err = capsys.readouterr().err  # a typo is named, not silently dropped
    assert err == (
        "pagedkv generate: standard input line 1: ignoring 'max_token' (known keys: prompt, max_tokens, system)\n"
    )


def test_threads_follow_the_idle_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: the CPUs idle over the sample; a fully busy machine still gets one thread."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    for idle_share, want in ((1.0, 4), (0.5, 2), (0.3, 1), (0.0, 1)):
        samples = iter([(0, 0), (int(1000 * idle_share), 1000)])
        monkeypatch.setattr(app_args, "_cpu_times", lambda samples=samples: next(samples))
        assert app_args.auto_threads(sample_s=0) == want
    monkeypatch.setattr(app_args, "_cpu_times", lambda: None)  # no /proc/stat: every usable CPU
    assert app_args.auto_threads(sample_s=0) == 4


def test_check_reports_progress_as_it_goes() -> None:
    from pagedkv.core.verify.alphabet import CheckConfig
    from pagedkv.core.verify.check import PROGRESS_EVERY, CheckResult, check

    seen: list[tuple[int, int]] = []

    def progress(r: CheckResult) -> None:
        seen.append((r.states, r.depth))

    result = check(CheckConfig(max_states=3 * PROGRESS_EVERY + 5), progress=progress)
    assert result.states == 3 * PROGRESS_EVERY + 5
    assert {PROGRESS_EVERY, 2 * PROGRESS_EVERY, 3 * PROGRESS_EVERY} <= {s for s, _ in seen}  # by states
    assert [d for _, d in seen] == sorted(d for _, d in seen) and set(range(1, result.depth)) <= {d for _, d in seen}
    assert [s for s, _ in seen] == sorted(s for s, _ in seen)


def test_check_explores_a_host_tier_beside_a_state_group(capsys: pytest.CaptureFixture[str]) -> None:
    """``--host-blocks`` reaches the checker's tier: 837 states with a state group and one host block, 379 without."""
    args = ["check", "--blocks", "3", "--requests", "2", "--window", "0", "--max-model-len", "4", "--mamba"]
    assert main([*args, "--host-blocks", "1"]) == 0
    tiered = capsys.readouterr().out
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert "violations:      0" in tiered and "(exhaustive)" in tiered
    count = [int(out.split("states explored: ")[1].split()[0]) for out in (tiered, plain)]
    assert count[0] > count[1], count


def test_denoise_that_runs_nothing_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["denoise", "--blocks", "1", "--requests", "2", "--steps", "2"]) == 2
    out, err = capsys.readouterr()
    assert out.count("refused: UNSCHEDULABLE: request 'img-") == 2 and "needs" in out and "the pool has 1" in out
    assert "0 of 2 requests denoised" in out and err.startswith("pagedkv denoise: no request could run")
    assert main(["denoise", "--image-tokens", "60000", "--requests", "1", "--steps", "1"]) == 2
    assert "over max_model_len" in capsys.readouterr().out


# -- the page map ---------------------------------------------------------------------------------------------
def shared_trace_states() -> list[Any]:
    from pagedkv.core.scheduler import SchedState
    from pagedkv.core.verify.trace import replay

    events = list(replay(SHARED_TRACE.read_text().splitlines()))
    assert all(ev.divergence is None for ev in events)  # the recorded expects hold (generate's trace, checked)
    return [ev.state.kv if isinstance(ev.state, SchedState) else ev.state for ev in events]


def test_the_page_map_shows_owners_sharing_cached_blocks_and_evictions() -> None:
    pytest.importorskip("matplotlib", reason="the page map needs matplotlib (pip install 'pagedkv[plot]')")
    from pagedkv.app.plot import PageMap, draw

    states = shared_trace_states()
    pm = PageMap.of(states)
    shared = sum(len(o) > 1 for h in pm.holders for o in h.values())
    evicted = sum(len(e) for e in pm.evicted)
    assert shared > 0 and evicted > 0 and any(pm.cached)
    fig = draw(states, title="t", xlabel="trace event (i)")
    blocks_ax, fill_ax = fig.axes
    legend = [t.get_text() for t in blocks_ax.get_legend().get_texts()]
    assert legend[: len(pm.requests())] == [str(r) for r in pm.requests()]  # every request named, first held first
    assert sorted(pm.requests()) == [f"req-{i}" for i in range(10)]
    assert {"shared by 2+ requests", "cached content evicted", "cached, free (a later hit reuses it)"} <= set(legend)
    marks = {c.get_label(): len(c.get_offsets()) for c in blocks_ax.collections}
    assert marks["shared by 2+ requests"] == shared and marks["cached content evicted"] == evicted
    top = max(b for h in pm.holders for b in h)
    assert blocks_ax.get_ylim() == (0.5, top + 0.5)  # no rows of blocks nobody used
    assert fill_ax.get_xlabel() == "trace event (i)" and fill_ax.get_legend() is not None
    ticks = [t for t in fill_ax.get_xticks() if 0 <= t < len(states)]
    assert ticks and all(float(t).is_integer() for t in ticks)
    fill = pm.fill()
    assert max(a + b + c for a, b, c in zip(fill["held"], fill["shared"], fill["cached"])) <= pm.usable
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_page_map_shows_the_host_tier() -> None:
    """With a host tier (issue 51): evictions whose content the tier kept are marked apart from those lost, and the
    tier's entries are drawn beside the pool's fill."""
    pytest.importorskip("matplotlib", reason="the page map needs matplotlib (pip install 'pagedkv[plot]')")
    from pagedkv.app.plot import PageMap, draw
    from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, commit, initial_state, release

    s = initial_state(CacheConfig(block_size=4, num_blocks=7, enable_prefix_caching=True, host_blocks=2))
    states = [s]
    for rid, first in (("a", 1), ("b", 100), ("c", 200)):
        s = admit(s, RequestSpec(rid, (RowSpec.of_tokens(list(range(first, first + 13))),))).unwrap().state
        states.append(s)
        s = release(commit(s, rid, [13]).unwrap().state, rid, "finished").unwrap().state
        states.append(s)
    pm = PageMap.of(states)
    # b's admission evicts a's third block into the tier; c's evicts three, the tier keeps the last two of them
    assert pm.host == [0, 0, 0, 1, 1, 2, 2] and [sorted(k) for k in pm.kept] == [[], [], [], [3], [], [1, 4], []]
    assert all(k <= e for k, e in zip(pm.kept, pm.evicted)) and sum(map(len, pm.evicted)) == 4
    fig = draw(states)
    blocks_ax, fill_ax, tier_ax = fig.axes
    marks = {c.get_label(): len(c.get_offsets()) for c in blocks_ax.collections}
    assert marks["evicted, kept in the host tier"] == 3 and marks["cached content evicted"] == 1
    assert tier_ax.get_ylabel() == "host tier blocks"
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_page_map_that_cannot_be_written_keeps_the_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="the page map needs matplotlib (pip install 'pagedkv[plot]')")
    from pagedkv.app import plot

    def fail(*a: object, **k: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot, "page_map", fail)
    assert main(["replay", str(SHARED_TRACE), "--page-map", str(tmp_path / "m.png")]) == 1
    out, err = capsys.readouterr()
    assert "136 events, 0 refused, 0 diverged from expect" in out
    assert err == "pagedkv replay: the page map was not written: [Errno 28] No space left on device\n"


# -- generate on the real model (one load per session, shared) ----------------------------------------------
@pytest.fixture
def loaded(smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate`` without loading the file again: the session's model stands in for Llama.smollm2."""
    from pagedkv.models.llama import Llama

    monkeypatch.setattr(Llama, "smollm2", classmethod(lambda cls, **kw: smollm2))


@pytest.mark.slow
@pytest.mark.usefixtures("loaded")
def test_generate_with_speculation_says_the_same_and_counts_its_drafts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "generate",
        "--chat",
        "Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
        "--max-tokens",
        "24",
        "--threads",
        "1",
    ]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    spec = capsys.readouterr().out
    assert plain.split("--- summary")[0] == spec.split("--- summary")[0]  # the same completions
    assert "speculation " in spec and "drafts accepted" in spec and "speculation " not in plain
    assert main([*argv, "--async-scheduling"]) == 0
    assert capsys.readouterr().out.split("--- summary")[0] == plain.split("--- summary")[0]  # overlapped: the same
    assert main([*argv, "--batch-invariant"]) == 0  # (its own numerics: its tokens may differ from the default's)
    assert "--- summary" in capsys.readouterr().out
    assert main([*argv, "--kv-offloading-size", "0.01"]) == 0  # (a host tier: the same completions)
    tiered = capsys.readouterr().out
    assert tiered.split("--- summary")[0] == plain.split("--- summary")[0] and "host tier " in tiered


@pytest.mark.slow
@pytest.mark.usefixtures("loaded")
def test_generate_trace_replays_and_a_changed_digest_is_caught(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    assert (
        main(["generate", "--chat", "What is 2+2?", "--max-tokens", "6", "Name a colour.", "--trace", str(trace)]) == 0
    )
    capsys.readouterr()
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    assert all("expect" in r for r in rows[1:-1]) and any("plan" in r["expect"] for r in rows[1:-1])
    assert rows[-1] == {"op": "end", "events": len(rows) - 2}  # (its end record)
    assert main(["replay", str(trace)]) == 0
    assert "0 diverged from expect" in capsys.readouterr().out
    i = next(i for i, r in enumerate(rows) if r.get("op") == "output" and i > 3)
    d = rows[i]["expect"]["digest"]
    rows[i]["expect"]["digest"] = ("0" if d[0] != "0" else "1") + d[1:]
    assert "long_prefill_token_threshold" not in rows[0]["config"]["scheduler"]  # (the default on the CPU: no cap)
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["replay", str(trace)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv replay: first divergence at line {i + 1} (event {i - 1}, output): digest: expected")


def test_a_chunk_cap_from_the_command_line_rides_the_trace_and_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    argv = ["generate", "--chat", "What is 2+2?", "--max-tokens", "3", "--long-prefill-token-threshold", "8"]
    assert main([*argv, "--trace", str(trace)]) == 0
    capsys.readouterr()
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    assert rows[0]["config"]["scheduler"]["long_prefill_token_threshold"] == 8
    prefills = [
        q for r in rows if r.get("op") == "schedule" for _, q in r.get("expect", {}).get("plan", {}).get("prefill", [])
    ]
    assert prefills and max(prefills) == 8  # (the prompt, in chunks of 8)
    assert main(["replay", str(trace)]) == 0
    assert "0 diverged from expect" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.usefixtures("loaded")
def test_requests_that_can_never_run_say_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    long = "word " * 9000
    prompts = lines_of(tmp_path / "p.jsonl", {"prompt": long})
    assert main(["generate", "--prompts", prompts, "--max-tokens", "3"]) == 2
    out, err = capsys.readouterr()
    assert "(not served: UNSCHEDULABLE: request 'req-0' row 0 has 9001 tokens, over max_model_len 8192)" in out
    assert "... (45,000 characters)" in out and long not in out  # the prompt shown in one short line
    assert "tokens per second   - (nothing was generated)" in out
    assert err.splitlines() == [
        ("pagedkv generate: UNSCHEDULABLE: request 'req-0' row 0 has 9001 tokens, over max_model_len 8192"),
        "pagedkv generate: no request could run (1 refused)",
    ]
    assert main(["generate", "--prompts", prompts, "Hello", "--max-tokens", "3"]) == 1  # one runs: exit 1, said
    out, err = capsys.readouterr()
    assert "requests            2 (1 refused)" in out and "prompt tokens       1\n" in out
    assert "UNSCHEDULABLE" in err
    assert main(["generate", "--json", "a b c " * 40, "--kv-cache-memory", "2"]) == 2  # a pool too small for it
    (line,) = capsys.readouterr().out.splitlines()
    obj = json.loads(line)
    assert obj["finish_reason"] == "UNSCHEDULABLE" and "needs" in obj["error"] and "the pool has 1" in obj["error"]
    assert main(["generate", "hi", "--kv-cache-memory", "0.5"]) == 2  # the model's geometry says this one
    assert capsys.readouterr().err == (
        "pagedkv generate: 524288 bytes hold 0 blocks of 737280 bytes; a pool needs at "
        "least 2 (block 0 is the null block)\n"
    )


@pytest.mark.slow
@pytest.mark.usefixtures("loaded")
def test_nothing_is_lost_when_the_page_map_or_the_user_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="the page map needs matplotlib (pip install 'pagedkv[plot]')")
    from pagedkv.app import plot
    from pagedkv.shell.engine import Engine

    real_page_map = plot.page_map

    def full_disk(*a: object, **k: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot, "page_map", full_disk)
    assert main(["generate", "Hello", "--max-tokens", "3", "--page-map", str(tmp_path / "m.png")]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("--- [0] Hello\n") and "--- summary" in out  # the completions, then the failure
    assert err == "pagedkv generate: the page map was not written: [Errno 28] No space left on device\n"
    monkeypatch.setattr(plot, "page_map", real_page_map)
    assert main(["generate", "Hello", "--max-tokens", "3", "--page-map", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()

    real_step = Engine._step
    calls = {"n": 0}

    def interrupted(self: Engine, *a: Any, **k: Any) -> Any:  # Ctrl-C in the middle of the run
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(Engine, "_step", interrupted)
    trace = tmp_path / "t.jsonl"
    first = lines_of(tmp_path / "p.jsonl", {"prompt": "Hi", "max_tokens": 1})
    argv = ["generate", "--prompts", first, "The history of", "--max-tokens", "30", "--trace", str(trace)]
    assert main(argv) == 130
    out, err = capsys.readouterr()
    assert "--- [1] Hi" in out and "--- [0]" not in out  # the one that had finished is printed
    assert err == f"pagedkv generate: interrupted; 1 of 2 requests had finished; the trace so far is in {trace}\n"
    assert main(["replay", str(trace)]) == 0  # and what was recorded replays
    assert "0 diverged from expect" in capsys.readouterr().out


@pytest.mark.slow
def test_two_ranks_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """--ranks 2 gives the tokens of one rank; sizes the leader refuses stop every rank at once (no timeout: the
    follower ends with no step and no error, where a wait for rank 0 would end in a timeout error)."""
    from pagedkv.app.ranks import run_ranks

    argv = ["generate", "--json", "What is 2+2?", "--chat", "--max-tokens", "5"]
    assert main(argv) == 0
    one = [json.loads(x)["token_ids"] for x in capsys.readouterr().out.splitlines()]
    assert main([*argv, "--ranks", "2"]) == 0
    two = [json.loads(x)["token_ids"] for x in capsys.readouterr().out.splitlines()]
    assert two == one
    assert main(["generate", "hi", "--ranks", "2", "--kv-cache-memory", "0.5"]) == 2
    assert capsys.readouterr().err == (
        "pagedkv generate: 524288 bytes hold 1 blocks of 491520 bytes; a pool needs "
        "at least 2 (block 0 is the null block)\n"
    )
    leader, follower = run_ranks(2, [], kv_cache_memory_bytes=1 << 19)
    assert "a pool needs at least 2" in leader["usage_error"] and follower["steps"] == 0 and "error" not in follower


@pytest.mark.slow
def test_a_trace_without_expect_fields_on_request(smollm2: tuple[Any, Any]) -> None:
    import io

    from pagedkv.core.verify.trace import replay
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.sampling import SamplingParams

    model, meta = smollm2
    tok = Tokenizer(meta)
    for expect in (True, False):
        out = io.StringIO()
        eng = Engine(model, tok, trace=out, trace_expect=expect, kv_cache_memory_bytes=16 << 20)
        eng.generate([("hi", tok.encode("hi"), SamplingParams(temperature=0.0, max_tokens=3))])
        eng.finish_trace()
        rows = [json.loads(x) for x in out.getvalue().splitlines()[1:-1]]  # (the events: not the end record)
        assert all(("expect" in r) is expect for r in rows)
        assert all(ev.divergence is None and ev.result["ok"] for ev in replay(out.getvalue().splitlines()))


@pytest.mark.slow
def test_vllm_policies_in_the_engine_keep_its_tokens(smollm2: tuple[Any, Any]) -> None:
    """SmolLM2 with vLLM's caching point and free queue: requests sharing a system prompt hit it in the
    step that computes it (the commit point waits a step), and every completion is the default's."""
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.sampling import SamplingParams

    model, meta = smollm2
    tok = Tokenizer(meta)
    system = "You are a careful assistant. Answer in one short sentence and name what you mean exactly. " * 3
    texts = [
        tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("What is 2+2?", "Name a colour.", "Where is Paris?")
    ]
    runs = {}
    for policy in ({}, {"caching_point": "schedule", "free_queue": "vllm"}):
        eng = Engine(model, tok, kv_cache_memory_bytes=32 << 20, **policy)
        done = eng.generate([(t, tok.encode(t), SamplingParams(temperature=0.0, max_tokens=8)) for t in texts])
        runs[bool(policy)] = ([c.token_ids for c in done], [c.cached_tokens for c in done])
    (plain_ids, plain_hits), (vllm_ids, vllm_hits) = runs[False], runs[True]
    assert vllm_ids == plain_ids
    assert plain_hits == [0, 0, 0] and min(vllm_hits[1:]) >= 32  # same-step hits, only at vLLM's caching point


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_output_that_cannot_be_written_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """Issue 29: `replay > /dev/full` and `replay | head -1` ended in a traceback (and Python's own complaint
    at exit); now one line on stderr, exit 1."""
    cmd = [sys.executable, "-m", "pagedkv.app.cli", "replay", str(SHARED_TRACE)]
    with open("/dev/full", "w") as full:
        done = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr == "pagedkv replay: cannot write: No space left on device\n"
    lines = [json.dumps({"pagedkv_trace": 1, "config": {"block_size": 4, "num_blocks": 9}})]
    lines += [json.dumps({"op": "reset"})] * 20_000  # more than a pipe holds
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([*cmd[:-1], str(big)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline()
    proc.stdout.close()  # what head -1 does after its line
    assert proc.wait(timeout=120) == 1
    assert proc.stderr is not None and proc.stderr.read() == "pagedkv replay: standard output was closed\n"
