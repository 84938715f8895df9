"""The vLLM releases pagedkv's KV cache manager answers, and the one place that knows which is installed.

The policy (docs/vllm.md): the two latest minor releases of vLLM, each call with that release's meaning. A
release outside them is refused when the manager is built, with one line naming the supported ones. What the
manager reads that differs between them is read through ``requests`` (a request's prefix-cache reading) and
here, never by asking the version elsewhere."""

from __future__ import annotations

from functools import cache

SUPPORTED = ("0.33", "0.34")  # vLLM's minor releases the manager answers, oldest first


class Unsupported(ValueError):
    """A vLLM configuration, or release, pagedkv's manager does not serve (raised at construction, never mid-run)."""


@cache
def release() -> str:
    """The installed vLLM's minor release (``"0.34"``), or ``Unsupported`` (one line: what is installed, what is
    served). vLLM itself absent: ``ImportError``."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor not in SUPPORTED:
        raise Unsupported(
            f"pagedkv's KV cache manager serves vLLM {' and '.join(SUPPORTED)} (the two latest minor releases); "
            f"vLLM {version} is installed"
        )
    return minor


def at_least(minor: str) -> bool:
    """Is the installed release ``minor`` or later (``"0.34"``)?"""
    return tuple(map(int, release().split("."))) >= tuple(map(int, minor.split(".")))
