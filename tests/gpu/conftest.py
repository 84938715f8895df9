"""Every test here needs an NVIDIA GPU: marked ``cuda`` and skipped, with the reason, without one.
On the GPU machine: ``pytest -m cuda tests/gpu``."""

from __future__ import annotations

import pytest
import torch


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA is not available here); run on the GPU machine")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            if not torch.cuda.is_available():
                item.add_marker(skip)
