"""The vLLM-Omni tests. Where vLLM-Omni 0.30 is not installed they skip with the reason; CI runs them in an
environment of their own (.ci/vllm_omni_env.sh) with ``PAGEDKV_REQUIRE_VLLM_OMNI=1``, where a skip (a module or a
test) is a failure: a change that breaks parity with vLLM-Omni's manager cannot land unseen."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

REQUIRED = os.environ.get("PAGEDKV_REQUIRE_VLLM_OMNI") == "1"


def _failed(report: Any) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped where the vLLM-Omni tests must run (PAGEDKV_REQUIRE_VLLM_OMNI=1): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped and "xfail" not in report.keywords:
        _failed(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped:
        _failed(report)
