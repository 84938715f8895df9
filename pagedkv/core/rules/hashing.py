"""Chained block hashes for the prefix cache.

A full block's hash is ``H(parent hash, its token ids, its extra keys)``, with a fixed root per
namespace, so a hash names the whole prefix up to and including its block. The default,
``"blake2b"``, is BLAKE2b-128 over the parent, the number of ids, the ids as eight little-endian
bytes each (the form the core keeps them in, so hashing a block costs one digest, not a formatting
of its ids) and the extra keys' ``repr``: stable across processes and machines (never Python's
salted ``hash()``), and injective (fixed-width parts first, the variable one last).

The other kinds are vLLM's ``--prefix-caching-hash-algo`` values, byte for byte: ``"sha256"`` (its
default: SHA-256 over ``pickle.dumps((parent, token ids, extra keys or None), protocol=5)``),
``"sha256_cbor"`` (SHA-256 over the canonical CBOR of the same triple), ``"xxhash"`` and
``"xxhash_cbor"`` (XXH3-128 over the pickle or the CBOR; they need ``pip install xxhash``). The first
block's parent is vLLM's ``NONE_HASH``: the kind's hash of the namespace string (vLLM's seed:
``"vllm-none-hash"``, or ``PYTHONHASHSEED`` where vLLM runs with it set).

Extra keys (``BlockKeys``) are what else decides a block's KV, as vLLM keys them: keys on every
block (an adapter: ``("lora", name, path)``), keys on the blocks a content span touches (a
multimodal input: ``("mm", identifier, its offset from the block's start)``) and keys on the first
block alone (a cache salt: ``("cache_salt", salt)``; the chain carries it on), in that order.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

BlockHash = bytes
CacheKey = tuple[int, BlockHash]  # (group index, block hash)
Key = Any  # an extra key: a string, or a tuple of strings, integers, None and such tuples (JSON-able)
Content = tuple[str, int, int]  # a content span: (identifier, offset, length) in token positions

BLOCK_HASHES = ("blake2b", "sha256_cbor", "sha256", "xxhash", "xxhash_cbor")  # CacheConfig.block_hash
HASH_WIDTH = {"blake2b": 16, "sha256_cbor": 32, "sha256": 32, "xxhash": 16, "xxhash_cbor": 16}  # bytes a hash
_PICKLED = ("sha256", "xxhash")  # kinds that hash Python's pickle of the triple (extra keys as objects)


def root_hash(namespace: str, kind: str = "blake2b") -> BlockHash:
    """The parent of every first block in ``namespace``.

    >>> root_hash("pagedkv").hex()[:8] == root_hash("pagedkv").hex()[:8] != root_hash("other").hex()[:8]
    True
    >>> root_hash("vllm-none-hash", "sha256_cbor").hex()[:16]  # vLLM's NONE_HASH for sha256_cbor
    '9bd96a485ad84efd'
    """
    if kind == "blake2b":
        return hashlib.blake2b(b"pagedkv-root/1/" + namespace.encode(), digest_size=16).digest()
    data = pickle.dumps(namespace, protocol=5) if kind in _PICKLED else cbor(namespace)
    return _digest(kind)(data)


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple[Key, ...], kind: str = "blake2b"
) -> BlockHash:
    """The hash of one full block given its parent's.

    >>> r = root_hash("pagedkv")
    >>> hash_block(r, [1, 2], ()) == hash_block(r, (1, 2), ()) != hash_block(r, [1, 2], ("lora:7",))
    True
    """
    return hasher(kind)(parent, array("Q", token_ids).tobytes(), encode_keys(extra_keys, kind))


def encode_keys(keys: tuple[Key, ...], kind: str = "blake2b") -> Any:
    """One block's extra keys as they enter its hash: their ``repr``; for the CBOR kinds their CBOR (null
    when there are none, as vLLM hashes a block without extra keys); for the pickle kinds the tuple itself
    (or None), pickled inside the block's triple."""
    if kind == "blake2b":
        return repr(keys).encode()
    if kind in _PICKLED:
        return keys or None
    return cbor(keys) if keys else b"\xf6"


def hash_packed(parent: BlockHash, packed_ids: bytes, extra: bytes) -> BlockHash:
    """``hash_block`` of ids already packed (eight little-endian bytes each) and keys already
    encoded (``encode_keys``).

    >>> r = root_hash("pagedkv")
    >>> hash_packed(r, (5).to_bytes(8, "little"), encode_keys(())) == hash_block(r, [5], ())
    True
    """
    return hashlib.blake2b(
        parent + (len(packed_ids) >> 3).to_bytes(4, "little") + packed_ids + extra, digest_size=16
    ).digest()


def _cbor_triple(parent: BlockHash, packed_ids: bytes, extra: bytes) -> bytes:
    """The canonical CBOR of ``(parent, tuple(ids), extra keys)``, the keys given encoded."""
    ids = array("Q")
    ids.frombytes(packed_ids)
    table = _UINTS or _uints()
    if ids and max(ids) < len(table):  # (token ids: every head from the table, in C)
        body = b"".join(map(table.__getitem__, ids))
    else:
        body = b"".join([_cbor_head(0, i) for i in ids])
    heads = _HEADS.get((len(parent), len(ids)))
    if heads is None:
        heads = _HEADS[(len(parent), len(ids))] = (b"\x83" + _cbor_head(2, len(parent)), _cbor_head(4, len(ids)))
    return b"".join((heads[0], parent, heads[1], body, extra))


