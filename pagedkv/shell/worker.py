"""The worker: installs the core's metadata snapshots into persistent device buffers.

Every check runs before any write, so a refused install leaves every buffer as
it was. Generation rules (docs/core.md, "The metadata snapshot"): an older generation is ``STALE_METADATA``;
the same generation with the same snapshot is a no-op; a request whose block
lists at the same generation differ, or at a newer generation do not extend
(or, in windowed groups, null out) what is installed, is ``CONFLICTING_METADATA``;
a newer extending snapshot writes only the new block ids. A newer epoch (a core
``reset``) drops everything installed.

Buffers are sized once (``max_rows`` x ``max_blocks_per_row``; ``max_tokens``
query tokens; ``token_rows`` forward rows where a snapshot is laid out one query
token a row), so their addresses never change and a captured CUDA graph can
replay over new values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.core.config import CacheConfig
from pagedkv.core.errors import ErrorCode, INT_ID_LIMIT, InvariantError, RequestId, shown
from pagedkv.core.outputs.metadata import DecodeRows, KVMetadata, token_rows_of
from pagedkv.shell.errors import refuse
from pagedkv.shell.install_rules import InstallRules, RowKey
from pagedkv.shell.transfer import to_device


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """What one installed forward hands the attention backend: views of the worker's buffers,
    rows in the snapshot's order, tokens in query order."""

    metadata: KVMetadata
    num_rows: int
    num_tokens: int
    block_tables: torch.Tensor  # (groups, num_rows, max_blocks_per_row) int32
    seq_lens: torch.Tensor  # (num_rows,) int32: keys end here
    kv_start: torch.Tensor  # (num_rows,) int32: first query position
    query_start_loc: torch.Tensor  # (num_rows + 1,) int32: cumulative query lengths
    slot_mapping: torch.Tensor  # (num_tokens,) int64: group-0 slot of each query token
    positions: torch.Tensor  # (num_tokens,) int64: absolute position of each query token
    slot_mappings: torch.Tensor  # (groups, num_tokens) int64: each group's slot (row 0 is slot_mapping)
    source: KVMetadata | None = None  # the core's snapshot, where ``metadata`` lays it out one token a row

    @property
    def snapshot(self) -> KVMetadata:
        """The core's snapshot this batch installs (``source``, or ``metadata`` itself)."""
        return self.metadata if self.source is None else self.source


