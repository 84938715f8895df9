"""Typed refusals of the core.

A refused input is a value, not an exception: every transition returns
``Failure(KVError)`` and leaves the caller holding the old state. A broken
invariant is a bug and raises ``InvariantError`` instead: raised, never asserted, so
that ``python -O`` (which strips ``assert``) keeps every check.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeGuard

from returns.result import Failure

RequestId = str | int


class InvariantError(AssertionError):
    """A broken invariant of pagedkv's own state: a bug in pagedkv, never the caller's input (that is a
    ``KVError``). An ``AssertionError`` that ``python -O`` cannot strip."""


class GivenHashError(Exception):
    """A block hash a caller gave (``RequestSpec.block_hashes``, ``cache_ahead_many``'s ``hashes``) is not the
    core's own hash of that block (found under ``CacheConfig(check_given_hashes=True)``)."""

    def __init__(self, block: int, expected: bytes | None, width: int = 0) -> None:
        super().__init__(
            f"block_hashes[{block}] is not the hash of block {block} (expected {expected.hex()})"
            if expected is not None
            else f"block_hashes[{block}] is not a {width}-byte hash"
        )
        self.block = block

    def refusal(self, request: RequestId) -> KVError:
        return KVError(ErrorCode.INVALID, f"request {shown(request)}: {self}", request=request, field="block_hashes")


class ErrorCode(StrEnum):
    """The error codes of trace contract version 1 (see docs/trace.md)."""

    NO_CAPACITY = "NO_CAPACITY"  # temporary: fits once blocks are freed
    UNSCHEDULABLE = "UNSCHEDULABLE"  # permanent: never fits this pool / limits
    DUPLICATE_REQUEST = "DUPLICATE_REQUEST"
    UNKNOWN_REQUEST = "UNKNOWN_REQUEST"
    INVALID = "INVALID"
    STALE_METADATA = "STALE_METADATA"  # raised by the shell's worker
    CONFLICTING_METADATA = "CONFLICTING_METADATA"  # raised by the shell's worker
    BLOCKS_IN_USE = "BLOCKS_IN_USE"  # temporary: reset_prefix_cache under "when_idle" while blocks are held


@dataclass(frozen=True, slots=True)
class KVError:
    """Why a transition was refused, with the numbers that explain it.

    >>> e = KVError(ErrorCode.NO_CAPACITY, "needs 4 blocks, 2 free", requested=4, available=2)
    >>> e.permanent
    False
    """

    code: ErrorCode
    message: str
    request: RequestId | None = None
    field: str | None = None
    requested: int | None = None
    available: int | None = None

    @property
    def permanent(self) -> bool:
        """Only ``NO_CAPACITY`` and ``BLOCKS_IN_USE`` can succeed later, once blocks are freed."""
        return self.code is not ErrorCode.NO_CAPACITY and self.code is not ErrorCode.BLOCKS_IN_USE


SHOWN_DIGITS = 60  # an integer longer than this is named by its size in messages, not spelled out


def shown(value: object) -> str:
    """``repr(value)`` for a message, except that an integer too long to print (Python refuses past
    4,300 digits, and a message needs none of them) is named by its size.

    >>> shown("r1"), shown(7), shown(10**100)
    ("'r1'", '7', '<an integer of 101 digits>')
    """
    if type(value) is int and value.bit_length() > SHOWN_DIGITS * 3:  # past ~54 digits
        digits = len(str(abs(value))) if value.bit_length() < 14_000 else int(value.bit_length() * 0.30103) + 1
        return f"<an integer of {'about ' if value.bit_length() >= 14_000 else ''}{digits} digits>"
    try:
        return repr(value)
    except (ValueError, RecursionError):  # a container of such integers, or one nested past Python's depth
        return f"<a {type(value).__name__} too large to show>"


def fail(code: ErrorCode, message: str, rid: RequestId | None, **numbers: int) -> Failure[KVError]:
    """A refusal with the numbers that explain it (``requested``, ``available``)."""
    return Failure(KVError(code, message, request=rid, **numbers))  # type: ignore[arg-type]


def invalid(message: str, *, request: RequestId | None = None, field: str | None = None) -> KVError:
    return KVError(ErrorCode.INVALID, message, request=request, field=field)


def is_int(value: object) -> bool:
    """A JSON-style integer: ``int`` but not ``bool`` (``True`` is an int in Python)."""
    return type(value) is int


TOKEN_ID_LIMIT = 1 << 64  # token ids are unsigned 64-bit integers (the core packs them in eight bytes)


def is_token_id(value: object) -> bool:
    """An integer in ``[0, 2**64)`` (never a bool).

    >>> is_token_id(7), is_token_id(-1), is_token_id(2**64), is_token_id(True)
    (True, False, False, False)
    """
    return type(value) is int and 0 <= value < TOKEN_ID_LIMIT


def are_token_ids(ids: Sequence[object]) -> bool:
    """Every item a token id, judged at C speed: the types, then the range (what an unsigned
    64-bit array takes). Callers name the first bad one with ``is_token_id`` when it is False.

    >>> are_token_ids([1, 2]), are_token_ids([1, -2]), are_token_ids([1, True]), are_token_ids([])
    (True, False, False, True)
    """
    if not ids:
        return True
    if set(map(type, ids)) != {int}:
        return False
    try:
        array("Q", ids)  # type: ignore[type-var]
    except OverflowError:
        return False
    return True


def are_packed_ids(value: object) -> bool:
    """An ``array("Q")``: token ids by construction (the array holds only unsigned 64-bit integers), so a growth or
    a fill takes one with no per-id check: what a caller that keeps a request's ids as it receives them hands
    over (pagedkv's vLLM manager), each id checked once, when it joined the array.

    >>> from array import array
    >>> are_packed_ids(array("Q", [1, 2])), are_packed_ids(array("q", [1])), are_packed_ids([1])
    (True, False, False)
    """
    return type(value) is array and value.typecode == "Q"


def is_seq(value: object) -> TypeGuard[list[Any] | tuple[Any, ...]]:
    """A list or a tuple: what the core's batch arguments and per-row lists are. A str, bytes, a mapping, a set
    or a named tuple (``Placeholders(2)`` is one growth, not a list of rows) is not one.

    >>> is_seq([1]), is_seq((1,)), is_seq("ab"), is_seq({"a": 1})
    (True, True, False, False)
    """
    return type(value) is list or type(value) is tuple


_SEQ_TYPES = frozenset((list, tuple))


def pairs_of(items: object, what: str) -> tuple[list[RequestId], list[object]] | KVError:
    """A batch transition's ``[(request id, per-row list), ...]`` split in two, or ``INVALID`` naming the first
    item that is not such a pair (the request ids and the lists are judged by the transition).

    >>> pairs_of([("a", [3])], "commit_many"), pairs_of(["a"], "commit_many").message
    ((['a'], [[3]]), "commit_many takes a list of (request id, per-row list) pairs, got 'a'")
    """
    if not is_seq(items):
        return invalid(
            f"{what} takes a list of (request id, per-row list) pairs, got {shown(items):.80}", field="requests"
        )
    if items and set(map(type, items)) <= _SEQ_TYPES and set(map(len, items)) == {2}:  # (judged at C speed)
        heads, tails = zip(*items)
        return list(heads), list(tails)
    ids: list[RequestId] = []
    rows: list[object] = []
    for item in items:
        if not is_seq(item) or len(item) != 2:
            return invalid(
                f"{what} takes a list of (request id, per-row list) pairs, got {shown(item):.80}", field="requests"
            )
        ids.append(item[0])
        rows.append(item[1])
    return ids, rows


def ids_problem(request_ids: object, what: str) -> KVError | None:
    """``INVALID`` unless ``request_ids`` is a list or a tuple (its ids are judged one by one where they are read):
    a str would be read as its characters' ids, a set in no stable order."""
    if is_seq(request_ids):
        return None
    return invalid(f"{what} takes a list of request ids, got {shown(request_ids):.80}", field="requests")


INT_ID_LIMIT = 1 << 63  # an integer request id is a signed 64-bit integer (traces carry it as a JSON number)


def is_request_id(value: object) -> bool:
    """A string, or an integer in ``[-2**63, 2**63)`` (never a bool).

    >>> is_request_id("a"), is_request_id(-5), is_request_id(2**63), is_request_id(True)
    (True, True, False, False)
    """
    return type(value) is str or (type(value) is int and -INT_ID_LIMIT <= value < INT_ID_LIMIT)


def ordered_ids(rids: list[RequestId]) -> list[RequestId]:
    """``rids`` sorted in place into the core's one order of request ids, whatever set they came from: by type
    name, then value (ids of one type: their own order, sorted with no key; a mix of strings and ints by type
    name first).

    >>> ordered_ids([3, "b", 1, "a"])
    [1, 3, 'a', 'b']
    """
    try:
        rids.sort()
    except TypeError:
        rids.sort(key=_id_order)
    return rids


def _id_order(rid: RequestId) -> tuple[str, RequestId]:
    return type(rid).__name__, rid
