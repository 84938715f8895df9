"""The vLLM-Omni tests. Where vLLM-Omni 0.30 is not installed they skip with the reason; CI runs them in an
environment of their own (.ci/vllm_omni_env.sh) with ``PAGEDKV_REQUIRE_VLLM_OMNI=1``, where a skip (a module or a
test) is a failure: a change that breaks parity with vLLM-Omni's manager cannot land unseen."""

from __future__ import annotations

import os

import torch

from tests.required import required_hooks

if not torch.cuda.is_available():
    # (test_vllm_omni_worker.py: vLLM's block-table writes are Triton kernels; without a GPU they run in Triton's
    # interpreter, which must be asked for before they are defined; with no device visible vLLM keeps Triton on;
    # its CPU platform gives the buffers their device)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

pytest_runtest_makereport, pytest_make_collect_report = required_hooks("PAGEDKV_REQUIRE_VLLM_OMNI", "vLLM-Omni")
