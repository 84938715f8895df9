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

from collections import ChainMap
from collections.abc import Sequence

from pagedkv.core.errors import InvariantError
from pagedkv.core.outputs.events import BlockOffloaded, BlockOnloaded, BlockRemoved, HostBlockRemoved, KVEvent
from pagedkv.core.rules.hashing import BlockHash
from pagedkv.core.store.state import Request
from pagedkv.core.store.txn import Txn


def pop_blocks(txn: Txn, k: int) -> tuple[int, ...]:
    """Take ``k`` blocks from the head of the free queue (least recently freed), one reference
    each; a cached one leaves the index (its content is about to be overwritten)."""
    if not k:
        return ()
    nxt = txn.nxt
    after = nxt.values()
    out = []
    b = after[0]
    for _ in range(k):  # (past the tail, the walk reaches the sentinel 0 and goes round: refused below)
        out.append(b)
        b = after[b]
    if 0 in out:
        raise InvariantError("a pop on an empty free queue: capacity was not checked")
    nxt[0] = b
    txn.prv[b] = 0
    txn.free_blocks -= k
    counts = txn.refcount.writable(out)
    for x in out:
        counts[x] = 1
    events = txn.events if txn.config.kv_events else None
    host = txn.config.host_blocks
    evicted = txn.index.evict_many(out, report=events is not None or bool(host))  # (the cached ones, in order)
    if not evicted:
        return tuple(out)
    if host:  # (a cached block's bytes kept in the host tier before anything overwrites them: core/store/host.py)
        offload_many(txn, evicted, events)
    elif events is not None:
        events.extend(BlockRemoved(h, g, x) for x, g, h in evicted)
    return tuple(out)


def evict(txn: Txn, b: int) -> None:
    """``b``'s cache entry goes (its content is about to be overwritten, or may never have been written), with
    a ``BlockRemoved`` where the pool reports events; nothing for a block not cached."""
    gone = txn.index.evict(b)
    if gone is not None and txn.config.kv_events:
        txn.events.append(BlockRemoved(gone[1], gone[0], b))


def unref_many(txn: Txn, blocks: Sequence[int]) -> None:
    """Drop one reference to each of ``blocks``, in order (the null block, a position a window let go, is
    skipped); the blocks whose last reference goes join the free queue in this order: at the tail (most
    recently freed, reused last), or under the ``vllm`` policy those without a hash at the head together
    (vLLM's ``prepend_n``: they can never be hit, so they are reused first). The refcounts and links are
    written in place, their old values logged first (core/store/rerooted.py)."""
    if 0 in blocks:
        blocks = [b for b in blocks if b]
    counts = txn.refcount.writable(blocks)
    cfg = txn.config
    # under the vllm policy with prefix caching, the blocks cached in any group go to the tail, the rest to the head
    sides = cfg.free_queue != "tail" and cfg.enable_prefix_caching
    revs = txn.index.reverse_maps() if sides else []
    cached = revs[0] if len(revs) == 1 else ChainMap(*revs) if revs else None
    freed: list[int] = []  # the blocks whose last reference went (``cached``: the cached ones; the rest in head)
    head: list[int] = []
    for b in blocks:
        rc = counts[b]
        if rc == 1:
            counts[b] = 0
            if cached is None or b in cached:
                freed.append(b)
            else:
                head.append(b)
        elif rc > 1:
            counts[b] = rc - 1
        else:
            raise InvariantError(f"block {b} released more often than it was referenced")
    if sides or cfg.free_queue == "tail":
        link_free(txn, freed, head)
    else:  # ("vllm", "vllm-omni" without prefix caching: vLLM's block pool either way)
        link_free(txn, (), freed)


def link_free(txn: Txn, tail: Sequence[int], head: Sequence[int]) -> None:
    """Put blocks no one holds in the free queue: ``tail`` after its tail, in order; then ``head`` before
    its head, in order (``head[0]`` first)."""
    if not tail and not head:
        return
    nxt, prv = txn.nxt, txn.prv
    first, last = nxt[0], prv[0]  # (0 for an empty queue: the null block is the list's sentinel)
    touched = (0, first, last, *tail, *head)  # (every link written below)
    after, before = nxt.writable(touched), prv.writable(touched)
    if tail:
        prev = last
        for b in tail:
            after[prev] = b
            before[b] = prev
            prev = b
        after[prev] = 0
        before[0] = prev
        first = after[0]
    if head:
        nxt_b = first
        for b in reversed(head):
            after[b] = nxt_b
            before[nxt_b] = b
            nxt_b = b
        after[0] = nxt_b
        before[nxt_b] = 0
    txn.free_blocks += len(tail) + len(head)


