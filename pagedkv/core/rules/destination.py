"""Destination blocks (AR -> DiT): KV that arrives from elsewhere into a request's reserved blocks.

A row admitted with ``pending_tokens`` has its blocks for that range reserved and
pending (except what the prefix cache already holds); ``publish`` refuses to let
attention read a pending block until ``mark_ready`` says its KV arrived.
"""

from __future__ import annotations

from returns.result import Failure, Result, Success

from pagedkv.core.outputs.effects import MarkedReady
from pagedkv.core.errors import ErrorCode, KVError, RequestId, fail, invalid, is_int, is_request_id, shown
from pagedkv.core.store.state import KVState, Step
from pagedkv.core.store.txn import Txn


def mark_ready(
    state: KVState, request_id: RequestId, row: int, start: int, end: int
) -> Result[Step[MarkedReady], KVError]:
    """KV of tokens ``[start, end)`` of a row arrived: its pending blocks covered by it are ready.

    A block is covered when the range holds all of its arriving tokens (the last pending block
    may be partial: it holds tokens up to the row's ``pending_tokens``). Marking again is a no-op.
    """
    if not is_request_id(request_id):
        return Failure(
            invalid(f"request id must be a string or a 64-bit integer, got {shown(request_id)}", field="request")
        )
    req = state.requests.get(request_id)
    if req is None:
        return fail(ErrorCode.UNKNOWN_REQUEST, f"request {shown(request_id)} is not admitted", request_id)
    if not is_int(row) or not 0 <= row < len(req.slots):
        return Failure(invalid(f"request {shown(request_id)} has no row {shown(row)}", request=request_id, field="row"))
    slot = req.slots[row]
    record = state.rows[slot]
    arriving, pending = record.pending
    if not (is_int(start) and is_int(end) and 0 <= start < end <= arriving):
        return Failure(
            invalid(
                f"request {shown(request_id)} row {row}: [{shown(start)}, {shown(end)}) is not inside the "
                f"arriving range [0, {arriving})",
                request=request_id,
                field="range",
            )
        )
    bs = state.config.block_size
    ready = frozenset(j for j in pending if start <= j * bs and min((j + 1) * bs, arriving) <= end)
    txn = Txn(state)
    txn.rows[slot] = record.with_pending((arriving, pending - ready))
    effect = MarkedReady(request_id, row, tuple(sorted(ready)), tuple(sorted(pending - ready)))
    return Success(Step(txn.done(), effect))
