"""Mamba mixer backends by name: ``get_mixer("torch" | "mamba_ssm" | "auto", device)``. One that cannot run
raises ``BackendUnavailable`` naming what to install."""

from __future__ import annotations

import torch

from pagedkv.shell.errors import BackendUnavailable
from pagedkv.shell.mamba import MixerBackend, TorchMixer


def get_mixer(name: str, device: torch.device | None = None) -> MixerBackend:
    """The mixer backend called ``name``: ``torch`` or ``mamba_ssm`` (``BackendUnavailable`` where it cannot run);
    ``auto``: ``mamba_ssm`` on a CUDA ``device`` where its packages import, else ``torch``."""
    if name == "auto":
        if device is not None and device.type == "cuda":
            try:
                return get_mixer("mamba_ssm")
            except BackendUnavailable:
                pass
        return TorchMixer()
    if name == "torch":
        return TorchMixer()
    if name == "mamba_ssm":
        from pagedkv.shell.mamba_ssm import MambaSsmMixer

        return MambaSsmMixer()
    raise BackendUnavailable(name, "one of: torch, mamba_ssm", "no Mamba mixer by that name")
