"""What an engine asks the core for: a request of one or more rows.

A row is one sequence of KV positions. CFG branches of a diffusion request are
rows of one request, admitted together. A row may carry its token ids (needed
for prefix caching) or only a count.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.core.errors import (
    are_packed_ids,
    INT_ID_LIMIT,
    KVError,
    RequestId,
    are_token_ids,
    invalid,
    is_int,
    is_request_id,
    is_token_id,
    shown,
)
from pagedkv.core.rules.hashing import Content, Key

Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class RowSpec:
    """One row: ``num_tokens`` positions, optionally their token ids.

    ``prefix_len``/``target_len`` (given together) make it a diffusion row: a
    stable prefix kept across denoising steps and a target span rewritten at
    each. ``spans`` are sorted, non-overlapping ``[start, end)`` full-attention
    spans; the rest of the row is causal. ``tokens``: a tuple of ids, or an
    ``array("Q")`` (ids by construction: taken with no per-id check, and packed
    at C speed: what a caller that keeps a long prompt's ids so hands over).

    >>> RowSpec.of_tokens([5, 6, 7]).num_tokens
    3
    """

    num_tokens: int
    tokens: tuple[int, ...] | array[int] | None = None
    prefix_len: int | None = None
    target_len: int | None = None
    spans: tuple[Span, ...] = ()
    pending_tokens: int = 0  # KV of tokens [0, n) arrives from elsewhere (an AR stage): destination blocks
    placeholders: int = 0  # the last positions' ids are not known yet (``tokens`` are the ones before them)
    # the chain hashes of the row's leading full blocks as its caller computed them, where its identity is more than
    # its ids (vLLM-Omni's DiffusionKVRequest.block_hashes: multimodal features, a namespace): its hit is looked up,
    # and those blocks are cached, under them (never checked against the core's own: they are another scheme); a
    # row of a count (no ids: an embedding's prefix) is keyed by them as far as they reach, and no further
    block_hashes: tuple[bytes, ...] = ()

    @staticmethod
    def of_tokens(
        tokens: Sequence[int],
        *,
        prefix_len: int | None = None,
        target_len: int | None = None,
        spans: Sequence[Span] = (),
        pending_tokens: int = 0,
        placeholders: int = 0,
        block_hashes: Sequence[bytes] = (),
    ) -> RowSpec:
        """A row of ``tokens``, then ``placeholders`` positions whose ids arrive later (``placeholders.fill``: a step
        planned before the last one's tokens are back, draft and lookahead slots)."""
        return RowSpec(
            len(tokens) + placeholders,
            tokens if are_packed_ids(tokens) else tuple(tokens),  # type: ignore[arg-type]
            prefix_len,
            target_len,
            tuple((start, end) for start, end in spans),
            pending_tokens,
            placeholders,
            tuple(block_hashes),
        )

    @property
    def known(self) -> int:
        """How many leading positions have known ids (0 for a row of a count)."""
        return self.num_tokens - self.placeholders if self.tokens is not None else 0

    @property
    def is_diffusion(self) -> bool:
        return self.target_len is not None


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request to admit: all of its rows get their blocks, or none do.

    ``extra_keys`` carry what else decides the KV content of every block (an
    adapter); ``content`` the non-text inputs as ``(identifier, offset, length)``
    spans, keyed into the blocks they touch; ``first_block_keys`` what keys the
    first block alone (a cache salt: the chain carries it on). Prefix-cache hashes
    include them, as vLLM's do (``hashing.BlockKeys``). A key is a string, or a
    tuple of strings, integers, None and such tuples.
    """

    request_id: RequestId
    rows: tuple[RowSpec, ...]
    extra_keys: tuple[Key, ...] = ()
    max_hit: int | None = None  # the prefix-cache hit is at most this many tokens (0: the cache is not read)
    first_block_keys: tuple[Key, ...] = ()
    content: tuple[Content, ...] = ()
    # the chain hashes of the row's leading full blocks as the caller computed them (vLLM's
    # ``request.block_hashes``): the core takes them instead of hashing those blocks again (one row only;
    # ``CacheConfig(check_given_hashes=True)`` checks each against the core's own)
    block_hashes: tuple[bytes, ...] = ()


def check_request_spec(spec: object) -> KVError | None:
    """``None`` when ``spec`` is well formed, else the ``INVALID`` error saying why.

    Only the shape of the spec is judged here; limits and capacity are the
    admission's business.

    >>> check_request_spec(RequestSpec("a", (RowSpec(0),))).message
    "request 'a' row 0: num_tokens must be a positive integer below 2**63, got 0"
    """
    if not isinstance(spec, RequestSpec):
        return invalid(f"admit needs a RequestSpec, got {type(spec).__name__}")
    rid = spec.request_id
    if not is_request_id(rid):
        return invalid(f"request id must be a string or a 64-bit integer, got {shown(rid)}", field="request")
    if not isinstance(spec.rows, tuple) or not spec.rows:
        return invalid(f"request {shown(rid)} must have at least one row", request=rid, field="rows")
    for name in ("extra_keys", "first_block_keys"):
        keys = getattr(spec, name)
        if not isinstance(keys, tuple) or not all(type(k) is str or (type(k) is tuple and is_key(k)) for k in keys):
            return invalid(
                f"request {shown(rid)}: {name} must be strings or tuples of strings, integers and None",
                request=rid,
                field=name,
            )
    if not isinstance(spec.content, tuple) or not all(
        type(c) is tuple
        and len(c) == 3
        and type(c[0]) is str
        and is_int(c[1])
        and is_int(c[2])
        and c[1] >= 0
        and c[2] > 0
        for c in spec.content
    ):
        return invalid(
            f"request {shown(rid)}: content must be (identifier, offset >= 0, length > 0) spans",
            request=rid,
            field="content",
        )
    given = spec.block_hashes
    if not isinstance(given, tuple) or not set(map(type, given)) <= {bytes}:
        return invalid(
            f"request {shown(rid)}: block_hashes must be a tuple of bytes", request=rid, field="block_hashes"
        )
    if given and len(spec.rows) != 1:
        return invalid(
            f"request {shown(rid)}: block_hashes are a single row's; this request has {len(spec.rows)} rows",
            request=rid,
            field="block_hashes",
        )
    if spec.max_hit is not None and (not is_int(spec.max_hit) or spec.max_hit < 0):
        return invalid(
            f"request {shown(rid)}: max_hit must be a non-negative integer or None, got {shown(spec.max_hit)}",
            request=rid,
            field="max_hit",
        )
    for i, row in enumerate(spec.rows):
        err = _check_row(row, f"request {shown(rid)} row {i}")
        if err is not None:
            return KVError(err.code, err.message, request=rid, field=err.field)
    return None


def is_key(key: object, depth: int = 0) -> bool:
    """A string, an integer below 2**64 in size, None, or a tuple of keys (a few levels deep)."""
    if key is None or type(key) is str:
        return True
    if is_int(key):
        return -(1 << 64) < key < 1 << 64  # type: ignore[operator]
    return type(key) is tuple and depth < 4 and all(is_key(k, depth + 1) for k in key)


def _check_row(row: object, where: str) -> KVError | None:
    if not isinstance(row, RowSpec):
        return invalid(f"{where}: rows must be RowSpec values, got {type(row).__name__}", field="rows")
    n = row.num_tokens
    if not is_int(n) or not 1 <= n < INT_ID_LIMIT:  # (a count past 2**63 fits no pool, nor a message)
        return invalid(
            f"{where}: num_tokens must be a positive integer below 2**63, got {shown(n)}", field="num_tokens"
        )
    w = row.placeholders
    if not is_int(w) or not 0 <= w <= n or (w and (row.tokens is None or row.target_len is not None)):
        return invalid(
            f"{where}: placeholders must be an integer in [0, num_tokens], and only in a row of token "
            f"ids that is not a diffusion row, got {shown(w)}",
            field="placeholders",
        )
    if row.tokens is not None:
        packed = are_packed_ids(row.tokens)  # (an array("Q") holds token ids by construction)
        if not (packed or isinstance(row.tokens, tuple)) or len(row.tokens) != n - w:
            return invalid(
                f"{where}: tokens must be a tuple (or an array('Q')) of num_tokens - placeholders ({shown(n - w)}) ids",
                field="tokens",
            )
        toks = row.tokens  # judged at C speed (the types, then the range as unsigned 64-bit); the loop names a bad id
        if not packed and not are_token_ids(toks):
            bad = next(t for t in toks if not is_token_id(t))
            return invalid(
                f"{where}: token ids must be non-negative integers below 2**64, got {shown(bad)}", field="tokens"
            )
    p, t = row.prefix_len, row.target_len
    if (p is None) != (t is None):
        return invalid(f"{where}: prefix_len and target_len come together", field="prefix_len")
    if p is not None and t is not None:
        if not is_int(p) or p < 0:
            return invalid(f"{where}: prefix_len must be a non-negative integer, got {shown(p)}", field="prefix_len")
        if not is_int(t) or t < 1:
            return invalid(f"{where}: target_len must be a positive integer, got {shown(t)}", field="target_len")
        if p + t > n:
            return invalid(f"{where}: prefix_len + target_len = {shown(p + t)} exceeds seq_len {n}", field="target_len")
    if not is_int(row.pending_tokens) or not 0 <= row.pending_tokens <= n:
        return invalid(
            f"{where}: pending_tokens must be an integer in [0, {n}], got {shown(row.pending_tokens)}",
            field="pending_tokens",
        )
    if not isinstance(row.spans, tuple):
        return invalid(f"{where}: spans must be a tuple of [start, end) pairs", field="spans")
    end_prev = 0
    for s in row.spans:
        if not (isinstance(s, tuple) and len(s) == 2 and is_int(s[0]) and is_int(s[1])):
            return invalid(f"{where}: a span must be a [start, end) pair of integers, got {shown(s)}", field="spans")
        a, b = s
        if not 0 <= a < b <= n:
            return invalid(
                f"{where}: span [{shown(a)}, {shown(b)}) is empty or outside the row [0, {n})", field="spans"
            )
        if a < end_prev:
            return invalid(f"{where}: span [{a}, {b}) is unsorted or overlaps the span before it", field="spans")
        end_prev = b
    given = row.block_hashes
    if not isinstance(given, tuple) or any(type(h) is not bytes for h in given):
        return invalid(f"{where}: block_hashes must be a tuple of bytes", field="block_hashes")
    return None
