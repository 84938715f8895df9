"""Backends by name: ``get_backend("torch" | "flash_attn" | "npu" | "triton" | "flashinfer")``.

One that cannot run here raises ``BackendUnavailable`` naming what to install; there is no
silent dense fallback (a paged forward needs an installed ``ForwardBatch``), and a backend that
cannot serve a layer raises rather than rerouting it.
"""

from __future__ import annotations

from pagedkv.core.config import InvalidConfig
from pagedkv.shell.attention.base import AttentionBackend
from pagedkv.shell.attention.torch_ref import TorchBackend
from pagedkv.shell.errors import BackendUnavailable


def get_backend(name: str, *, invariant: bool = False) -> AttentionBackend:
    """The backend called ``name``; raises ``BackendUnavailable`` naming the package when it cannot run.
    ``invariant``: its attention with a row's result independent of the batch (shell/invariant.py): ``torch``'s
    fixed-split attention, ``triton``'s kernels as they are (fixed 256-key splits); no other backend has one."""
    if invariant and name not in ("torch", "triton"):
        raise InvalidConfig(f"backend {name!r} has no batch-invariant attention (torch and triton have)")
    if name == "torch":
        return TorchBackend(invariant=invariant)
    if name == "flash_attn":
        from pagedkv.shell.attention.flash import FlashAttnBackend

        return FlashAttnBackend()
    if name == "npu":
        from pagedkv.shell.attention.npu import NpuBackend

        return NpuBackend()
    if name == "triton":
        from pagedkv.shell.attention.triton import TritonBackend

        return TritonBackend()
    if name == "flashinfer":
        from pagedkv.shell.attention.flashinfer import FlashInferBackend

        return FlashInferBackend()
    if name == "triton+flashinfer":  # decode on triton (in CUDA graphs), several query tokens on FlashInfer
        from pagedkv.shell.attention.phases import PhaseBackend

        return PhaseBackend(get_backend("triton"), get_backend("flashinfer"))
    raise BackendUnavailable(
        name, "one of: torch, flash_attn, npu, triton, flashinfer, triton+flashinfer", "no backend by that name"
    )
