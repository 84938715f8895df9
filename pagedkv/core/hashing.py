"""Chained block hashes for the prefix cache.

A full block's hash is ``H(parent hash, its token ids, extra keys)``, with a
fixed root per namespace, so a hash names the whole prefix up to and including
its block. BLAKE2b-128 over the parent, the number of ids, the ids as eight
little-endian bytes each (the form the core keeps them in, so hashing a block
costs one digest, not a formatting of its ids) and the extra keys' ``repr``:
stable across processes and machines (never Python's salted ``hash()``), and
injective (fixed-width parts first, the variable one last).

``CacheConfig(block_hash="sha256_cbor")`` hashes as vLLM does with ``--prefix-caching-hash-algo
sha256_cbor``: SHA-256 over the canonical CBOR of ``(parent, token ids, extra keys or None)``, the first
block's parent SHA-256 over the CBOR of the namespace (vLLM's ``NONE_HASH`` seed: ``"vllm-none-hash"``, or
``PYTHONHASHSEED`` where vLLM runs with it set). Those hashes are 32 bytes; a router can index pagedkv's
blocks and vLLM's in one table (for requests without extra keys, which vLLM encodes its own way).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes
CacheKey = tuple[int, BlockHash]  # (group index, block hash)


BLOCK_HASHES = ("blake2b", "sha256_cbor")  # CacheConfig.block_hash
HASH_WIDTH = {"blake2b": 16, "sha256_cbor": 32}  # bytes a hash


def root_hash(namespace: str, kind: str = "blake2b") -> BlockHash:
    """The parent of every first block in ``namespace``.

    >>> root_hash("pagedkv").hex()[:8] == root_hash("pagedkv").hex()[:8] != root_hash("other").hex()[:8]
    True
    >>> root_hash("vllm-none-hash", "sha256_cbor").hex()[:16]  # vLLM's NONE_HASH for sha256_cbor
    '9bd96a485ad84efd'
    """
    if kind == "sha256_cbor":
        return hashlib.sha256(_cbor_text(namespace)).digest()
    return hashlib.blake2b(b"pagedkv-root/1/" + namespace.encode(), digest_size=16).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple[str, ...]) -> BlockHash:
    """The hash of one full block given its parent's.

    >>> r = root_hash("pagedkv")
    >>> hash_block(r, [1, 2], ()) == hash_block(r, (1, 2), ()) != hash_block(r, [1, 2], ("lora:7",))
    True
    """
    return hash_packed(parent, array("Q", token_ids).tobytes(), extra_blob(extra_keys))


def extra_blob(extra_keys: tuple[str, ...], kind: str = "blake2b") -> bytes:
    """The extra keys as they enter a hash (computed once a request): their ``repr``, or for
    ``sha256_cbor`` their CBOR (null when there are none, as vLLM hashes a block without extra keys)."""
    if kind == "sha256_cbor":
        if not extra_keys:
            return b"\xf6"
        return _cbor_head(4, len(extra_keys)) + b"".join(_cbor_text(k) for k in extra_keys)
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


def hash_packed_cbor(parent: BlockHash, packed_ids: bytes, extra: bytes) -> BlockHash:
    """vLLM's ``sha256_cbor`` block hash: SHA-256 of ``cbor2.dumps((parent, tuple(ids), extra_keys),
    canonical=True)``, the ids given packed (eight little-endian bytes each), the keys as ``extra_blob``
    encodes them for ``sha256_cbor``.

    >>> r = root_hash("vllm-none-hash", "sha256_cbor")
    >>> hash_packed_cbor(r, array("Q", [1, 2, 3]).tobytes(), b"\\xf6").hex()[:16]
    'e1af50ac0c00965b'
    """
    ids = array("Q")
    ids.frombytes(packed_ids)
    table = _UINTS or _uints()
    n = len(table)
    body = b"".join([b"\x83", _cbor_head(2, len(parent)), parent, _cbor_head(4, len(ids)),
                     *[table[i] if i < n else _cbor_head(0, i) for i in ids], extra])  # fmt: skip
    return hashlib.sha256(body).digest()


_UINTS: list[bytes] = []  # the CBOR of each integer below 2**17 (token ids), built at the first use


def _uints() -> list[bytes]:
    _UINTS.extend(_cbor_head(0, i) for i in range(1 << 17))
    return _UINTS


def hasher(kind: str) -> Callable[[BlockHash, bytes, bytes], BlockHash]:
    """The function that hashes one block for ``CacheConfig.block_hash`` ``kind``."""
    return hash_packed_cbor if kind == "sha256_cbor" else hash_packed


def _cbor_head(major: int, n: int) -> bytes:
    """A canonical CBOR item head: major type and argument in the fewest bytes."""
    if n < 24:
        return bytes((major << 5 | n,))
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes((major << 5 | extra,)) + n.to_bytes(width, "big")
    raise ValueError(f"{n} does not fit a CBOR head")


def _cbor_text(text: str) -> bytes:
    data = text.encode()
    return _cbor_head(3, len(data)) + data
