"""What an engine handed out, by request id: the tests' own record (an engine keeps no ended request)."""

from __future__ import annotations

from typing import Any


def keep_handed(eng: Any) -> Any:
    """``eng`` with ``eng.handed``: every completion it gives back (``step``'s and ``generate``'s, through its
    outbox, and ``cancel``'s), by request id, the latest for an id taken again."""
    eng.handed = {}
    hand_out, cancel = eng.outcomes.hand_out, eng.cancel

    def handing() -> Any:
        done = hand_out()
        eng.handed.update((c.request_id, c) for c in done)
        return done

    def cancelling(rid: Any) -> Any:
        done = cancel(rid)
        eng.handed[rid] = done
        return done

    eng.outcomes.hand_out, eng.cancel = handing, cancelling
    return eng
