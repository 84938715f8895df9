"""Paged decode attention in Triton (CUDA), split-KV, GQA, over the shell's page layout.

Grid (sequence, KV head, program): a row's keys are cut into splits of a fixed size (``SPLIT_KEYS``), each
program streams its share of the splits tile by tile through the block table, for all the query heads of
its KV head at once (so each K/V byte is read once), with an online softmax; a second kernel merges the
splits by their log-sum-exp in a fixed order. A row's result depends on its own keys alone: the batch
sets how many programs share the work, never how a row's sums are cut. Pages are
``(num_blocks, block_size, kv_heads, head_dim)``; a tile gathers its keys through the block table
token by token, so any block size from 16 works (tested: 16 and 128). With 16-bit math a program is one
warp (``paged_decode``'s comment says why); a split's last tile alone is masked.
"""

from __future__ import annotations

import functools
import math

import torch

from pagedkv.shell.pool import FP8

LOG2E = 1.4426950408889634  # the decode kernel's softmax runs in base 2
SPLIT_KEYS = 256  # keys a split of a row covers (fixed: a row's sums never follow the batch)
MAX_SPLITS = 64  # splits a row at most (past 64 x 256 keys, the splits grow instead)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines
    triton = None


if triton is not None:

    @triton.jit
    def _decode_tile(
        q,
        m_i,
        l_i,
        acc,
        K,
        V,
        TABLE,
        b,
        kvh,
        off,
        end,
        scale,
        stride_tb,
        stride_kb,
        KVH: tl.constexpr,
        D: tl.constexpr,
        BS: tl.constexpr,
        TILE: tl.constexpr,
        MASKED: tl.constexpr,
        FP8_PAGES: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One tile of keys folded into the online softmax (base 2: ``scale`` carries log2 e). Only a split's
        last tile is ``MASKED``: the others load, compare and select nothing for keys past the end."""
        pos = off + tl.arange(0, TILE)
        d = tl.arange(0, D)
        valid = pos < end
        if MASKED:
            blk = tl.load(TABLE + b * stride_tb + pos // BS, mask=valid, other=0)
        else:
            blk = tl.load(TABLE + b * stride_tb + pos // BS)
        at = blk.to(tl.int64) * stride_kb + ((pos % BS) * KVH + kvh) * D  # token slot, this KV head
        if MASKED:
            k = tl.load(K + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(V + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        else:
            k = tl.load(K + at[:, None] + d[None, :])
            v = tl.load(V + at[:, None] + d[None, :])
        if FP8_PAGES:  # fp8 pages: widened in registers; K's scale is in ``scale``, V's applied at the store
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # (GP, TILE)
        if MASKED:
            qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit
    def _split_kernel(
        Q,
        K,
        V,
        TABLE,
        LENS,
        OUT,
        LSE,
        scale,
        stride_tb,
        stride_kb,
        v_scale,
        KVH: tl.constexpr,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BS: tl.constexpr,
        TILE: tl.constexpr,
        SPLIT_KEYS: tl.constexpr,
        CAP: tl.constexpr,
        WIDTH: tl.constexpr,
        PROGRAMS: tl.constexpr,
        WINDOW: tl.constexpr,
        PRECISION: tl.constexpr,
        FP8_PAGES: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        p = tl.program_id(2)
        seq_len = tl.load(LENS + b)
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(seq_len - WINDOW, 0)
        span = seq_len - lo
        per = tl.maximum(SPLIT_KEYS, tl.cdiv(tl.cdiv(span, CAP), TILE) * TILE)  # the row's own span decides
        n = tl.cdiv(span, per)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        hmask = g < G
        # q: (GP, D), the G query heads of this KV head
        q = tl.load(Q + (b * KVH * G + kvh * G + g)[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
        if FP8_PAGES and Q.dtype.element_ty == tl.bfloat16:  # fp8 widens to fp16 in one instruction (to bf16: via fp32)
            q = q.to(tl.float16)
        heads = b * KVH * G + kvh * G + g
        for s in range(p, n, PROGRAMS):  # this program's splits: every PROGRAMS-th of the row's
            start = lo + s * per
            end = tl.minimum(start + per, seq_len)
            m_i = tl.full([GP], float("-inf"), tl.float32)
            l_i = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, D], tl.float32)
            full = start + (end - start) // TILE * TILE
            for off in range(start, full, TILE):
                m_i, l_i, acc = _decode_tile(
                    q,
                    m_i,
                    l_i,
                    acc,
                    K,
                    V,
                    TABLE,
                    b,
                    kvh,
                    off,
                    end,
                    scale,
                    stride_tb,
                    stride_kb,
                    KVH,
                    D,
                    BS,
                    TILE,
                    False,
                    FP8_PAGES,
                    PRECISION,
                )
            if full < end:
                m_i, l_i, acc = _decode_tile(
                    q,
                    m_i,
                    l_i,
                    acc,
                    K,
                    V,
                    TABLE,
                    b,
                    kvh,
                    full,
                    end,
                    scale,
                    stride_tb,
                    stride_kb,
                    KVH,
                    D,
                    BS,
                    TILE,
                    True,
                    FP8_PAGES,
                    PRECISION,
                )
            tl.store(
                OUT + (heads[:, None] * WIDTH + s) * D + d[None, :],
                acc / tl.maximum(l_i, 1e-30)[:, None] * v_scale,
                mask=hmask[:, None],
            )
            lse = m_i * 0.6931471805599453 + tl.log(tl.maximum(l_i, 1e-30))  # back from base 2
            tl.store(LSE + heads * WIDTH + s, lse, mask=hmask)

    @triton.jit
    def _merge_kernel(
        OUT,
        LSE,
        LENS,
        RES,
        H: tl.constexpr,
        D: tl.constexpr,
        TILE: tl.constexpr,
        SPLIT_KEYS: tl.constexpr,
        CAP: tl.constexpr,
        WIDTH: tl.constexpr,
        WINDOW: tl.constexpr,
    ):
        h = tl.program_id(0)
        seq_len = tl.load(LENS + h // H)
        span = seq_len
        if WINDOW > 0:
            span = seq_len - tl.maximum(seq_len - WINDOW, 0)
        n = tl.cdiv(span, tl.maximum(SPLIT_KEYS, tl.cdiv(tl.cdiv(span, CAP), TILE) * TILE))  # the split kernel's
        d = tl.arange(0, D)
        m = tl.load(LSE + h * WIDTH, mask=n > 0, other=0.0)
        for s in range(1, n):  # in split order, the row's splits alone: a fixed order whatever the batch
            m = tl.maximum(m, tl.load(LSE + h * WIDTH + s))
        acc = tl.zeros([D], tl.float32)
        total = tl.sum(acc, 0)  # (0.0, a scalar of the loop's type)
        for s in range(0, n):
            w = tl.exp(tl.load(LSE + h * WIDTH + s) - m)
            acc += w * tl.load(OUT + (h * WIDTH + s) * D + d)
            total += w
        tl.store(RES + h * D + d, acc / tl.maximum(total, 1e-30))


def paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    programs: int | None = None,
    tile: int | None = None,
    window: int = 0,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (batch, heads, head_dim) -> (batch, heads, head_dim), q's dtype: one query token per sequence; written into
    ``out`` where given (contiguous, q's shape and dtype: a forward's output whose first rows these are).

    A row's keys are cut into splits of ``SPLIT_KEYS`` (more where a row has more than ``MAX_SPLITS`` of them:
    then ``MAX_SPLITS`` equal ones, a tile's multiple), merged by their log-sum-exp in a fixed order: what a row
    gets depends on its own keys alone, never on the batch around it, so a position verified beside its drafts
    gets the bits a decode of it gets (docs/gpu.md). ``programs`` (how many programs share a row's splits, each
    taking every ``programs``-th): the occupancy knob, changing no result; by default about eight programs a
    multiprocessor (``auto_programs``: a function of the shapes alone, so a CUDA graph captures it). ``tile``
    (keys a loop step, dividing ``SPLIT_KEYS``): by default ``_program``'s."""
    if triton is None:
        raise RuntimeError("the Triton decode kernel needs triton and a CUDA device")
    B, H, D = q.shape
    _, bs, kvh, _ = k_pages.shape
    G = H // kvh
    prog = _program(q.dtype, k_pages.element_size(), G, D, tile)
    keys = int(prog["TILE"])  # type: ignore[call-overload]
    if SPLIT_KEYS % keys:
        raise ValueError(f"a tile of {keys} keys does not divide a split's {SPLIT_KEYS}")
    width = split_width(block_table.shape[1] * bs)
    programs = min(width, programs or auto_programs(B, kvh, q.device))
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    parts = torch.empty((B, H, width, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, H, width), dtype=torch.float32, device=q.device)
    _split_kernel[(B, kvh, programs)](
        q.contiguous(),
        k_pages,
        v_pages,
        block_table,
        seq_lens,
        parts,
        lse,
        scale * kv_scales[0] * LOG2E,
        block_table.stride(0),
        k_pages.stride(0),  # a block's stride: the whole page where a hybrid pool keeps K and V side by side
        kv_scales[1],
        KVH=kvh,
        G=G,
        D=D,
        BS=bs,
        SPLIT_KEYS=SPLIT_KEYS,
        CAP=MAX_SPLITS,
        WIDTH=width,
        PROGRAMS=programs,
        WINDOW=window,
        FP8_PAGES=k_pages.dtype in FP8,
        **prog,
    )
    res = _output(q, out)
    _merge_kernel[(B * H,)](
        parts,
        lse,
        seq_lens,
        res,
        H=H,
        D=D,
        TILE=keys,
        SPLIT_KEYS=SPLIT_KEYS,
        CAP=MAX_SPLITS,
        WIDTH=width,
        WINDOW=window,
    )
    return res


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where a kernel writes its result, in q's dtype (its float32 values rounded to nearest even as it stores them,
    what ``.to`` would do): ``out``, checked, or a new tensor of q's shape."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous, {tuple(q.shape)} {q.dtype}; got {tuple(out.shape)} {out.dtype}")
    return out


