"""A benchmark's child processes: one tree (or one engine) a process, its figures handed back as one ``RESULT`` line
of JSON. Standard library only (vLLM's process imports it too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def tree_env(path: str, *, only: bool = False) -> dict[str, str]:
    """The environment of a child that imports the pagedkv of the tree at ``path``: PYTHONPATH at it first (``only``:
    at it alone), the rest of this process' after."""
    rest = "" if only else os.pathsep + os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.path.abspath(path) + rest)


def result(payload: Any) -> None:
    """The child's side: its figures, as the line ``child_result`` reads."""
    print("RESULT " + json.dumps(payload), flush=True)


def child_result(
    cmd: list[str],
    env: dict[str, str],
    what: str,
    *,
    cwd: str | None = None,
    timeout: float | None = None,
    echo: bool = False,
) -> Any:
    """Run ``cmd``; its ``RESULT`` line's JSON, or None where it gave none (timed out, failed), said on stderr with
    the end of its output under ``what``. ``echo``: the end of its stderr (its progress) passed on either way."""
    try:
        done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"{what}: timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    if echo:
        sys.stderr.write(done.stderr[-2000:])
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(f"{what} failed:\n{(done.stdout + done.stderr)[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line[7:])
