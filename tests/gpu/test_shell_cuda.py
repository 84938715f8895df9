"""The shell on a CUDA device: sizing by a memory fraction, installs into device buffers, the torch
reference over device pages (the checks of bench/shell_checks.py, asserted)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

from tests.gpu import shell_checks


def test_sizing_by_a_memory_fraction() -> None:
    name, detail, good = shell_checks.check_sizing()
    assert good, f"{name}: {detail}"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_the_torch_backend_over_device_pages_equals_dense(dtype: torch.dtype, tol: float) -> None:
    name, detail, good = shell_checks.check_pages(dtype, tol)
    assert good, f"{name}: {detail}"
