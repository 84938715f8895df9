"""mypy (strict, with returns' plugin) passes on the whole package: core, shell, models and app
(pyproject's [tool.mypy]; only the Triton kernels' untyped parameters are let through)."""

import os
from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_passes_on_the_package() -> None:
    cwd = os.getcwd()
    os.chdir(ROOT)  # mypy reads [tool.mypy] (files, plugins) from pyproject.toml here
    try:
        out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--no-incremental"])
    finally:
        os.chdir(cwd)
    assert status == 0, out + err
    assert "Success" in out
