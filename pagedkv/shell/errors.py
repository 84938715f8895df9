"""The shell's errors: a refused install carries the core's typed error."""

from __future__ import annotations

from pagedkv.core.errors import ErrorCode, KVError


class ShellError(Exception):
    """A refused shell operation; ``error`` has the code (``STALE_METADATA``, ...) and the numbers."""

    def __init__(self, error: KVError) -> None:
        super().__init__(f"{error.code.value}: {error.message}")
        self.error = error

    @property
    def code(self) -> ErrorCode:
        return self.error.code


class BackendUnavailable(ShellError):
    """A backend (attention, a Mamba mixer) whose package is missing: the message names what to install."""

    def __init__(self, name: str, install: str, reason: str) -> None:
        super().__init__(
            KVError(ErrorCode.INVALID, f"backend {name!r} is unavailable ({reason}); install it with: {install}")
        )
        self.backend = name


def refuse(code: ErrorCode, message: str, **kw: object) -> ShellError:
    return ShellError(KVError(code, message, **kw))  # type: ignore[arg-type]


class EngineBusy(RuntimeError):
    """A second thread entered an engine that one thread is inside: the engine is single-threaded by contract
    (its state is the scheduler's value, read and replaced by each call), so the second call is refused at once,
    nothing of it done. Serve an engine from one thread, or hand requests to that thread through a queue."""
