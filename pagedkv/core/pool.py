"""The block pool's mechanics, on a transition's working copy: allocate, evict, free.

Refcounts by block; the free queue in LRU order, a doubly linked list over block
ids with the null block 0 as its sentinel (``nxt[0]`` is the head, ``prv[0]`` the
tail): allocation pops the head (the least recently freed block) and evicts its
cached hash, a release pushes a request's blocks to the tail, tail first (under the
``vllm`` policy the ones without a hash to the head, as vLLM does), a prefix hit takes
a free block out of the middle. Every operation is O(1) a
block: no scan of the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core.events import BlockRemoved
from pagedkv.core.state import Request
from pagedkv.core.txn import Txn


def pop_blocks(txn: Txn, k: int) -> tuple[int, ...]:
    """Take ``k`` blocks from the head of the free queue (least recently freed), one reference
    each; a cached one leaves the index (its content is about to be overwritten)."""
    if not k:
        return ()
    nxt = txn.nxt
    sh, m = nxt.shift, nxt.mask
    leaves = nxt.leaves
    out = []
    b = leaves[0][0]
    for _ in range(k):
        assert b != 0, "a pop on an empty free queue: capacity was not checked"
        out.append(b)
        b = leaves[b >> sh][b & m]
    nxt[0] = b
    txn.prv[b] = 0
    txn.free_blocks -= k
    own = txn.refcount.own
    cached = txn.cache_view().is_cached
    for x in out:
        own(x >> sh)[x & m] = 1
        if cached(x):
            g, h = txn.index.evict(x)  # type: ignore[misc]
            txn.events.append(BlockRemoved(h, g, x))
    return tuple(out)


def push_free(txn: Txn, b: int) -> None:
    """Put ``b`` in the free queue: at the tail (most recently freed), or, under the ``vllm`` policy, at the
    head when it carries no hash (it can never be hit: reused first, as vLLM's block pool does)."""
    nxt, prv = txn.nxt, txn.prv
    if txn.config.free_queue == "vllm" and not _hit_able(txn, b):
        head = nxt[0]
        prv[head] = b
        nxt[b] = head
        prv[b] = 0
        nxt[0] = b
    else:
        tail = prv[0]
        nxt[tail] = b
        prv[b] = tail
        nxt[b] = 0
        prv[0] = b
    txn.free_blocks += 1


def _hit_able(txn: Txn, b: int) -> bool:
    return txn.config.enable_prefix_caching and txn.cache_view().is_cached(b)


def unref_many(txn: Txn, blocks: Sequence[int]) -> None:
    """Drop one reference to each of ``blocks``, in order (the first to be reused first among equals): under
    the ``vllm`` policy the freed ones without a hash go to the head together in this order (vLLM's
    ``prepend_n``), the others to the tail in this order."""
    if txn.config.free_queue != "vllm":
        for b in blocks:
            unref(txn, b)
        return
    head: list[int] = []
    for b in blocks:
        if unref(txn, b, push=False):
            if _hit_able(txn, b):
                push_free(txn, b)
            else:
                head.append(b)
    for b in reversed(head):  # pushed at the head one by one, last first: the first ends up first
        push_free(txn, b)


def take_hit(txn: Txn, b: int) -> None:
    """One more reference to a cached block; out of the free queue if nobody held it."""
    rc = txn.refcount[b]
    if rc == 0:
        unlink_free(txn, b)
    txn.refcount[b] = rc + 1


def unlink_free(txn: Txn, b: int) -> None:
    """Take ``b`` out of the middle of the free queue (a prefix-cache hit)."""
    nxt, prv = txn.nxt, txn.prv
    before, after = prv[b], nxt[b]
    nxt[before] = after
    prv[after] = before
    txn.free_blocks -= 1


def unref(txn: Txn, b: int, *, push: bool = True) -> bool:
    """Drop one reference to ``b``; True when it was the last (the block then joins the free queue, unless
    ``push`` is False and the caller places it)."""
    rc = txn.refcount[b] - 1
    assert rc >= 0, f"block {b} released more often than it was referenced"
    txn.refcount[b] = rc
    if rc == 0 and push:
        push_free(txn, b)
    return rc == 0


def free_tail_first(txn: Txn, req: Request) -> None:
    """Drop one reference to each block, positions descending over all rows and
    groups (rows, then groups, in order within one position); a block whose
    last reference goes joins the tail of the free queue. Under the ``vllm``
    policy group by group as vLLM's coordinator frees (each group's blocks,
    positions descending, one ``unref_many``: its blocks without a hash then go
    to the head, before those of the groups freed earlier)."""
    records = txn.rows
    rows = [records[s].blocks for s in req.slots]
    if txn.config.free_queue == "vllm":  # the blocks without a hash go to the head: the general path
        for g in range(len(rows[0])):
            unref_many(txn, [b for r in rows for b in r[g][::-1] if b])
    else:
        if len(rows) == 1 and len(rows[0]) == 1:
            order: Sequence[int] = rows[0][0][::-1]
        else:
            longest = max(len(g) for r in rows for g in r)
            order = [g[pos] for pos in range(longest - 1, -1, -1) for r in rows for g in r if pos < len(g)]
        _unref_to_tail(txn, order)
    for s in req.slots:
        txn.free_slot(s)


def _unref_to_tail(txn: Txn, order: Sequence[int]) -> None:
    """``free_tail_first``'s fast path: the references dropped leaf by leaf, the freed blocks linked after the
    tail in one pass."""
    refcount, nxt, prv = txn.refcount, txn.nxt, txn.prv
    sh, m = refcount.shift, refcount.mask  # (every per-block vector has the same leaves)
    counts = refcount.own_many({b >> sh for b in order})  # each leaf copied once, then written in place
    freed: list[int] = []
    for b in order:
        if not b:
            continue  # the null block stands for a position a windowed group let go
        leaf = counts[b >> sh]
        rc = leaf[b & m] - 1
        assert rc >= 0, f"block {b} released more often than it was referenced"
        leaf[b & m] = rc
        if not rc:
            freed.append(b)
    if freed:  # the freed blocks, in this order, go after the tail of the free queue
        prev = prv[0]
        ks = {b >> sh for b in freed}
        after = prv.own_many(ks)
        ks.add(prev >> sh)
        before = nxt.own_many(ks)
        for b in freed:
            before[prev >> sh][prev & m] = b
            after[b >> sh][b & m] = prev
            prev = b
        before[prev >> sh][prev & m] = 0
        prv[0] = prev
        txn.free_blocks += len(freed)
