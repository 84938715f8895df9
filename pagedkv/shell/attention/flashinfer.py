"""The ``flashinfer`` backend: FlashInfer's paged kernels over the shell's pages (NHD: (blocks, block size,
KV heads, head dim), K and V apart, as ``paged_kv_cache=(k_pages, v_pages)``).

Decode forwards run ``BatchDecodeWithPagedKVCacheWrapper``; forwards with several query tokens (prefill,
chunked prefill, image spans, denoising steps) ``BatchPrefillWithPagedKVCacheWrapper``, one call per
segment of the core's metadata (causal or a full span, FlashInfer's causal mask aligned bottom-right as
the core's segments are). A forward is planned once a KV cache group on the host, from the snapshot's own
block ids (no device sync), and every layer of the group runs that plan. Sliding windows are
``window_left = window - 1`` (a token sees itself and ``window - 1`` before it); a row's leading null
blocks (positions the window let go) are left out of its page list. Logit softcaps pass through.

``capturable``: decode runs inside the engine's CUDA graphs through a wrapper per graph bucket with
``use_cuda_graph=True`` over fixed index buffers; ``GraphDecoder`` calls ``begin_graph`` before a
capture's warm-up and before each replay (the host-side plan a graph cannot hold), ``end_graph`` after.

Refused with a message: float32 (FlashInfer computes fp16 / bf16), chunked local groups, an explicit head
map of a tensor-parallel shard, a full span under a sliding window. ``pip install flashinfer-python``
(it compiles its kernels with the machine's nvcc at first use).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.core.errors import ErrorCode, InvariantError
from pagedkv.core.rules.kinds import GroupKind
from pagedkv.core.outputs.metadata import KVMetadata, Phase
from pagedkv.shell.attention.base import LayerAttention, SegmentCall, run_segments
from pagedkv.shell.errors import BackendUnavailable, refuse
from pagedkv.shell.worker import ForwardBatch

INSTALL = "pip install flashinfer-python (with apache-tvm-ffi; kernels compile with nvcc at first use)"
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace


def page_lists(
    rows: Any, group: int, kv_lens: list[int], block_size: int, window: int
) -> tuple[list[int], list[int], list[int]]:
    """FlashInfer's page table of one group for a forward's ``rows``: indptr, indices, last page lengths.
    A row lists the blocks its first ``kv_lens[r]`` keys fill; with a window, not the leading null ones
    (nothing in them is visible, and FlashInfer's positions are relative to the first page listed).

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state, publish
    >>> s = admit(initial_state(CacheConfig(block_size=4, num_blocks=9)), RequestSpec("a", (RowSpec(6),))).unwrap().state
    >>> page_lists(publish(s, ["a"], "prefill").unwrap().effect.rows, 0, [6], 4, 0)
    ([0, 2], [1, 2], [2])
    """
    indptr, indices, last = [0], [], []
    for row, kv in zip(rows, kv_lens):
        ids = row.block_ids[group]
        n = -(-kv // block_size)
        first = 0
        if window:
            while first < n - 1 and ids[first] == 0:
                first += 1
        indices.extend(ids[first:n])
        indptr.append(len(indices))
        last.append(kv - (n - 1) * block_size if n else 0)
    return indptr, indices, last


class FlashInferBackend:
    name = "flashinfer"
    kv_write = None  # the page pool's own write (two index_copy_)
    fp8_pages = True  # FlashInfer's fp8 kernels (kv_data_type fp8, the layer's scales passed to run)
    capturable = True  # decode through a CUDA-graph wrapper a bucket (begin_graph before each replay)

    def __init__(self) -> None:
        try:
            import flashinfer
        except ImportError as e:
            raise BackendUnavailable(self.name, INSTALL, str(e)) from None
        if not torch.cuda.is_available():
            raise BackendUnavailable(self.name, "a CUDA device", "no CUDA device is available")
        self.fi: Any = flashinfer
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple[Any, ...], Any] = {}  # one a (segment, group, ...) key, planned again each forward
        self._planned: dict[tuple[Any, ...], KVMetadata] = {}  # the forward each wrapper is planned for now
        self._graph: dict[tuple[Any, ...], Any] = {}  # (bucket, *key): CUDA-graph decode wrappers
        self._graph_batch: int | None = None  # the bucket being captured or replayed (begin_graph)
        self._graph_input: tuple[ForwardBatch, int] | None = None
        self._block_size = 0

    def _ws(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: ForwardBatch, layer: LayerAttention
    ) -> torch.Tensor:
        spec = layer.spec
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise refuse(
                ErrorCode.INVALID,
                f"FlashInfer computes float16 and bfloat16 attention; this forward is "
                f"{str(q.dtype)[6:]} (use the triton or torch backend)",
            )
        if spec.kind is GroupKind.CHUNKED_LOCAL or layer.kv_index is not None:
            what = (
                "chunked local attention"
                if layer.kv_index is None
                else "an explicit head map (a tensor-parallel shard)"
            )
            raise refuse(ErrorCode.INVALID, f"the flashinfer backend does not compute {what}; use the torch backend")
        window = spec.window if spec.kind is GroupKind.SLIDING_WINDOW and spec.window else 0
        meta = batch.metadata
        if window and any(not s.causal for s in meta.rows[0].segments):
            raise refuse(
                ErrorCode.INVALID,
                "a full span under a sliding window has no FlashInfer window form (its "
                "window is causal); use the torch backend for that group",
            )
        kv_heads, head_dim, block_size = k_pages.shape[2], k_pages.shape[3], k_pages.shape[1]
        self._block_size = block_size
        heads = q.shape[1]
        key = (
            layer.group,
            window,
            layer.scale,
            float(layer.softcap or 0.0),
            q.dtype,
            heads,
            kv_heads,
            head_dim,
            k_pages.dtype,
        )
        ks, vs = layer.kv_scales  # (fp8 pages: FlashInfer folds K's into the softmax scale, applies V's to the output)
        if meta.phase is Phase.DECODE:
            if self._graph_batch is not None:  # inside a CUDA graph: the bucket's wrapper, planned before replay
                wrapper = self._graph_wrapper(self._graph_batch, key, q.device)
            else:
                wrapper = self._wrappers.get(key)
                if wrapper is None:
                    wrapper = self._wrappers[key] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                        self._ws(q.device), "NHD", use_tensor_cores=heads // kv_heads >= 4
                    )
                if self._planned.get(key) is not meta:  # once a forward: every layer of the group runs the plan
                    self._plan_decode(wrapper, meta, key, block_size)
                    self._planned[key] = meta
            return wrapper.run(q, (k_pages, v_pages), k_scale=ks, v_scale=vs)  # type: ignore[no-any-return]

        def kernel(qp: torch.Tensor, call: SegmentCall) -> torch.Tensor:
            wkey = (call.segment, *key)
            wrapper = self._wrappers.get(wkey)
            if wrapper is None:
                wrapper = self._wrappers[wkey] = self.fi.BatchPrefillWithPagedKVCacheWrapper(self._ws(q.device), "NHD")
            if self._planned.get(wkey) is not meta:
                self._plan_prefill(wrapper, meta, call, key, block_size)
                self._planned[wkey] = meta
            return wrapper.run(qp, (k_pages, v_pages), k_scale=ks, v_scale=vs)  # type: ignore[no-any-return]

        return run_segments(q, batch, kernel)

    def _common(self, key: tuple[Any, ...]) -> dict[str, Any]:
        _, window, scale, softcap, dtype, *_, kv_dtype = key
        return {
            "window_left": window - 1 if window else -1,
            "sm_scale": scale,
            "logits_soft_cap": softcap or None,
            "q_data_type": dtype,
            "kv_data_type": kv_dtype,
        }

    def _plan_decode(self, wrapper: Any, meta: KVMetadata, key: tuple[Any, ...], block_size: int) -> None:
        group, window, *_, heads, kv_heads, head_dim, _ = key
        lens = [row.seq_len for row in meta.rows]
        indptr, indices, last = page_lists(meta.rows, group, lens, block_size, window)
        i32 = torch.int32
        wrapper.plan(
            torch.tensor(indptr, dtype=i32),
            torch.tensor(indices or [0], dtype=i32)[: len(indices)],
            torch.tensor(last, dtype=i32),
            heads,
            kv_heads,
            head_dim,
            block_size,
            **self._common(key),
        )

    def _plan_prefill(
        self, wrapper: Any, meta: KVMetadata, call: SegmentCall, key: tuple[Any, ...], block_size: int
    ) -> None:
        group, window, *_, heads, kv_heads, head_dim, _ = key
        segs = [row.segments[call.segment] for row in meta.rows]
        qo = [0]
        for s in segs:
            qo.append(qo[-1] + s.q_end - s.q_start)
        indptr, indices, last = page_lists(meta.rows, group, [s.kv_end for s in segs], block_size, window)
        i32 = torch.int32
        wrapper.plan(
            torch.tensor(qo, dtype=i32),
            torch.tensor(indptr, dtype=i32),
            torch.tensor(indices or [0], dtype=i32)[: len(indices)],
            torch.tensor(last, dtype=i32),
            heads,
            kv_heads,
            head_dim,
            block_size,
            causal=call.causal,
            **self._common(key),
        )

    # -- CUDA graphs ---------------------------------------------------------------------------------------
    def begin_graph(self, bucket: int, batch: ForwardBatch, max_blocks_per_row: int) -> None:
        """Decode forwards until ``end_graph`` run in CUDA graph ``bucket``'s wrappers (fixed index buffers,
        ``use_cuda_graph=True``), planned now for the installed ``batch`` padded to ``bucket`` rows (a padding
        row reads one slot of the null block). ``GraphDecoder`` calls it before a capture's warm-up and
        before every replay: the plan is host work a graph cannot hold; the kernels read its buffers."""
        self._graph_batch = bucket
        self._graph_input = (batch, max_blocks_per_row)
        for (b, *key), wrapper in self._graph.items():
            if b == bucket:
                self._plan_graph(wrapper, bucket, tuple(key), batch.metadata)

    def end_graph(self) -> None:
        self._graph_batch = None
        self._graph_input = None

    def _graph_wrapper(self, bucket: int, key: tuple[Any, ...], device: torch.device) -> Any:
        wrapper = self._graph.get((bucket, *key))
        if wrapper is None:  # first seen in a capture's warm-up (eager): made and planned here
            if self._graph_input is None:
                raise InvariantError("begin_graph runs before a graph's forwards")
            batch, max_blocks = self._graph_input
            i32 = torch.int32
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self._ws(device),
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=key[5] // key[6] >= 4,
                paged_kv_indptr_buffer=torch.zeros(bucket + 1, dtype=i32, device=device),
                paged_kv_indices_buffer=torch.zeros(bucket * max(max_blocks, 1), dtype=i32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(bucket, dtype=i32, device=device),
            )
            self._graph[(bucket, *key)] = wrapper
            self._plan_graph(wrapper, bucket, key, batch.metadata)
        return wrapper

    def _plan_graph(self, wrapper: Any, bucket: int, key: tuple[Any, ...], meta: KVMetadata) -> None:
        rows = list(meta.rows)[:bucket]
        indptr, indices, last = page_lists(rows, key[0], [row.seq_len for row in rows], self._block_size, key[1])
        for _ in range(bucket - len(rows)):  # padding rows: one slot of the null block
            indices.append(0)
            indptr.append(len(indices))
            last.append(1)
        i32 = torch.int32
        wrapper.plan(
            torch.tensor(indptr, dtype=i32),
            torch.tensor(indices, dtype=i32),
            torch.tensor(last, dtype=i32),
            key[5],
            key[6],
            key[7],
            self._block_size,
            **self._common(key),
        )
