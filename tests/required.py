"""The hooks that turn a skip into a failure where an optional environment must run its tests (CI's vLLM and
vLLM-Omni environments): a conftest takes them with ``required_hooks(env_var, what)``."""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from typing import Any

import pytest


def required_hooks(env_var: str, what: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``pytest_runtest_makereport`` and ``pytest_make_collect_report`` for a conftest: where ``env_var`` is "1", a
    skipped test or module is reported failed ("skipped where the <what> tests must run")."""
    required = os.environ.get(env_var) == "1"

    def failed(report: Any) -> None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped where the {what} tests must run ({env_var}=1): {reason}"

    @pytest.hookimpl(hookwrapper=True)
    def runtest(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
        outcome = yield
        report = outcome.get_result()
        if required and report.skipped and "xfail" not in report.keywords:
            failed(report)

    @pytest.hookimpl(hookwrapper=True)
    def collect(collector: pytest.Collector) -> Generator[None, Any, None]:
        outcome = yield
        report = outcome.get_result()
        if required and report.skipped:
            failed(report)

    return runtest, collect