def take_hits(txn: Txn, blocks: Sequence[int]) -> None:
    """One more reference to each of ``blocks`` (cached ones), in order; those nobody held leave the
    free queue from where they stand (a prefix-cache hit). The refcounts and links are written in place, their old
    values logged first: a run of neighbours leaving together writes only links of its own blocks and of the
    blocks just outside it, so the blocks and their neighbours now are every entry written."""
    if not blocks:
        return
    counts = txn.refcount.writable(blocks)
    idle = [b for b in dict.fromkeys(blocks) if counts[b] == 0]  # (a block listed twice leaves the queue once)
    for b in blocks:
        counts[b] += 1
    if not idle:
        return
    after, before = txn.nxt.values(), txn.prv.values()
    touched = (*idle, *map(before.__getitem__, idle), *map(after.__getitem__, idle))
    after, before = txn.nxt.writable(touched), txn.prv.writable(touched)
    for b in idle:
        p, n = before[b], after[b]
        after[p] = n
        before[n] = p
    txn.free_blocks -= len(idle)


def free_tail_first(txn: Txn, req: Request) -> None:
    """Drop one reference to each block, positions descending over all rows and
    groups (rows, then groups, in order within one position); a block whose
    last reference goes joins the tail of the free queue. Under the ``vllm``
    policy group by group as vLLM's coordinator frees (each group's blocks,
    positions descending, one ``unref_many``: its blocks without a hash then go
    to the head, before those of the groups freed earlier). Under ``vllm-omni``
    row by row, the last row first, as vLLM-Omni's diffusion KV manager frees a
    CFG request's rows (docs/vllm-omni.md)."""
    records = txn.rows
    rows = [records[s].blocks for s in req.slots]
    policy = txn.config.free_queue
    if policy == "vllm-omni":
        free_rows_as_vllm_omni(txn, rows)
    elif policy == "vllm":  # group by group: each group's blocks without a hash to the head
        for g in range(len(rows[0])):
            unref_many(txn, [b for r in rows for b in r[g][::-1]])
    else:
        if len(rows) == 1 and len(rows[0]) == 1:
            order: Sequence[int] = rows[0][0][::-1]
        else:
            longest = max(len(g) for r in rows for g in r)
            order = [g[pos] for pos in range(longest - 1, -1, -1) for r in rows for g in r if pos < len(g)]
        unref_many(txn, order)
    for s in req.slots:
        txn.free_slot(s)


def free_rows_as_vllm_omni(txn: Txn, rows: Sequence[Sequence[Sequence[int]]]) -> None:
    """Drop one reference to each block of ``rows`` (per row, per group) as vLLM-Omni's diffusion KV manager lets a
    request's rows go: the last row first; each, with prefix caching on, as vLLM frees a request (group by group,
    positions descending), else all of its blocks in ascending ids to the head (its
    ``free_kv_blocks_in_physical_order``)."""
    for r in reversed(rows):
        if txn.config.enable_prefix_caching:
            for blocks in r:
                unref_many(txn, blocks[::-1])
        else:
            unref_many(txn, sorted(b for blocks in r for b in blocks))


def offload_many(txn: Txn, evicted: list[tuple[int, int, BlockHash]], events: list[KVEvent] | None) -> None:
    """Cached blocks the pool evicts, (block, group, hash) each in order, kept in the tier (those not there
    already; under ``host_store_threshold`` those whose content was seen in that many uses): per block
    ``HostBlockRemoved`` for an entry it drops, ``BlockOffloaded``, then (``events``: the pool reports them) the
    eviction's ``BlockRemoved``."""
    cfg = txn.config
    kept = txn.host.put_many([(g, h) for _, g, h in evicted], cfg.host_blocks, cfg.host_store_threshold)
    out = txn.events
    for (block, g, h), got in zip(evicted, kept):
        if got is not None:
            slot, dropped = got
            if dropped is not None:
                out.append(HostBlockRemoved(dropped[1], dropped[0], slot))
            out.append(BlockOffloaded(h, g, block, slot))
        if events is not None:
            events.append(BlockRemoved(h, g, block))


def onload(txn: Txn, g: int, h: BlockHash, slot: int, block: int) -> None:
    """A hit on the tier: the bytes of its entry's ``slot`` (pinned when the hit was taken) into the fresh device
    ``block`` (``BlockOnloaded``)."""
    txn.events.append(BlockOnloaded(h, g, slot, block))
