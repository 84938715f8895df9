"""A decode step as one transition for the whole batch: commit what the forward
computed, append the sampled ids.

Shaped for the common case (measured in bench/peers.py): a one-row request whose
token neither completes nor opens a block costs two integer writes and eight
bytes; a block boundary costs one hash and one record; anything else (windows,
several rows, errors) takes the general path, which is commit then append.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from returns.result import Failure, Result, Success

from pagedkv.core.caching import hash_full_blocks
from pagedkv.core.commit import _commit_one
from pagedkv.core.effects import Decoded
from pagedkv.core.errors import ErrorCode, KVError, RequestId, invalid, is_request_id, shown
from pagedkv.core.events import BlockStored
from pagedkv.core.growth import _batch, _batch_leaves, _grow, _open_block
from pagedkv.core.state import SLOT_SHIFT, KVState, Request, Row, Step
from pagedkv.core.tails import Awaiting, unpack_ids
from pagedkv.core.txn import Txn


def commit_decode(state: KVState, request_ids: Iterable[RequestId]) -> Result[Step[Decoded], KVError]:
    """The forward computed every position of the named requests: each row is
    committed through its length (full blocks enter the prefix cache).

    Equivalent to ``commit_many`` with each row's length (a test holds them
    equal); costs a dict update a request unless a block completes.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(3),))).unwrap().state
    >>> commit_decode(s, ["a"]).unwrap().state.row_computed[0]
    3
    """
    return decode_step(state, request_ids, None, append_tokens=False)


def decode_step(
    state: KVState, request_ids: Iterable[RequestId], tokens: Sequence[int] | None, *, append_tokens: bool = True
) -> Result[Step[Decoded], KVError]:
    """One decode step as one transition: every row of the named requests is committed through its
    length (blocks that fill are hashed and cached), then grows by ``tokens[k]`` (``None``: a count).
    The same as ``commit_many`` then ``append_many`` (a test holds them equal); all of it, or nothing.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True))
    >>> s = admit(s, RequestSpec("a", (RowSpec.of_tokens([1, 2, 3]),))).unwrap().state
    >>> s = decode_step(s, ["a"], [4]).unwrap().state   # 1 2 3 computed; 4 appended
    >>> step = decode_step(s, ["a"], [5]).unwrap()      # block [1 2 3 4] fills and is cached; 5 opens a block
    >>> len(step.state.cache), step.effect.allocations, step.state.row_len[0]
    (1, (('a', 2),), 5)
    """
    batch = _batch(request_ids, tokens)
    if isinstance(batch, KVError):
        return Failure(batch)
    (ids, toks), txn, cfg, get = batch, Txn(state), state.config, state.requests.get
    bs, limit, mask = cfg.block_size, cfg.length_limit, (1 << SLOT_SHIFT) - 1
    # full attention only (no window logic), each hash over its own block (it fills as its last token commits)
    fast = not any(g.is_windowed or g.is_state for g in cfg.groups) and not cfg.hash_lookahead
    lens, done = _batch_leaves(txn.row_len, len(ids)), _batch_leaves(txn.row_computed, len(ids))
    # token tails: written when ids arrive; a count stops a row's ids (the general path does that)
    tails = _batch_leaves(txn.row_tail, len(ids)) if append_tokens and cfg.enable_prefix_caching else None
    allocations: list[tuple[RequestId, int]] = []
    freed = 0
    for k, rid in enumerate(ids):  # the hot loop: the common row costs a few list writes, no call
        try:
            req = get(rid)
        except TypeError:  # an unhashable id: the general path says INVALID
            req = None
        if fast and req is not None and (slot := req.decode_slot) >= 0:
            hi, o = slot >> SLOT_SHIFT, slot & mask
            leaf, done_leaf = lens[hi], done[hi]
            n = leaf[o]
            if done_leaf[o] // bs == n // bs:  # committing through n completes no block
                if not append_tokens:
                    done_leaf[o] = n
                    continue
                if n % bs and n < limit:  # and the new token goes into the open block (a count stops a row's
                    tail = None if tails is None else tails[hi][o]  # ids; a row awaiting ids: the general path)
                    if tail is None or (toks is not None and type(tail) is bytes):
                        done_leaf[o], leaf[o] = n, n + 1
                        if tail is not None:  # the open block's ids: the tail
                            tails[hi][o] = tail + toks[k].to_bytes(8, "little")  # type: ignore[index]
                        continue
            elif (gen := _block_filled(txn, req, slot, n, None if toks is None or not append_tokens else toks[k],
                                       append_tokens, leaf, done_leaf, None if tails is None else tails[hi])) >= 0:
                if gen:
                    allocations.append((rid, gen))
                continue
        got = _general(txn, rid, req, None if toks is None else toks[k], append_tokens)
        if isinstance(got, KVError):
            return Failure(got)
        gen, gone = got
        freed += gone
        if gen:
            allocations.append((rid, gen))
    return Success(Step(txn.done(), Decoded(tuple(allocations), freed, tuple(txn.events))))


def _block_filled(txn: Txn, req: Request, slot: int, n: int, token: int | None, append_tokens: bool,
                  leaf: list[int], done_leaf: list[int], tail_leaf: list[bytes | None] | None) -> int:  # fmt: skip
    """A one-row request committed through ``n`` filled a block: hash it; when appending, the token opens
    the next block. The generation that takes (0 when nothing was appended), or -1 when the row takes the
    general path (the token cannot open a block here: a length limit, a short pool, ids still awaited)."""
    o = slot & ((1 << SLOT_SHIFT) - 1)
    if append_tokens and not (n % txn.config.block_size == 0 and n < txn.config.length_limit
                              and len(txn.config.groups) <= txn.free_blocks
                              and (tail_leaf is None or (token is not None and type(tail_leaf[o]) is not Awaiting))):
        return -1
    done_leaf[o] = n
    record = txn.rows[slot]
    if not append_tokens:
        hashes = _hash_filled(txn, req, slot, n, record, txn.row_tail[slot])
        if hashes is not record.hashes:
            txn.rows[slot] = record.with_hashes(hashes)
        return 0
    hashes = _hash_filled(txn, req, slot, n, record, tail_leaf[o] if tail_leaf is not None else None)
    return _open_block(txn, slot, n, token, record, hashes, leaf, tail_leaf)


def _general(txn: Txn, rid: RequestId, req: Request | None, token: int | None,
             append_tokens: bool) -> tuple[int, int] | KVError:  # fmt: skip
    """Errors, windows, several rows, a full pool: commit then append, as ``commit_many`` and
    ``append_many`` do. (The generation taken, or 0; blocks freed.)"""
    if req is None or not is_request_id(rid):
        return _unknown(rid)
    committed = _commit_one(txn, rid, [txn.row_len[s] for s in req.slots])
    if isinstance(committed, KVError):
        return committed
    gen = committed.generation
    if append_tokens:
        grown = _grow(txn, rid, None if token is None else [[token]] * len(req.slots))
        if isinstance(grown, KVError):
            return grown
        gen = grown or gen
    return gen or 0, committed.freed_blocks


def _hash_filled(txn: Txn, req: Request, slot: int, n: int, record: Row, tail: bytes | None) -> bytes:
    """A one-row decode request commits through ``n``: its hashes once the blocks that filled are
    hashed and cached. The common case costs one hash: the tail holds exactly the block that
    filled (block n / block_size - 1) and every block before it is hashed."""
    base = txn.base
    hashes = record.hashes
    if record.ids is None or not base.config.enable_prefix_caching or req.cache_epoch != base.cache_epoch:
        return hashes
    bs = base.config.block_size
    j = n // bs - 1
    hw = record.hw
    if tail is None or len(tail) != bs << 3 or len(hashes) != j * hw:
        return hash_full_blocks(txn, req, 0, slot, n, record, tail).hashes
    parent = hashes[-hw:] if j else base.cache.root
    keys = req.keys
    h = base.config.hash_fn(parent, tail, keys.at(j, bs))
    add = txn.index.add
    for g, group_blocks in enumerate(record.blocks):
        b = group_blocks[j]
        if b and add(g, h, b):
            txn.events.append(BlockStored(h, parent if j else None, unpack_ids(tail), g, b, keys.raw(j, bs)))
    return hashes + h


def _unknown(rid: object) -> KVError:
    if not is_request_id(rid):
        return invalid(f"request id must be a string or a 64-bit integer, got {shown(rid)}", field="request")
    return KVError(ErrorCode.UNKNOWN_REQUEST, f"request {shown(rid)} is not admitted", request=rid)  # type: ignore[arg-type]