class Worker:
    """One rank's view of the block tables. ``install`` before each forward; ``remove`` on release."""

    def __init__(
        self,
        config: CacheConfig,
        *,
        max_rows: int,
        max_blocks_per_row: int,
        max_tokens: int,
        token_rows: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.num_groups = len(config.groups)
        self.windowed = tuple(r.nulls_positions for r in config.rules)  # groups whose positions go null
        self.max_rows, self.max_blocks, self.max_tokens = max_rows, max_blocks_per_row, max_tokens
        self.token_rows = min(token_rows, max_tokens)  # query tokens a forward may lay out one a row (install)
        fwd = max(max_rows, self.token_rows)  # forward rows the kernels' buffers hold
        self.forward_rows = fwd
        dev = torch.device(device)

        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=dev)

        # persistent buffers: by buffer row (what is installed), and in forward order (what kernels read)
        self.row_tables = i32(self.num_groups, max_rows, max_blocks_per_row)
        self.block_tables = i32(self.num_groups, fwd, max_blocks_per_row)
        self.seq_lens = i32(fwd)
        self.kv_start = i32(fwd)
        self.query_start_loc = i32(fwd + 1)
        # each group's slot of each query token (padding: the null block's slot 0); group 0's is the snapshot's,
        # the others' are read from their block tables (a layer writes its own group's pages)
        self.slot_mappings = torch.zeros(self.num_groups, max_tokens, dtype=torch.int64, device=dev)
        self.slot_mapping = self.slot_mappings[0]
        self._token_rows = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self._arange = torch.arange(fwd + 1, dtype=torch.int32, device=dev)  # a decode batch's query starts
        self.generation = 0
        self.epoch: int | None = None
        self.rows: dict[RowKey, tuple[int, tuple[tuple[int, ...], ...]]] = {}  # -> (buffer row, installed blocks)
        self.request_generation: dict[RequestId, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.last: tuple[KVMetadata, ForwardBatch] | None = None
        # the cuts since a leader rank last sent them to its followers (a leader sets it to a list), else None
        self.cuts: list[tuple[RequestId, tuple[tuple[int, ...], ...], int]] | None = None

    # -- install ---------------------------------------------------------------
    def install(self, meta: KVMetadata, *, token_rows: bool = False) -> ForwardBatch:
        """Validate ``meta`` completely, then write it; raises ``ShellError`` and writes nothing if refused.

        ``token_rows``: lay the snapshot's query tokens out one a forward row (a decode row over its request's
        block table, its length its position + 1; the batch's ``metadata`` says so, ``source`` is ``meta``), so
        the decode kernel and its captured graphs compute it, every position exactly as a decode of that
        position would. Only causal rows (one causal segment each), up to ``token_rows`` tokens."""
        last = self.last
        if last is not None and last[0] is meta and (last[1].source is not None) == token_rows:
            return last[1]
        if not isinstance(meta, KVMetadata):
            raise refuse(ErrorCode.INVALID, f"install needs KVMetadata, got {type(meta).__name__}")
        for name in ("generation", "epoch", "block_size"):
            value = getattr(meta, name)
            if type(value) is not int or not 0 <= value < INT_ID_LIMIT:
                raise refuse(ErrorCode.INVALID, f"snapshot {name} must be a non-negative integer, got {shown(value)}")
        if last is not None and last[0] == meta and (last[1].source is not None) == token_rows:
            return last[1]  # the same generation and snapshot: a no-op
        if token_rows:
            InstallRules(self).check_token_rows(meta)
        new_epoch = self.epoch is None or meta.epoch > self.epoch
        if not new_epoch and meta.epoch < self.epoch:  # type: ignore[operator]
            raise refuse(ErrorCode.STALE_METADATA, f"snapshot of epoch {meta.epoch}; epoch {self.epoch} is installed")
        if not new_epoch and meta.generation < self.generation:
            raise refuse(
                ErrorCode.STALE_METADATA,
                f"snapshot of generation {meta.generation}; generation {self.generation} is installed",
            )
        installed = {} if new_epoch else self.rows
        req_gen = {} if new_epoch else self.request_generation
        InstallRules(self).check(meta, installed, req_gen)
        return self._write(meta, new_epoch, token_rows)

    def _write(self, meta: KVMetadata, new_epoch: bool, token_rows: bool = False) -> ForwardBatch:
        if new_epoch:
            self.rows.clear()
            self.request_generation.clear()
            self.free_rows = list(range(self.max_rows - 1, -1, -1))
            self.epoch = meta.epoch
            self.generation = 0
        rows = meta.rows
        decode = isinstance(rows, DecodeRows)
        keys = (
            [(rid, 0) for rid in rows.request_ids]
            if isinstance(rows, DecodeRows)
            else [(r.request_id, r.row) for r in rows]
        )
        lists = rows.block_ids if isinstance(rows, DecodeRows) else [r.block_ids for r in rows]
        order = self._place_rows(keys, lists)
        gen = meta.generation
        for key in keys:
            self.request_generation[key[0]] = gen
        n = len(order)
        dev = self.row_tables.device
        view = meta
        if token_rows and not decode:  # each query token its own row: the decode layout below
            view = token_rows_of(meta)
            order = [o for o, r in zip(order, rows) for _ in range(r.query_len)]
            rows, decode, n = view.rows, True, len(view.rows)
        if decode:  # one query token a row: its slot, at position seq_len - 1
            if not isinstance(rows, DecodeRows):
                raise InvariantError("a decode install holds DecodeRows")
            packed = to_device(order + rows.seq_lens.tolist() + rows.slots.tolist(), torch.int64, dev)
            rows_idx, lens = packed[:n], packed[n : 2 * n]
            tokens = n
            self.seq_lens[:n].copy_(lens)
            torch.sub(lens, 1, out=self.positions[:n])
            self.kv_start[:n].copy_(self.positions[:n])
            self.query_start_loc[: n + 1].copy_(self._arange[: n + 1])
            self.slot_mapping[:n].copy_(packed[2 * n :])
        else:
            rows_idx = to_device(order, torch.int64, dev)
            lens = to_device([[r.seq_len, r.kv_start_pos, r.query_len] for r in rows], torch.int32, dev)
            self.seq_lens[:n].copy_(lens[:, 0])
            self.kv_start[:n].copy_(lens[:, 1])
            torch.cumsum(lens[:, 2], 0, out=self.query_start_loc[1 : n + 1])
            tokens = sum(r.query_len for r in rows)
            self.positions[:tokens].copy_(
                to_device([p for r in rows for p in range(r.kv_start_pos, r.seq_len)], torch.int64, dev)
            )
            self.slot_mapping[:tokens].copy_(to_device([s for r in rows for s in r.slots], torch.int64, dev))
        torch.index_select(self.row_tables, 1, rows_idx, out=self.block_tables[:, :n])
        self.slot_mappings[:, tokens:].zero_()  # padding tokens write to the null block's slot 0
        if self.num_groups > 1:
            self._group_slots(n, tokens, None if decode else [r.query_len for r in rows])
        self.generation = max(self.generation, meta.generation)
        batch = ForwardBatch(
            view,
            n,
            tokens,
            self.block_tables[:, :n],
            self.seq_lens[:n],
            self.kv_start[:n],
            self.query_start_loc[: n + 1],
            self.slot_mapping[:tokens],
            self.positions[:tokens],
            self.slot_mappings[:, :tokens],
            None if view is meta else meta,
        )
        self.last = (meta, batch)
        return batch

    def _place_rows(self, keys: list[RowKey], lists: Sequence[tuple[tuple[int, ...], ...]]) -> list[int]:
        """Each row's buffer row (a free one for a new row), its block table updated where ids changed (new
        positions, window positions gone null); the buffer rows, in order."""
        order = []
        flat: list[int] = []  # row_tables' flat positions that change, and their new ids
        vals: list[int] = []
        stride_g, stride_r = self.max_rows * self.max_blocks, self.max_blocks
        for key, blocks in zip(keys, lists):
            entry = self.rows.get(key)
            old: tuple[tuple[int, ...], ...]
            if entry is None:
                brow, old = self.free_rows.pop(), tuple(() for _ in blocks)
            else:
                brow, old = entry
            if old is not blocks:
                for g, (a, b) in enumerate(zip(old, blocks)):
                    base = g * stride_g + brow * stride_r
                    for i in range(len(b)):
                        if i >= len(a) or a[i] != b[i]:
                            flat.append(base + i)
                            vals.append(b[i])
            self.rows[key] = (brow, blocks)
            order.append(brow)
        if flat:
            dev = self.row_tables.device
            self.row_tables.view(-1).index_copy_(
                0, to_device(flat, torch.int64, dev), to_device(vals, torch.int32, dev)
            )
        return order

    def _group_slots(self, n: int, tokens: int, query_lens: list[int] | None) -> None:
        """Groups 1.. : each query token's slot from its row's block table in that group (the position's
        block is never null: a query always sees its own position), on the device, into the buffers."""
        bs = self.config.block_size
        rows = self._token_rows[:tokens]
        if query_lens is None:  # one token a row
            torch.arange(n, out=rows)
        else:
            counts = to_device(query_lens, torch.int64, rows.device)
            rows.copy_(torch.repeat_interleave(torch.arange(n, device=rows.device), counts))
        pos = self.positions[:tokens]
        blocks = self.block_tables[1:, rows, pos // bs].long()  # (groups - 1, tokens)
        torch.add(blocks * bs, pos % bs, out=self.slot_mappings[1:, :tokens])

    # -- fixed-shape decode batches (CUDA graphs) ----------------------------------
    def decode_views(self, rows: int, metadata: KVMetadata) -> ForwardBatch:
        """The first ``rows`` rows of the buffers as a one-token-a-row batch: what a graph captures."""
        return ForwardBatch(
            metadata,
            rows,
            rows,
            self.block_tables[:, :rows],
            self.seq_lens[:rows],
            self.kv_start[:rows],
            self.query_start_loc[: rows + 1],
            self.slot_mapping[:rows],
            self.positions[:rows],
            self.slot_mappings[:, :rows],
        )

    def pad_decode(self, rows: int, bucket: int) -> None:
        """Make buffer rows ``rows..bucket`` padding of an installed decode batch of ``rows`` rows: the
        null block's slot, length 1, no blocks. Nothing installed changes; the next install rewrites them."""
        if bucket <= rows:
            return
        self.slot_mappings[:, rows:bucket].zero_()
        self.seq_lens[rows:bucket].fill_(1)
        self.query_start_loc[rows + 1 : bucket + 1] = torch.arange(
            rows + 1, bucket + 1, dtype=torch.int32, device=self.query_start_loc.device
        )
        self.block_tables[:, rows:bucket].zero_()

    # -- remove ----------------------------------------------------------------
    def remove(self, request_ids: list[RequestId] | tuple[RequestId, ...]) -> int:
        """Forget released requests; their buffer rows go back. Idempotent: unknown ids count 0."""
        gone = set(request_ids)
        keys = [k for k in self.rows if k[0] in gone]
        for k in keys:
            brow, _ = self.rows.pop(k)
            self.row_tables[:, brow].zero_()
            self.free_rows.append(brow)
        for rid in gone:
            self.request_generation.pop(rid, None)
        if keys:
            self.last = None
        return len(keys)

    def cut(self, request_id: RequestId, blocks: tuple[tuple[int, ...], ...], generation: int) -> None:
        """The core cut a request's row back (``truncate``: rejected drafts, speculative decoding) in
        ``generation``: its installed block lists become ``blocks``, which must be a prefix of them
        (``ShellError`` otherwise, nothing changed); its table past them is cleared. Followers of a leader
        rank replay each cut (``cuts``)."""
        key = (request_id, 0)
        entry = self.rows.get(key)
        if entry is None or entry[1] is blocks or entry[1] == blocks:
            return
        brow, old = entry
        if len(old) != len(blocks) or any(len(b) > len(a) or a[: len(b)] != b for a, b in zip(old, blocks)):
            raise refuse(
                ErrorCode.CONFLICTING_METADATA,
                f"request {shown(request_id)}: a cut to {shown(blocks):.80} is "
                f"not a prefix of the installed {shown(old):.80}",
            )
        for g, (a, b) in enumerate(zip(old, blocks)):
            self.row_tables[g, brow, len(b) : len(a)] = 0
        self.rows[key] = (brow, blocks)
        self.request_generation[request_id] = max(self.request_generation.get(request_id, 0), generation)
        if self.cuts is not None:
            self.cuts.append((request_id, blocks, generation))
        self.last = None

    def require(self, batch: ForwardBatch | None) -> ForwardBatch:
        """A paged forward without installed metadata is an error, never a dense run."""
        if batch is None:
            raise refuse(
                ErrorCode.INVALID, "a paged forward needs installed metadata (Worker.install); it never runs dense"
            )
        return batch
