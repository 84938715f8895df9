"""A request's lifecycle in the scheduler, as data: its stages, the moves (``Move``) between them,
and the table of which move may take it from where to where (h11 style).

``submit``, ``schedule``, ``on_output`` and ``cancel`` move a request only through
``advance``, which consults ``TABLE``; a move the table does not allow is a bug and
raises. docs/scheduler.md draws its diagram from the table (``diagram()``; a test
fails when the two differ).
"""

from __future__ import annotations

from enum import StrEnum

from pagedkv.core.errors import InvariantError, shown


class Stage(StrEnum):
    """Where a live request is. An ended one has left the stage map for ``finished``."""

    WAITING = "waiting"  # queued (first arrival, or back after a preemption)
    PREFILLING = "prefilling"  # admitted, its prompt (and what it generated) being computed, chunk by chunk
    DECODING = "decoding"  # generating: one token a step
    DENOISING = "denoising"  # a diffusion request's steps, planned in one step and ended by the next output


class Move(StrEnum):
    SUBMIT = "submit"
    ADMIT = "admit"  # an LLM request's blocks are reserved
    ADMIT_DIFFUSION = "admit diffusion"  # a diffusion request's blocks are reserved and all its steps planned
    PREFILLED = "prefilled"  # its last prefill chunk ran and sampled a token
    PREEMPT = "preempt"  # released by recompute; back to the front of the queue
    FINISH = "finish"  # EOS, a stop string, max_tokens, or a diffusion request's steps done
    REFUSE = "refuse"  # admission refused it for good (UNSCHEDULABLE, INVALID)
    OVERRUN = "overrun"  # its next token would pass max_model_len
    CANCEL = "cancel"  # the engine ended it (cancelled, or error)


class FinishReason(StrEnum):
    """How a request ended (``SchedState.finished``): a release reason, or the code of the refusal
    that ended it. The values are the strings traces carry."""

    FINISHED = "finished"
    CANCELLED = "cancelled"
    ERROR = "error"
    UNSCHEDULABLE = "UNSCHEDULABLE"
    INVALID = "INVALID"


END = None  # a transition's target when the request ends: it leaves the stage map

# (move, stages it may come from (None: not yet submitted), stage it goes to, or END)
TABLE: tuple[tuple[Move, tuple[Stage | None, ...], Stage | None], ...] = (
    (Move.SUBMIT, (None,), Stage.WAITING),
    (Move.ADMIT, (Stage.WAITING,), Stage.PREFILLING),
    (Move.ADMIT_DIFFUSION, (Stage.WAITING,), Stage.DENOISING),
    (Move.REFUSE, (Stage.WAITING,), END),
    (Move.PREFILLED, (Stage.PREFILLING,), Stage.DECODING),
    (Move.PREEMPT, (Stage.PREFILLING, Stage.DECODING), Stage.WAITING),
    (Move.OVERRUN, (Stage.DECODING,), END),
    (Move.FINISH, (Stage.WAITING, Stage.DECODING, Stage.DENOISING), END),  # (waiting: preempted, its stop token late)
    (Move.CANCEL, (Stage.WAITING, Stage.PREFILLING, Stage.DECODING, Stage.DENOISING), END),
)
_MOVES = {(src, move): dst for move, sources, dst in TABLE for src in sources}


def advance(phase: Stage | None, move: Move) -> Stage | None:
    """The phase ``move`` takes a request to from ``phase`` (None: it ended).

    >>> advance(Stage.WAITING, Move.ADMIT), advance(Stage.DECODING, Move.FINISH)
    (<Stage.PREFILLING: 'prefilling'>, None)
    """
    try:
        return _MOVES[(phase, move)]
    except KeyError:
        raise InvariantError(f"the lifecycle has no {shown(move.value)} from {phase}: a scheduler bug") from None


def moved(phase: Stage | None, move: Move) -> Stage:
    """``advance`` for a move that keeps the request alive."""
    to = advance(phase, move)
    if to is None:
        raise InvariantError(f"{shown(move.value)} ends a request")
    return to


def diagram() -> str:
    """The table as a Mermaid state diagram (what docs/scheduler.md shows)."""
    lines = ["stateDiagram-v2"]
    for move, sources, dst in TABLE:
        for src in sources:
            a = "[*]" if src is None else src.value
            b = "[*]" if dst is None else dst.value
            lines.append(f"    {a} --> {b}: {move.value}")
    return "\n".join(lines)
