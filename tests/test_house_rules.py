"""Rules of the house that a reader could break without a test noticing: timing belongs in bench/ (no test
asserts a wall time: a loaded machine failed one), and CI's vLLM tests cannot pass by skipping."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLOCKS = {"perf_counter", "time", "monotonic", "perf_counter_ns", "monotonic_ns"}


def _reads_a_clock(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in CLOCKS
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "time"
        for n in ast.walk(node)
    )


def test_no_test_asserts_a_wall_time() -> None:
    """An ``assert`` that reads a clock, or compares a name a clock was read into, fails on a loaded machine
    (``test_two_ranks_from_the_command_line`` once took 74.9 s against its 50): timing is bench/'s."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text())
        timed = {
            t.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and _reads_a_clock(n.value)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for n in ast.walk(tree):
            if isinstance(n, ast.Assert) and (
                _reads_a_clock(n.test) or any(isinstance(x, ast.Name) and x.id in timed for x in ast.walk(n.test))
            ):
                found.append(f"{path.relative_to(ROOT)}:{n.lineno}")
    assert found == []


def test_a_skipped_vllm_test_fails_where_vllm_must_run() -> None:
    """CI runs tests/integrations with ``PAGEDKV_REQUIRE_VLLM=1`` in an environment with vLLM: there a test that
    skips (vLLM not importable after all) fails .ci/run instead of passing in silence."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is importable here: its tests run, none skips")
    test = "tests/integrations/test_vllm_manager.py::test_pagedkv_hashes_are_vllms_sha256_cbor"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", test],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PAGEDKV_REQUIRE_VLLM": "1"},
    )
    assert run.returncode == 1 and "skipped where the vLLM tests must run" in run.stdout, run.stdout[-2000:]
    plain = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", test],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PAGEDKV_REQUIRE_VLLM"},
    )
    assert plain.returncode == 0 and "1 skipped" in plain.stdout, plain.stdout[-2000:]
