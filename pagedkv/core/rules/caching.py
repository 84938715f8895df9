"""A row's full blocks entering the prefix cache: each hashed (chained, with the request's keys) once its
ids are known, cached once per content (or every block, ``cache_duplicates``), a ``BlockStored`` for each;
and a state (Mamba) group's block saved where a row ends on a boundary. ``commit``, ``cache_ahead`` and
``fill`` decide when; this module, how.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core.config import CacheConfig
from pagedkv.core.errors import GivenHashError, InvariantError, KVError
from pagedkv.core.outputs.events import BlockStored, KVEvent
from pagedkv.core.rules.hashing import BlockKeys
from pagedkv.core.store.state import Request, Row
from pagedkv.core.store.tails import ids_count, ids_span, known_ids, pack_ids, unpack_ids
from pagedkv.core.store.txn import Txn


def chain_of(config: CacheConfig, root: bytes, tokens: Sequence[int], keys: BlockKeys) -> tuple[bytes, ...]:
    """The chain hashes of the full blocks of ``tokens`` (with ``keys``, from ``root``), as admission and the
    caching rule would hash them: what a scheduler computes once when a request arrives and hands the core with
    each admission and commit (``RequestSpec.block_hashes``), so that a prompt that waits or is long is hashed
    once, never at each try. Empty under ``hash_lookahead`` (a block's hash waits for the ids after it).

    >>> from pagedkv.core import CacheConfig
    >>> from pagedkv.core.rules.hashing import NO_KEYS, hash_block, root_hash
    >>> r = root_hash("pagedkv")
    >>> chain_of(CacheConfig(block_size=2, num_blocks=9), r, [5, 6, 7], NO_KEYS) == (hash_block(r, [5, 6], ()),)
    True
    """
    bs = config.block_size
    n = len(tokens) // bs
    if not n or config.hash_lookahead:
        return ()
    packed, width = pack_ids(tokens[: n * bs]), bs << 3
    hash_packed, plain = config.hash_fn, None if keys.varies else keys.plain
    out, parent = [], root
    for j in range(n):
        parent = hash_packed(parent, packed[j * width : (j + 1) * width], keys.at(j, bs) if plain is None else plain)
        out.append(parent)
    return tuple(out)


def token_span(record: Row, tail: bytes | None, start: int, end: int, chunked: int | None = None) -> bytes:
    """The packed token ids of positions ``[start, end)`` of a row, from its ids and its tail (``chunked``: the
    record's count of ids, where the caller has it)."""
    if record.ids is None:
        raise InvariantError("a row that is hashed holds its ids")
    c = record.chunked if chunked is None else chunked
    if end <= c:
        blob = ids_span(record.ids, start, end)
    elif start >= c:
        blob = (tail or b"")[(start - c) << 3 : (end - c) << 3]
    else:
        blob = ids_span(record.ids, start, c) + (tail or b"")[: (end - c) << 3]
    return blob


def caches(txn: Txn, req: Request) -> bool:
    """Does ``req`` put blocks in the prefix cache? With prefix caching on, in the cache's epoch it was
    admitted in (a reset of the prefix cache ends that for the requests running through it)."""
    return txn.config.enable_prefix_caching and req.cache_epoch == txn.base.cache_epoch


def cache_full_blocks(
    txn: Txn,
    req: Request,
    i: int,
    slot: int,
    computed: int,
    given: Sequence[bytes] | None = None,
    adds: list[tuple[list[bytes], list[int]]] | None = None,
) -> None:
    """Put row i's newly full computed blocks into the cache index (once per content), where ``req`` caches;
    ``given``: the row's chain hashes as the caller computed them; ``adds``: where the index writes gather
    (``hash_full_blocks``)."""
    if not caches(txn, req):
        return
    record = txn.rows[slot]
    new = hash_full_blocks(txn, req, i, slot, computed, record, txn.row_tail[slot], given, adds)
    if new is not record:
        txn.rows[slot] = new


def cache_rows(txn: Txn, rows: Sequence[tuple[Request, int, int, int, Sequence[bytes] | None]]) -> KVError | None:
    """``cache_full_blocks`` of each (request, row, slot, computed, given) in order, for a loop of many rows (a
    decode step's rows that fill a block): where the pool reports no events, the index writes of all of them in
    one pass a group, in the order row by row gives. A caller's hash the core's own differs from refuses (the
    transition is dropped: nothing of it stands)."""
    if not txn.config.enable_prefix_caching:
        return None
    adds: list[tuple[list[bytes], list[int]]] | None = (
        None if txn.config.kv_events else [([], []) for _ in txn.config.rules]
    )
    for req, i, slot, computed, given in rows:
        try:
            cache_full_blocks(txn, req, i, slot, computed, given, adds)
        except GivenHashError as e:
            return e.refusal(req.request_id)
    for g, (hashes, blocks) in enumerate(adds or ()):
        if hashes:
            txn.index.add_many(g, hashes, blocks)
    return None


def hash_full_blocks(
    txn: Txn,
    req: Request,
    i: int,
    slot: int,
    computed: int,
    record: Row,
    tail: bytes | None,
    given: Sequence[bytes] | None = None,
    adds: list[tuple[list[bytes], list[int]]] | None = None,
) -> Row:
    """Hash row i's full computed blocks not hashed yet, cache each content once; the new record. ``adds``:
    where the index writes of a pool without events gather (``cache_rows``: each group's hashes and blocks, in
    order), instead of being made here. Under
    ``hash_lookahead`` each hash also covers the ids after its block (vLLM's EAGLE lookahead hashes: a
    drafter's KV at a block's last position depends on them), and a block waits for them. ``given[j]`` is
    block j's chain hash as the caller computed it (vLLM's ``request.block_hashes``): taken as it is, or
    checked against the core's (``check_given_hashes``: ``GivenHashError``); by default the row's own, given at its
    admission (``RowSpec.block_hashes``). A row of a count is cached only where those reach."""
    if given is None and req.given:
        given = req.given[i] or None
    cfg = txn.config
    bs = cfg.block_size
    ids = record.ids
    if ids is not None:  # a block is hashed only over known ids (placeholders await theirs): the record's, the tail's
        chunked = ids_count(ids)  # (counted once, for both)
        known = known_ids(record, tail, chunked)
    elif given and req.given and req.given[i]:
        chunked = known = len(given) * bs
    else:
        return record
    ahead = cfg.hash_lookahead
    cacheable = req.layouts[i].prefix_len
    full = min(computed, txn.row_len[slot] if cacheable is None else cacheable, known - ahead) // bs
    hw = record.hw
    done = len(record.hashes) // hw
    if full <= done:
        return record
    events = txn.events if cfg.kv_events else None
    keys = req.keys
    plain = None if keys.varies or ahead else keys.plain  # (most requests: every block hashes the same keys)
    # blocks whose hash is the caller's (a row's own given at admission: another scheme, never checked)
    taken = 0 if given is None or (cfg.check_given_hashes and not req.given) else len(given)
    # the packed ids of every block to hash, from ``lo`` (a row of a count hashes none: its caller's hashes are
    # taken; those the caller hashed need no ids, unless the events carry them or a lookahead reads them)
    lo = done if events is not None or ahead else min(max(taken, done), full)
    span = token_span(record, tail, lo * bs, full * bs + ahead, chunked) if ids is not None and lo < full else b""
    parent = record.hashes[-hw:] if done else txn.base.cache.root
    first = parent
    new = [record.hashes]
    upto = min(full, max(taken, done))  # blocks done..upto take the caller's hashes, checked at C speed
    if upto > done:
        theirs = given[done:upto]  # type: ignore[index]
        if set(map(type, theirs)) != {bytes} or set(map(len, theirs)) != {hw}:  # (a hash the record cannot hold)
            raise GivenHashError(
                next(j for j, h in enumerate(theirs, done) if type(h) is not bytes or len(h) != hw), None, hw
            )
        new.extend(theirs)
        parent = theirs[-1]
    if upto < full:
        hash_packed, width = cfg.hash_fn, bs << 3
        unpacked = unpack_ids(span) if ahead else ()
        for j in range(upto, full):
            k = j - lo  # (block j's place in the span)
            if plain is not None:
                extra = plain
            elif ahead:
                extra = keys.ahead(j, bs, unpacked[(k + 1) * bs : (k + 1) * bs + ahead])
            else:
                extra = keys.at(j, bs)
            h = hash_packed(parent, span[k * width : (k + 1) * width], extra)
            if given is not None and j < len(given) and given[j] != h:
                raise GivenHashError(j, h)
            new.append(h)
            parent = h
    hashes = new[1:]
    if cfg.host_store_threshold > 1:  # (a use of each content the row computed: what the tier keeps, host.py)
        txn.host.use(hashes, cfg.host_store_threshold, cfg.host_tracker_size)
    states = cfg.state_group_set
    if events is None:  # (each group's blocks in one pass: not let go already, not cached already, and no other
        # block holding the same content; a state group's block is the row's live state, cached only when the row
        # ends on this boundary)
        for g, group_blocks in enumerate(record.blocks):
            if not states or g not in states:
                if adds is None:
                    txn.index.add_many(g, hashes, group_blocks[done:full])
                else:
                    adds[g][0].extend(hashes)
                    adds[g][1].extend(group_blocks[done:full])
        return record.with_hashes(b"".join(new))
    _store_events(txn, req, record, events, span, lo, done, full, hashes, first)
    return record.with_hashes(b"".join(new))


def _store_events(
    txn: Txn,
    req: Request,
    record: Row,
    events: list[KVEvent],
    span: bytes,
    lo: int,
    done: int,
    full: int,
    hashes: list[bytes],
    parent: bytes,
) -> None:
    """Blocks ``done..full`` of a row (their ``hashes``, chained from ``parent``; their ids ``span`` from block
    ``lo``) cached block by block, each store's ``BlockStored`` in order: the pool reports events."""
    cfg = txn.config
    bs, ahead, states, keys, add = cfg.block_size, cfg.hash_lookahead, cfg.state_group_set, req.keys, txn.index.add
    plain = None if keys.varies or ahead else keys.plain
    unpacked = unpack_ids(span)  # (the events carry them as ints)
    following = None
    # an align-mode state group's store carries the ids since its last store in this call (vLLM's event: the
    # call's range, its null positions' ids too)
    runs = (
        {g: (0, parent if done else None) for g, rules in enumerate(cfg.rules) if rules.event_covers_run}
        if len(cfg.rules) > 1
        else {}
    )
    for j in range(done, full):
        k = j - lo
        h = hashes[j - done]
        if ahead:
            following = unpacked[(k + 1) * bs : (k + 1) * bs + ahead]
        for g, group_blocks in enumerate(record.blocks):
            b = group_blocks[j]
            if b and (not states or g not in states) and add(g, h, b):
                start, up = runs.get(g, (k, parent if j else None))
                events.append(
                    BlockStored(
                        h,
                        up,
                        unpacked[start * bs : (k + 1) * bs],
                        g,
                        b,
                        keys.every if plain is not None else keys.raw(j, bs, ahead),
                        following,
                    )
                )
                if g in runs:
                    runs[g] = (k + 1, h)
        parent = h


def save_states(txn: Txn, req: Request) -> None:
    """A request that ends (not by error) leaves each row's state cached where it stands, when its computed
    tokens end on a block boundary whose hash the row knows: under that block's chain hash, for a later
    request with the same leading tokens to take over (``prefix.find_hit``). Call before its blocks go."""
    cfg = txn.config
    states = cfg.state_group_set
    if not states or not caches(txn, req):
        return
    bs = cfg.block_size
    for slot in req.slots:
        computed, record = txn.row_computed[slot], txn.rows[slot]
        j = computed // bs - 1
        if computed % bs or j < 0 or record.num_hashed <= j:
            continue
        h = record.hash_at(j)
        parent = record.hash_at(j - 1) if j else None
        ids = unpack_ids(token_span(record, txn.row_tail[slot], j * bs, (j + 1) * bs))
        for g in sorted(states):
            b = record.blocks[g][-1]
            if b and txn.index.add(g, h, b) and cfg.kv_events:
                txn.events.append(BlockStored(h, parent, ids, g, b, req.keys.raw(j, bs)))
