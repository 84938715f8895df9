"""Moving KV that was computed elsewhere (an AR stage) into a request's reserved destination blocks.

The core admits the destination request with ``pending_tokens``: its blocks for that range are
reserved and pending, except those the prefix cache already holds. The connector copies only the
missing (pending) blocks from the source pages, then marks them ready in the core. In one process
it copies between page pools; between ranks the receiver asks the sender for exactly the source
block ids it lacks, over torch.distributed send/recv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedkv.core.errors import ErrorCode, RequestId
from pagedkv.core.store.state import Blocks, KVState
from pagedkv.core.rules.destination import mark_ready
from pagedkv.shell.errors import refuse
from pagedkv.shell.pool import PagePool


@dataclass(frozen=True, slots=True)
class Transfer:
    row: int
    position: int
    src: int  # source block id (group 0 of the source row)
    dst: int  # reserved destination block id


def missing_blocks(state: KVState, request_id: RequestId, source: tuple[Blocks, ...]) -> list[Transfer]:
    """The pending blocks of ``request_id``, paired with the source's block at the same position."""
    req = state.requests[request_id]
    out = []
    for i, slot in enumerate(req.slots):
        _, pending = state.row_pending[slot]
        for j in sorted(pending):
            out.append(Transfer(i, j, source[i][0][j], state.row_blocks[slot][0][j]))
    return out


def _whole_pages(*pools: PagePool) -> None:
    """Pages that move as they are: fp8 pages would need their layers' scales to travel with them (refused, before
    anything is asked for or written)."""
    if any(p.fp8 for p in pools):
        raise refuse(ErrorCode.INVALID, "fp8 KV pages are not transferred yet: their scales do not travel with them")


def _ready(state: KVState, request_id: RequestId) -> KVState:
    req = state.requests[request_id]
    for i, slot in enumerate(req.slots):
        arriving, pending = state.row_pending[slot]
        if pending:
            state = mark_ready(state, request_id, i, 0, arriving).unwrap().state
    return state


def copy_missing(
    src: PagePool, dst: PagePool, state: KVState, request_id: RequestId, source: tuple[Blocks, ...]
) -> tuple[KVState, int]:
    """Copy the missing blocks, every layer, K and V; returns the state with them ready and the count."""
    _whole_pages(src, dst)
    moves = missing_blocks(state, request_id, source)
    if moves:
        s_ids = torch.tensor([m.src for m in moves], device=src.device)
        d_ids = torch.tensor([m.dst for m in moves], device=dst.device)
        for layer in range(dst.num_layers):
            dst.k[layer].index_copy_(0, d_ids, src.k[layer].index_select(0, s_ids).to(dst.device, dst.dtype))
            dst.v[layer].index_copy_(0, d_ids, src.v[layer].index_select(0, s_ids).to(dst.device, dst.dtype))
    return _ready(state, request_id), len(moves)


def recv_missing(
    dst: PagePool, state: KVState, request_id: RequestId, source: tuple[Blocks, ...], src_rank: int
) -> tuple[KVState, int]:
    """Receiver side: ask ``src_rank`` for the missing source blocks, write them, mark them ready."""
    _whole_pages(dst)
    moves = missing_blocks(state, request_id, source)
    dist.send(torch.tensor([len(moves)], dtype=torch.int64), src_rank)
    if moves:
        dist.send(torch.tensor([m.src for m in moves], dtype=torch.int64), src_rank)
        # (layers, K|V, blocks, block_size, kv_heads, head_dim)
        buf = torch.empty((dst.num_layers, 2, len(moves), *dst.k[0].shape[1:]), dtype=dst.dtype)
        dist.recv(buf, src_rank)
        d_ids = torch.tensor([m.dst for m in moves], device=dst.device)
        for layer in range(dst.num_layers):
            dst.k[layer].index_copy_(0, d_ids, buf[layer, 0].to(dst.device))
            dst.v[layer].index_copy_(0, d_ids, buf[layer, 1].to(dst.device))
    return _ready(state, request_id), len(moves)


def serve_missing(src: PagePool, dst_rank: int) -> int:
    """Sender side: answer one ``recv_missing`` with exactly the blocks it asked for; returns the count."""
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, dst_rank)
    count = int(n)
    if count:
        ids = torch.empty(count, dtype=torch.int64)
        dist.recv(ids, dst_rank)
        pages = [
            torch.stack(
                [src.k[layer].index_select(0, ids.to(src.device)), src.v[layer].index_select(0, ids.to(src.device))]
            )
            for layer in range(src.num_layers)
        ]
        dist.send(torch.stack(pages).cpu().contiguous(), dst_rank)
    return count
