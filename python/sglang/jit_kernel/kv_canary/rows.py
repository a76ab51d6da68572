"""Row copy between a device buffer and its host-tier mirror (HiCache; docs/subsystems.md,
"HiCache").

``launch_copy_rows`` copies ``dst[dst_indices[i]] = src[src_indices[i]]`` for whole rows of
int64 words. On CUDA one side may be pinned host memory: the Triton kernel reads or writes it
through unified addressing, on the stream it is launched on (HiCache's write or load stream),
so the copy is ordered with sglang's own KV copy on that stream and the host never waits. On
CPU tensors the torch reference runs (the Triton kernel, interpreted, under
``TRITON_INTERPRET=1``). Not for CUDA-graph capture (HiCache copies never are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary import validation
from sglang.jit_kernel.kv_canary._launch import grid_size, use_triton

__all__ = ["launch_copy_rows"]


@triton.jit
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_idx_ptr,
    dst_idx_ptr,
    n,
    src_rows,
    dst_rows,
    ROW_WORDS,
    WBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    words = tl.arange(0, WBLOCK)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        i = start + tl.arange(0, BLOCK)
        m = i < n
        s = tl.load(src_idx_ptr + i, mask=m, other=-1).to(tl.int64)
        d = tl.load(dst_idx_ptr + i, mask=m, other=-1).to(tl.int64)
        ok = m & (s >= 0) & (s < src_rows) & (d >= 0) & (d < dst_rows)
        mask2 = ok[:, None] & (words[None, :] < ROW_WORDS)
        row = tl.load(src_ptr + s[:, None] * ROW_WORDS + words[None, :], mask=mask2, other=0)
        tl.store(dst_ptr + d[:, None] * ROW_WORDS + words[None, :], row, mask=mask2)


COPY_ROWS_BLOCK = 64


def launch_copy_rows(
    *, src: torch.Tensor, dst: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor
) -> None:
    """``dst[dst_indices[i]] = src[src_indices[i]]`` for every i (rows of int64 words, the
    same width; an index out of its tensor's rows skips the pair). ``src`` / ``dst``: int64
    ``[rows, W]`` contiguous; on CUDA, one of them may be a pinned host
    tensor (the other is the device). Indices: int32/int64 ``[n]`` on the CPU or the device
    (moved to the device when needed)."""
    validation.validate_copy_rows_args(src, dst, src_indices, dst_indices)
    device = src.device if src.is_cuda else dst.device
    if not use_triton(device):
        s = src_indices.to(torch.int64)
        d = dst_indices.to(torch.int64)
        ok = (s >= 0) & (s < src.shape[0]) & (d >= 0) & (d < dst.shape[0])
        dst[d[ok]] = src[s[ok]]
        return
    n = src_indices.shape[0]
    if n == 0:
        return
    src_idx = src_indices.to(device, non_blocking=True)
    dst_idx = dst_indices.to(device, non_blocking=True)
    grid = (grid_size(device, n, COPY_ROWS_BLOCK),)
    _copy_rows_kernel[grid](
        src,
        dst,
        src_idx,
        dst_idx,
        n,
        src.shape[0],
        dst.shape[0],
        src.shape[1],
        WBLOCK=triton.next_power_of_2(src.shape[1]),
        BLOCK=COPY_ROWS_BLOCK,
    )
