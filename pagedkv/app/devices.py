"""What ``pagedkv generate`` checks of the machine before a model loads (the device is there, the backend runs
on it, the ranks split the model's heads)."""

from __future__ import annotations


from pagedkv.app.args import UsageError


def check_backend(name: str, device_name: str) -> None:
    """The attention backend can run on ``device_name`` here (its package imports), before the model loads."""
    import torch

    from pagedkv.shell.engine_args import backend_for
    from pagedkv.shell.attention import get_backend
    from pagedkv.shell.errors import BackendUnavailable

    resolved = backend_for(name, torch.device(device_name))
    if resolved not in ("torch",) and not device_name.startswith("cuda") and resolved != "npu":
        raise UsageError(f"--backend {name} runs on a CUDA device; use --device cuda, or --backend torch on the CPU")
    try:
        get_backend(resolved)
    except BackendUnavailable as e:
        raise UsageError(str(e)) from None


def check_device(name: str, ranks: int) -> None:
    """The device is there (torch imported), and SmolLM2's 9 query heads split over ``ranks``."""
    import torch

    from pagedkv.models.llama import SMOLLM2_SHAPES

    heads = SMOLLM2_SHAPES.num_heads
    if ranks > heads:
        raise UsageError(f"--ranks {ranks}: SmolLM2-135M has {heads} query heads to split; use 1 to {heads}")
    if name.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(name.partition(":")[2] or 0)
        if count == 0:
            raise UsageError(f"--device {name}, but no CUDA device is available")
        if index >= count or (ranks > 1 and ranks > count):
            need = f"{ranks} ranks need {ranks}" if ranks > 1 else f"{name} needs {index + 1}"
            raise UsageError(f"--device {name}: {need} CUDA devices; this machine has {count}")


# -- the run --------------------------------------------------------------------------------------------------
