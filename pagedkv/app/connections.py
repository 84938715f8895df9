"""The server's connections (``pagedkv serve``): how many it holds, and how long a client may take to send its
request. uvicorn's own h11 protocol times out an idle connection only after a response (``timeout_keep_alive``):
one that opens and never finishes its request's head is held forever, and enough of them (a slow-headers attack,
or clients that hung) exhaust the descriptors until ``/health`` stops answering. ``GuardedH11`` is that protocol
with what it lacks: a connection that has not sent a whole request head within ``read_timeout`` seconds (of
opening, or of its last response) is closed, and past ``max_connections`` the longest-idle connection that is not
in a request makes room for the new one (the new one is closed where every connection is in one). A request's body
has the same ``read_timeout`` in the routes (``OpenAIServer``: 408)."""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedkv.app.args import KEEP_ALIVE_S, READ_TIMEOUT_S


def default_max_connections() -> int:
    """The descriptors this process may open (its soft limit raised to the hard one, as vLLM's server raises it),
    less a margin for the pipe, the model's files and the threads: the most connections held at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 16
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, 1 << 16), hard))
            soft = min(want, 1 << 16)
        except (ValueError, OSError):  # (not allowed here: the soft limit stands)
            pass
    limit = soft if soft != resource.RLIM_INFINITY else 1 << 16
    return max(16, min(limit - 256, 1 << 15))


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a request-head timeout and a connection cap (module docstring); made by
    ``guarded`` with its settings."""

    read_timeout: float = READ_TIMEOUT_S
    max_connections: int = 1 << 15

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = time.monotonic()
        self.head_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections and not self._make_room():
            transport.close()
            return
        self._arm()

    def _make_room(self) -> bool:
        """Close the connection idle longest that is not in a request (none: False)."""
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11) and c._waiting()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since)
        oldest.transport.close()
        self.connections.discard(oldest)
        return True

    def _waiting(self) -> bool:
        """Is no request of this connection in progress (its head not yet whole, nothing being answered)?"""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _arm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.read_timeout, self._too_slow)

    def _too_slow(self) -> None:
        self.head_timer = None
        if self._waiting() and not self.transport.is_closing():
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.idle_since = time.monotonic()
        if not self.transport.is_closing():
            self._arm()  # (the next request's head has as long again)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        super().connection_lost(exc)


def guarded(read_timeout: float, max_connections: int) -> type[GuardedH11]:
    """``GuardedH11`` with these settings (uvicorn makes one a connection from the class it is given)."""
    return type("GuardedH11", (GuardedH11,), {"read_timeout": read_timeout, "max_connections": max_connections})


def http_config(
    app: Any,
    *,
    read_timeout: float = READ_TIMEOUT_S,
    max_connections: int | None = None,
    timeout_keep_alive: int = KEEP_ALIVE_S,
) -> uvicorn.Config:
    """uvicorn's configuration for the server: its app over ``GuardedH11``, quiet (the server logs its own lines)."""
    most = max_connections if max_connections is not None else default_max_connections()
    return uvicorn.Config(
        app,
        http=guarded(read_timeout, most),
        log_level="warning",
        access_log=False,
        timeout_keep_alive=timeout_keep_alive,
    )
