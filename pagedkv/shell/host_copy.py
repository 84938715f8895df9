"""The host tier's device-side gather (``shell.host_pages``' stores), a Triton kernel: a store batch's blocks read
out of every layer's pages, seen block first, into device staging whose slots' bytes are contiguous. The forward
waits for this read (a store must read its block before anything overwrites it), so it runs at device speed: each
program copies a contiguous run of one page, as 32-bit words. (An ``index_select`` of the pages seen block first,
the copy it replaces, reads at ~640 GB/s on an H100.) CUDA only; imported where a store runs on CUDA (it loads
Triton), and in Triton's interpreter on the CPU where ``TRITON_INTERPRET=1`` is set, as the tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # 32-bit words a program copies (8 KiB)


@triton.jit
def _gather_kernel(SRC, DST, AT, stride_l, stride_b, LAYERS, WORDS, BLOCK: tl.constexpr):
    page = tl.program_id(0).to(tl.int64)  # (block i, layer l) of the staging: i * LAYERS + l
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = cols < WORDS
    i, layer = page // LAYERS, page % LAYERS
    b = tl.load(AT + i).to(tl.int64)
    x = tl.load(SRC + layer * stride_l + b * stride_b + cols, mask=m)
    tl.store(DST + page * WORDS + cols, x, mask=m)


def gather_pages(pages: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``pages[:, at]`` seen block first: ``(len(at), layers, *page)``, contiguous, what
    ``pages.transpose(0, 1).index_select(0, at)`` gives. ``pages``: ``(layers, blocks, *page)`` with each layer's
    blocks contiguous; ``at``: block ids (int64) on its device."""
    layers, blocks = pages.shape[0], pages.shape[1]
    page = pages.shape[2:]
    flat = pages.reshape(layers, blocks, -1)
    if flat.stride(2) != 1 or flat.stride(1) != flat.shape[2]:
        raise ValueError("gather_pages needs each layer's pages contiguous")
    nbytes = flat.shape[2] * flat.element_size()
    words = flat.view(torch.uint8).view(torch.int32) if nbytes % 4 == 0 else flat.view(torch.uint8)
    out = torch.empty((len(at), layers, words.shape[2]), dtype=words.dtype, device=pages.device)
    if len(at):
        grid = (len(at) * layers, triton.cdiv(words.shape[2], BLOCK))
        _gather_kernel[grid](words, out, at, words.stride(0), words.stride(1), layers, words.shape[2], BLOCK=BLOCK)
    return out.view(torch.uint8).view(pages.dtype).view(len(at), layers, *page)
