"""Chained block hashes for the prefix cache.

A full block's hash is ``H(parent hash, its token ids, extra keys)``, with a
fixed root per namespace, so a hash names the whole prefix up to and including
its block. BLAKE2b-128 over the parent, the number of ids, the ids as eight
little-endian bytes each (the form the core keeps them in, so hashing a block
costs one digest, not a formatting of its ids) and the extra keys' ``repr``:
stable across processes and machines (never Python's salted ``hash()``), and
injective (fixed-width parts first, the variable one last).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
CacheKey = tuple[int, BlockHash]  # (group index, block hash)


def root_hash(namespace: str) -> BlockHash:
    """The parent of every first block in ``namespace``.

    >>> root_hash("pagedkv").hex()[:8] == root_hash("pagedkv").hex()[:8] != root_hash("other").hex()[:8]
    True
    """
    return hashlib.blake2b(b"pagedkv-root/1/" + namespace.encode(), digest_size=16).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple[str, ...]) -> BlockHash:
    """The hash of one full block given its parent's.

    >>> r = root_hash("pagedkv")
    >>> hash_block(r, [1, 2], ()) == hash_block(r, (1, 2), ()) != hash_block(r, [1, 2], ("lora:7",))
    True
    """
    return hash_packed(parent, array("Q", token_ids).tobytes(), extra_blob(extra_keys))


def extra_blob(extra_keys: tuple[str, ...]) -> bytes:
    """The extra keys as they enter a hash (computed once a request)."""
    return repr(extra_keys).encode()


def hash_packed(parent: BlockHash, packed_ids: bytes, extra: bytes) -> BlockHash:
    """``hash_block`` of ids already packed (eight little-endian bytes each) and keys already
    encoded (``extra_blob``).

    >>> r = root_hash("pagedkv")
    >>> hash_packed(r, (5).to_bytes(8, "little"), extra_blob(())) == hash_block(r, [5], ())
    True
    """
    return hashlib.blake2b(parent + (len(packed_ids) >> 3).to_bytes(4, "little") + packed_ids + extra,
                           digest_size=16).digest()  # fmt: skip