def split_width(keys: int) -> int:
    """The most splits a row of at most ``keys`` keys is cut into (the partials' buffer width)."""
    return max(1, min(MAX_SPLITS, -(-keys // SPLIT_KEYS)))


@functools.cache
def _program(q_dtype: torch.dtype, page_bytes: int, G: int, D: int, tile: int | None) -> dict[str, object]:
    """The split kernel's program. 16-bit math (bf16/fp16 queries, fp8 pages widened to fp16): one warp, the
    query rows padded only to a power of two (tl.dot pads them for the tensor cores), so a tile's softmax needs no
    cross-warp reduction (on the H200 fp8 pages at 0.9 of their floor against 0.5 with four warps and 16 rows:
    bench/RESULTS.md), 8 KB of K a tile. fp32 queries (IEEE dots): four warps over 16 rows and 64 keys (one warp's
    registers do not hold an fp32 tile)."""
    if q_dtype != torch.float32:
        return {
            "GP": triton.next_power_of_2(G),
            "TILE": tile or max(16, min(64, 8192 // (D * page_bytes))),
            "PRECISION": "tf32",
            "num_warps": 1,
            "num_stages": 2,
        }
    return {
        "GP": max(16, triton.next_power_of_2(G)),
        "TILE": tile or 64,
        "PRECISION": "ieee",
        "num_warps": 4,
        "num_stages": 3,
    }


MIN_PROGRAMS = 4  # programs a row at least: a long row's splits never queue on one program beside short rows


def auto_programs(batch: int, kv_heads: int, device: torch.device) -> int:
    """Programs a row for about eight one-warp programs a multiprocessor (the measured sweet spot on the H200 at
    8 x 32k and 64 x 4096: bench/RESULTS.md), from ``MIN_PROGRAMS`` to ``MAX_SPLITS``. A large batch still gets
    ``MIN_PROGRAMS``: its rows are of mixed lengths, and one program a row would walk a long row's splits one after
    another while the short rows' programs sit done (H100, 256 rows of 14-1,130 keys at Llama-8B's heads: 142.7 us
    with one program a row, 117.6 with four, 117.4 with eight; the same bits). A row's programs past its splits
    exit at once. A power of two: the count is a constant of the compiled kernel, so the few there are all compile
    when the graphs are captured, and an eager call of any batch (decode rows riding in a prompt's forward,
    ``attention.base.decode_lead``) finds its program built (on the H100 a batch's own count compiled mid-serving:
    TTFT p99 1.6 s at Llama-8B under arrivals)."""
    share = 8 * _multiprocessors(device.index) // (batch * kv_heads)
    return max(MIN_PROGRAMS, min(MAX_SPLITS, 1 << (share.bit_length() - 1) if share else 0))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    return int(
        torch.cuda.get_device_properties(
            index if index is not None else torch.cuda.current_device()
        ).multi_processor_count
    )


if triton is not None:

    @triton.jit(do_not_specialize=["row0"])
    def _varlen_kernel(
        Q,
        K,
        V,
        OUT,
        TABLE,
        CU_Q,
        KV_LENS,
        row0,
        scale,
        stride_tb,
        stride_kb,
        v_scale,
        FP8_PAGES: tl.constexpr,
        H: tl.constexpr,
        KVH: tl.constexpr,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BS: tl.constexpr,
        BM: tl.constexpr,
        TILE: tl.constexpr,
        CAUSAL: tl.constexpr,
        WINDOW: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        r = tl.program_id(0) + row0
        kvh = tl.program_id(1)
        mt = tl.program_id(2)
        q0 = tl.load(CU_Q + r)
        qlen = tl.load(CU_Q + r + 1) - q0
        kv_len = tl.load(KV_LENS + r)
        if mt * BM < qlen:
            m = tl.arange(0, BM * GP)
            tok = mt * BM + m // GP
            g = m % GP
            rowmask = (tok < qlen) & (g < G)
            pos = kv_len - qlen + tok  # bottom-right aligned: the last query sits at kv_len - 1
            d = tl.arange(0, D)
            qptr = Q + ((q0 + tok) * H + kvh * G + g)[:, None] * D + d[None, :]
            q = tl.load(qptr, mask=rowmask[:, None], other=0.0)
            m_i = tl.full([BM * GP], float("-inf"), tl.float32)
            l_i = tl.zeros([BM * GP], tl.float32)
            acc = tl.zeros([BM * GP, D], tl.float32)
            first_q = kv_len - qlen + mt * BM
            lo = 0
            if WINDOW > 0:
                lo = tl.maximum(first_q - WINDOW + 1, 0) // TILE * TILE
            hi = kv_len
            if CAUSAL:
                hi = tl.minimum(kv_len, first_q + BM)
            t = tl.arange(0, TILE)
            for off in range(lo, hi, TILE):
                key = off + t
                valid = key < hi
                blk = tl.load(TABLE + r * stride_tb + key // BS, mask=valid, other=0)
                at = blk.to(tl.int64) * stride_kb + ((key % BS) * KVH + kvh) * D
                k = tl.load(K + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                v = tl.load(V + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                if FP8_PAGES:  # fp8 pages: widened in registers; K's scale is in ``scale``, V's applied at the store
                    k = k.to(q.dtype)
                    v = v.to(q.dtype)
                qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
                ok = valid[None, :]
                if CAUSAL:
                    ok = ok & (key[None, :] <= pos[:, None])
                if WINDOW > 0:
                    ok = ok & (key[None, :] > pos[:, None] - WINDOW)
                qk = tl.where(ok, qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(qk - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
                m_i = m_new
            out = acc / tl.maximum(l_i, 1e-30)[:, None] * v_scale
            tl.store(OUT + ((q0 + tok) * H + kvh * G + g)[:, None] * D + d[None, :], out, mask=rowmask[:, None])


def paged_varlen(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    max_seqlen_q: int,
    *,
    causal: bool,
    scale: float,
    window: int = 0,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    first_row: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn varlen semantics over pages: q (tokens, heads, d) -> the same, q's dtype (into ``out`` where given);
    row r's queries are the last ``q_len`` positions of its ``kv_lens[r]`` keys (bottom-right aligned causal), or
    see them all. ``first_row``: the rows before it are not computed (their outputs' places left as they are: the
    decode rows riding in front, which the decode kernel writes there); a value the kernel does not specialise on,
    so no count of them compiles it again."""
    if triton is None:
        raise RuntimeError("the Triton kernels need triton and a CUDA device")
    T, H, D = q.shape
    _, bs, kvh, _ = k_pages.shape
    G = H // kvh
    GP = triton.next_power_of_2(G)
    BM = max(1, 64 // GP)
    out = _output(q, out)
    rows = cu_seqlens_q.numel() - 1 - first_row
    _varlen_kernel[(rows, kvh, triton.cdiv(max_seqlen_q, BM))](
        q.contiguous(),
        k_pages,
        v_pages,
        out,
        block_table,
        cu_seqlens_q.to(torch.int32),
        kv_lens.to(torch.int32),
        first_row,
        scale * kv_scales[0],
        block_table.stride(0),
        k_pages.stride(0),
        kv_scales[1],
        FP8_PAGES=k_pages.dtype in FP8,
        H=H,
        KVH=kvh,
        G=G,
        GP=GP,
        D=D,
        BS=bs,
        BM=BM,
        TILE=32,
        CAUSAL=causal,
        WINDOW=window,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    return out


if triton is not None:

    @triton.jit
    def _kv_write_kernel(K, V, KC, VC, SLOTS, stride_kb, W: tl.constexpr, BW: tl.constexpr, BS: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t).to(tl.int64)
        i = tl.arange(0, BW)
        m = i < W
        at = (slot // BS) * stride_kb + (slot % BS) * W  # (a hybrid pool's blocks are a whole page apart)
        tl.store(KC + at + i, tl.load(K + t * W + i, mask=m), mask=m)
        tl.store(VC + at + i, tl.load(V + t * W + i, mask=m), mask=m)


def kv_write(
    k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor
) -> None:
    """The slot-mapping K/V write as one kernel: token t's (kv_heads, head_dim) goes to slot ``slots[t]``."""
    if triton is None:
        raise RuntimeError("the Triton kernels need triton and a CUDA device")
    T = k.shape[0]
    W = k[0].numel()
    if T:
        _kv_write_kernel[(T,)](
            k.contiguous().to(k_pages.dtype),
            v.contiguous().to(v_pages.dtype),
            k_pages,
            v_pages,
            slots,
            k_pages.stride(0),
            W=W,
            BW=triton.next_power_of_2(W),
            BS=k_pages.shape[1],
        )