def hash_packed_cbor(parent: BlockHash, packed_ids: bytes, extra: bytes) -> BlockHash:
    """vLLM's ``sha256_cbor`` block hash: SHA-256 of ``cbor2.dumps((parent, tuple(ids), extra_keys),
    canonical=True)``.

    >>> r = root_hash("vllm-none-hash", "sha256_cbor")
    >>> hash_packed_cbor(r, array("Q", [1, 2, 3]).tobytes(), b"\\xf6").hex()[:16]
    'e1af50ac0c00965b'
    """
    return hashlib.sha256(_cbor_triple(parent, packed_ids, extra)).digest()


def _pickled(parent: BlockHash, packed_ids: bytes, extra: Any) -> bytes:
    """``pickle.dumps((parent, tuple(ids), extra), protocol=5)``: what vLLM's ``sha256`` and ``xxhash`` hash."""
    ids = array("Q")
    ids.frombytes(packed_ids)
    return pickle.dumps((parent, tuple(ids), extra), protocol=5)


def hasher(kind: str) -> Callable[[BlockHash, bytes, Any], BlockHash]:
    """The function that hashes one block for ``CacheConfig.block_hash`` ``kind``: (parent, packed ids,
    encoded extra keys) -> hash."""
    if kind == "blake2b":
        return hash_packed
    if kind == "sha256_cbor":
        return hash_packed_cbor
    digest = _digest(kind)
    if kind in _PICKLED:
        return lambda parent, packed, extra: digest(_pickled(parent, packed, extra))
    return lambda parent, packed, extra: digest(_cbor_triple(parent, packed, extra))


def _digest(kind: str) -> Callable[[bytes], bytes]:
    if kind.startswith("sha256"):
        return lambda data: hashlib.sha256(data).digest()
    try:
        import xxhash
    except ImportError:  # an optional package: vLLM installs it; CacheConfig says so at construction
        raise ValueError(f"block_hash {kind!r} needs the xxhash package (pip install xxhash)") from None
    return xxhash.xxh3_128_digest  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """A request's extra keys, block by block (module docstring), and their encoding for the pool's hash
    kind. ``at(j)`` is what block j hashes; most blocks hash ``plain``, computed once.

    >>> k = BlockKeys.of((("lora", "a", "/p"),), first=(("cache_salt", "s"),))
    >>> k.raw(0, 4), k.raw(1, 4)
    ((('lora', 'a', '/p'), ('cache_salt', 's')), (('lora', 'a', '/p'),))
    >>> BlockKeys.of((), content=(("img", 3, 6),)).raw(1, 4)
    (('mm', 'img', -1),)
    """

    every: tuple[Key, ...]
    content: tuple[Content, ...]
    first: tuple[Key, ...]
    kind: str
    plain: Any  # encode_keys(every): a block no content span touches, past the first

    @staticmethod
    def of(
        every: tuple[Key, ...] = (),
        *,
        content: tuple[Content, ...] = (),
        first: tuple[Key, ...] = (),
        kind: str = "blake2b",
    ) -> BlockKeys:
        return BlockKeys(every, content, first, kind, encode_keys(every, kind))

    @property
    def varies(self) -> bool:
        """Do some blocks hash other keys than ``plain``?"""
        return bool(self.content or self.first)

    def raw(self, j: int, block_size: int, lookahead: int = 0) -> tuple[Key, ...]:
        """Block j's keys: every block's, the content spans it (and the ``lookahead`` ids after it its hash
        covers) touches, offset from its start, then the first block's."""
        keys = self.every
        if self.content:
            start, end = j * block_size, (j + 1) * block_size + lookahead
            keys += tuple(("mm", ident, off - start) for ident, off, n in self.content if end > off and start < off + n)
        if j == 0 and self.first:
            keys += self.first
        return keys

    def ahead(self, j: int, block_size: int, next_ids: tuple[int, ...]) -> Any:
        """Block j's keys, encoded, when its hash also covers the ids after it (``CacheConfig.hash_lookahead``):
        vLLM's lookahead hash keys ``(the keys of the block and those ids, or None, *those ids)``.

        >>> k = BlockKeys.of(content=(("img", 4, 2),), kind="sha256")
        >>> k.ahead(0, 4, (9,)), k.ahead(1, 4, (9,))   # an image at positions 4 and 5: block 1's, and block 0's peek
        (((('mm', 'img', 4),), 9), ((('mm', 'img', 0),), 9))
        """
        return encode_keys((self.raw(j, block_size, len(next_ids)) or None, *next_ids), self.kind)

    def at(self, j: int, block_size: int) -> Any:
        """Block j's keys, encoded for the hash."""
        if not self.content and (j or not self.first):
            return self.plain
        return encode_keys(self.raw(j, block_size), self.kind)


NO_KEYS = BlockKeys.of()


def cbor(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic, as ``cbor2.dumps(obj, canonical=True)``) of strings,
    bytes, integers, None, booleans and tuples or lists of them: what vLLM's CBOR hash kinds digest.

    >>> cbor(("lora", "a", 7)).hex(), cbor(None).hex(), cbor(-1).hex()
    ('83646c6f7261616107', 'f6', '20')
    """
    if obj is None:
        return b"\xf6"
    if obj is True or obj is False:
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, str):
        return _cbor_text(obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, (tuple, list)):
        return _cbor_head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(f"no canonical CBOR for {type(obj).__name__}")


_UINTS: list[bytes] = []  # the CBOR of each integer below 2**17 (token ids), built at the first use
_HEADS: dict[tuple[int, int], tuple[bytes, bytes]] = {}  # (parent bytes, ids) -> the triple's two heads


def _uints() -> list[bytes]:
    _UINTS.extend(_cbor_head(0, i) for i in range(1 << 17))
    return _UINTS


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
