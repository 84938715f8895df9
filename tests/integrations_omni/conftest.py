"""The vLLM-Omni tests. Where vLLM-Omni 0.30 is not installed they skip with the reason; CI runs them in an
environment of their own (.ci/vllm_omni_env.sh) with ``PAGEDKV_REQUIRE_VLLM_OMNI=1``, where a skip (a module or a
test) is a failure: a change that breaks parity with vLLM-Omni's manager cannot land unseen."""

from __future__ import annotations

from tests.required import required_hooks

pytest_runtest_makereport, pytest_make_collect_report = required_hooks("PAGEDKV_REQUIRE_VLLM_OMNI", "vLLM-Omni")
