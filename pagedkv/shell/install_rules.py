"""Whether a snapshot may be installed: every rule a worker checks before it writes anything (the
generation rules of docs/core.md's metadata snapshot, the rows' lengths, block ids and slots, the buffers' sizes).
A decode forward's columns are read without making a record a row; any row that is not the very block
lists installed goes through the general rules."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

from pagedkv.core.config import CacheConfig
from pagedkv.core.errors import INT_ID_LIMIT, ErrorCode, RequestId, shown
from pagedkv.core.outputs.metadata import DecodeRows, KVMetadata, RowMetadata
from pagedkv.shell.errors import refuse

RowKey = tuple[RequestId, int]  # (request, row)


class Buffers(Protocol):
    """What the rules read of a worker: its geometry and the rows it holds."""

    config: CacheConfig
    max_rows: int
    max_tokens: int
    token_rows: int
    max_blocks: int
    num_groups: int
    windowed: tuple[bool, ...]  # per group: do its positions go null?
    rows: dict[RowKey, tuple[int, tuple[tuple[int, ...], ...]]]
    free_rows: list[int]


class InstallRules:
    """The rules over one worker's buffers and what it holds (``check`` raises ``ShellError``, writes nothing)."""

    __slots__ = ("w",)

    def __init__(self, worker: Buffers) -> None:
        self.w = worker

    def check(
        self,
        meta: KVMetadata,
        installed: dict[RowKey, tuple[int, tuple[tuple[int, ...], ...]]],
        req_gen: dict[RequestId, int],
    ) -> None:
        if isinstance(meta.rows, DecodeRows) and meta.block_size == self.w.config.block_size:
            return self._check_decode(meta, meta.rows, installed, req_gen)
        self._check_general(meta, installed, req_gen)

    def _check_general(
        self,
        meta: KVMetadata,
        installed: dict[RowKey, tuple[int, tuple[tuple[int, ...], ...]]],
        req_gen: dict[RequestId, int],
        only: list[int] | None = None,
    ) -> None:
        """Every rule, row by row (``only``: just those rows of a decode forward the fast path did not settle)."""
        cfg = self.w.config
        if meta.block_size != cfg.block_size:
            raise refuse(ErrorCode.INVALID, f"snapshot block size {meta.block_size}, pool block size {cfg.block_size}")
        rows: Sequence[RowMetadata] = meta.rows if only is None else [meta.rows[i] for i in only]
        if not rows:
            raise refuse(ErrorCode.INVALID, "a snapshot with no rows")
        if len(meta.rows) > self.w.max_rows:
            raise refuse(ErrorCode.INVALID, f"{len(meta.rows)} rows, buffers hold {self.w.max_rows}")
        tokens = sum(r.query_len for r in rows) if only is None else len(meta.rows)
        if tokens > self.w.max_tokens:
            raise refuse(ErrorCode.INVALID, f"{tokens} query tokens, buffers hold {self.w.max_tokens}")
        seen: set[RowKey] = set()
        new_rows = 0
        for r in rows:
            key = (r.request_id, r.row)
            where = f"request {shown(r.request_id)} row {shown(r.row)}"
            if key in seen:
                raise refuse(ErrorCode.INVALID, f"{where} appears twice", request=r.request_id)
            seen.add(key)
            old = installed.get(key)
            self._check_row(r, where, same_blocks=old is not None and old[1] is r.block_ids)
            if old is None:
                new_rows += 1
                self._check_slots(r, where)
                continue
            if old[1] is r.block_ids:
                self._check_slots(r, where)
                continue  # the very block lists installed (the core reuses unchanged ones): nothing to compare
            gen = req_gen.get(r.request_id, 0)
            if meta.generation == gen and r.block_ids != old[1]:
                raise refuse(
                    ErrorCode.CONFLICTING_METADATA,
                    f"{where}: generation {gen} is installed with other block ids",
                    request=r.request_id,
                )
            if not self._extends(old[1], r.block_ids):
                raise refuse(
                    ErrorCode.CONFLICTING_METADATA,
                    f"{where}: generation {meta.generation} does not extend what generation {gen} installed",
                    request=r.request_id,
                )
            self._check_slots(r, where)
        if new_rows > (len(self.w.free_rows) if installed is self.w.rows else self.w.max_rows):
            raise refuse(ErrorCode.INVALID, f"{new_rows} new rows, {len(self.w.free_rows)} buffer rows free")

    def check_token_rows(self, meta: KVMetadata) -> None:
        """A snapshot laid out one query token a row (``Worker.install(token_rows=True)``): causal rows only, as
        many tokens as the buffers' token rows."""
        if isinstance(meta.rows, DecodeRows):
            return
        tokens = 0
        for r in meta.rows:
            if not one_causal_segment(r):
                raise refuse(
                    ErrorCode.INVALID,
                    f"request {shown(r.request_id)}: only causal rows are laid out one "
                    "token a row (its segments are not one causal segment)",
                )
            tokens += r.query_len if type(r.query_len) is int else 0
        if tokens > self.w.token_rows:
            raise refuse(
                ErrorCode.INVALID,
                f"{tokens} query tokens laid out one a row; the buffers hold {self.w.token_rows} such rows",
            )

    def _check_decode(
        self,
        meta: KVMetadata,
        rows: DecodeRows,
        installed: dict[RowKey, tuple[int, tuple[tuple[int, ...], ...]]],
        req_gen: dict[RequestId, int],
    ) -> None:
        """``_check`` for a decode forward's columns: the same rules, read without making a record a row.
        A row whose block lists are the very ones installed needs only its length checked; any other row
        (new, or its lists grew) goes through the general checks."""
        n = len(rows)
        if not n or n > self.w.max_rows or n > self.w.max_tokens or len(set(rows.request_ids)) != n:
            return self._check_general(meta, installed, req_gen)  # the general path says what is wrong
        bs = self.w.config.block_size
        other = []
        for i, (rid, blocks, seq_len, slot) in enumerate(
            zip(rows.request_ids, rows.block_ids, rows.seq_lens, rows.slots)
        ):
            old = installed.get((rid, 0))
            if old is None or old[1] is not blocks:
                other.append(i)
            elif (
                not (1 <= seq_len <= len(blocks[0]) * bs)
                or blocks[0][(seq_len - 1) // bs] == 0
                or slot != blocks[0][(seq_len - 1) // bs] * bs + (seq_len - 1) % bs
            ):
                self._check_row(rows[i], f"request {rid!r} row 0", same_blocks=True)  # raises, saying which
                self._check_slots(rows[i], f"request {rid!r} row 0")
        if other:
            self._check_general(meta, installed, req_gen, only=other)

    def _check_row(self, r: RowMetadata, where: str, *, same_blocks: bool = False) -> None:
        cfg = self.w.config
        for name in ("row", "seq_len", "query_len", "kv_start_pos"):
            value = getattr(r, name)
            if type(value) is not int or not 0 <= value < INT_ID_LIMIT:
                raise refuse(ErrorCode.INVALID, f"{where}: {name} must be a non-negative integer, got {shown(value)}")
        if not isinstance(r.block_ids, tuple) or not all(isinstance(ids, tuple) for ids in r.block_ids):
            raise refuse(ErrorCode.INVALID, f"{where}: block_ids must be a tuple of block-id tuples, one a group")
        if not isinstance(r.slots, (tuple, list, array)) or not isinstance(r.segments, tuple):
            raise refuse(ErrorCode.INVALID, f"{where}: slots must be a sequence of integers and segments a tuple")
        if len(r.block_ids) != self.w.num_groups:
            raise refuse(ErrorCode.INVALID, f"{where}: {len(r.block_ids)} groups, the pool has {self.w.num_groups}")
        nb = len(r.block_ids[0])
        for g, ids in enumerate(() if same_blocks else r.block_ids):  # installed lists were checked then
            if len(ids) != nb or nb > self.w.max_blocks:
                raise refuse(
                    ErrorCode.INVALID, f"{where}: {len(ids)} blocks in group {g}; rows hold {self.w.max_blocks}"
                )
            for b in ids:
                if type(b) is not int or not 0 <= b < cfg.num_blocks:
                    raise refuse(ErrorCode.INVALID, f"{where}: block id {b!r} outside [0, {cfg.num_blocks})")
        if not (0 <= r.kv_start_pos and r.query_len >= 1 and r.kv_start_pos + r.query_len == r.seq_len):
            raise refuse(
                ErrorCode.INVALID,
                f"{where}: lengths start {r.kv_start_pos} + query {r.query_len} != seq_len {r.seq_len}",
            )
        if r.seq_len > nb * cfg.block_size:
            raise refuse(ErrorCode.INVALID, f"{where}: seq_len {r.seq_len} exceeds its {nb} blocks")
        if len(r.slots) != r.query_len:
            raise refuse(ErrorCode.INVALID, f"{where}: {len(r.slots)} slots for {r.query_len} query tokens")
        if any(r.block_ids[0][p // cfg.block_size] == 0 for p in (r.kv_start_pos, r.seq_len - 1)):
            raise refuse(ErrorCode.INVALID, f"{where}: a query position sits in the null block")

    def _check_slots(self, r: RowMetadata, where: str) -> None:
        """Each query token's slot is where the row's block table puts its position (a forged one would
        write into another request's page)."""
        bs, table = self.w.config.block_size, r.block_ids[0]
        for p, slot in enumerate(r.slots, r.kv_start_pos):
            if type(slot) is not int or slot != table[p // bs] * bs + p % bs:
                raise refuse(
                    ErrorCode.INVALID,
                    f"{where}: slot {shown(slot)} of position {p} is not the block table's "
                    f"{table[p // bs] * bs + p % bs}",
                    request=r.request_id,
                )

    def _extends(self, old: tuple[tuple[int, ...], ...], new: tuple[tuple[int, ...], ...]) -> bool:
        for g, (a, b) in enumerate(zip(old, new)):  # (shorter lists: a row cut back, its tail's blocks gone)
            for x, y in zip(a, b):
                if x != y and not (y == 0 and self.w.windowed[g]):
                    return False
        return True


def one_causal_segment(row: object) -> bool:
    """Is ``row`` (a snapshot's ``RowMetadata``) one causal segment: what may be laid out one query token a row?"""
    segs = getattr(row, "segments", None)
    return isinstance(segs, tuple) and len(segs) == 1 and bool(getattr(segs[0], "causal", False))
