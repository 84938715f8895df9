"""The vLLM tests. Where vLLM is not installed they skip with the reason; CI runs them in an environment of their
own (.ci/vllm_env.sh) with ``PAGEDKV_REQUIRE_VLLM=1``, where a skip (a module or a test) is a failure: a change
that breaks vLLM parity cannot land unseen."""

from __future__ import annotations

import os

from tests.required import required_hooks

collect_ignore = ["data/make_vllm_events_golden.py"]  # a script that writes the golden file where vLLM is

# the manager takes vLLM's request.block_hashes as the core's; here the core checks each against its own
os.environ.setdefault("PAGEDKV_CHECK_HASHES", "1")

pytest_runtest_makereport, pytest_make_collect_report = required_hooks("PAGEDKV_REQUIRE_VLLM", "vLLM")
