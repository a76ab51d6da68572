"""Scatter requests' token histories into the expected-token pool, int32 ``[rows,
max_context_len]`` (docs/architecture.md, "Token-id scatter"; shapes: the launchers).

``launch_scatter_req_token_ids_kernel``: request r's tokens ``flat_in[offsets[r]:offsets[r +
1]]`` go to row ``req_pool_indices[r]`` from column ``dst_starts[r]`` (default 0); tokens past
the pool's width are dropped, rows not named untouched. Runs outside CUDA graphs (its inputs
are fresh per forward). ``launch_scatter_packed_token_ids_kernel`` (the runtime's): the same
from one int64 buffer laid out as ``consts.PACKED_TOKENS_*`` say, plus the plan's valid lengths;
its request count is read on the device, so one launch captured for a graph's padded batch
serves every batch the graph replays. Both allocation- and sync-free; grid ``(bs, splits)`` (a
request's programs stride over its tokens). ``*_torch_reference`` validates, then calls
``run_*``, the launchers' CPU path.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary import validation
from sglang.jit_kernel.kv_canary._launch import grid_size, use_triton
from sglang.jit_kernel.kv_canary.consts import (
    PACKED_TOKENS_HEADER,
    PACKED_TOKENS_NUM_REQS,
    PACKED_TOKENS_ROW_FIELDS,
    PACKED_TOKENS_ROW_LEN,
    PACKED_TOKENS_ROW_OFFSET,
    PACKED_TOKENS_ROW_START,
)


@triton.jit
def _scatter_req_token_ids_kernel(
    flat_ptr,
    num_flat,
    offsets_ptr,
    rpi_ptr,
    starts_ptr,
    pool_ptr,
    pool_rows,
    pool_cols,
    HAS_STARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    start = tl.load(offsets_ptr + r)
    end = tl.minimum(tl.load(offsets_ptr + r + 1), num_flat)
    rp = tl.load(rpi_ptr + r)
    if HAS_STARTS:
        dst0 = tl.load(starts_ptr + r)
    else:
        dst0 = 0
    if (rp >= 0) & (rp < pool_rows) & (dst0 >= 0):
        n = tl.minimum(end - start, pool_cols - dst0)
        for pos0 in range(split * BLOCK, n, nsplit * BLOCK):
            pos = pos0 + tl.arange(0, BLOCK)
            m = (pos < n) & (start + pos >= 0)
            tok = tl.load(flat_ptr + start + pos, mask=m, other=0)
            tl.store(pool_ptr + rp * pool_cols + dst0 + pos, tok.to(tl.int32), mask=m)


@triton.jit
def _scatter_packed_token_ids_kernel(
    packed_ptr,
    packed_numel,
    rpi_ptr,
    pool_ptr,
    pool_rows,
    pool_cols,
    lens_ptr,
    NUM_REQS: tl.constexpr,
    HEADER: tl.constexpr,
    ROW_FIELDS: tl.constexpr,
    ROW_LEN: tl.constexpr,
    ROW_START: tl.constexpr,
    ROW_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    n = tl.load(packed_ptr + NUM_REQS)
    if r < n:
        row = packed_ptr + HEADER + r * ROW_FIELDS
        length = tl.load(row + ROW_LEN)
        dst0 = tl.load(row + ROW_START)
        src0 = HEADER + n * ROW_FIELDS + tl.load(row + ROW_OFFSET)
        if split == 0:
            tl.store(lens_ptr + r, length)
        rp = tl.load(rpi_ptr + r)
        if (rp >= 0) & (rp < pool_rows) & (dst0 >= 0) & (src0 >= 0):
            cnt = tl.minimum(tl.minimum(length, pool_cols) - dst0, packed_numel - src0)
            for pos0 in range(split * BLOCK, cnt, nsplit * BLOCK):
                pos = pos0 + tl.arange(0, BLOCK)
                m = pos < cnt
                tok = tl.load(packed_ptr + src0 + pos, mask=m, other=0)
                tl.store(pool_ptr + rp * pool_cols + dst0 + pos, tok.to(tl.int32), mask=m)
    elif split == 0:
        tl.store(lens_ptr + r, 0)


SCATTER_BLOCK = 256
SCATTER_MAX_SPLITS = 64


def launch_scatter_packed_token_ids_kernel(
    *,
    packed: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    valid_lens_out: torch.Tensor,
) -> None:
    """``packed`` int64 ``[>= consts.packed_tokens_numel(bs, 0)]`` (layout: ``consts``, its
    request count n read on the device), ``req_pool_indices`` int64 ``[bs]`` (the rows this
    launch covers, e.g. a CUDA graph's padded batch), ``pool_out`` int32 ``[rows,
    max_context_len]``, ``valid_lens_out`` int64 ``[bs]``. For request r < min(n, bs):
    ``valid_lens_out[r]`` = its whole length, and its segment lands at
    ``pool_out[req_pool_indices[r], start_r + j]`` for ``start_r + j`` below both its length
    and the pool's width (reads stop at the buffer's end; rows outside the pool and negative
    starts are skipped). ``valid_lens_out[n:bs]`` = 0. Allocation- and sync-free (capturable);
    ``bs`` = 0 is a no-op."""
    validation.validate_packed_scatter_args(packed, req_pool_indices, pool_out, valid_lens_out)
    if not use_triton(pool_out.device):
        return run_scatter_packed_token_ids_reference(
            packed=packed,
            req_pool_indices=req_pool_indices,
            pool_out=pool_out,
            valid_lens_out=valid_lens_out,
        )
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    splits = max(1, min(SCATTER_MAX_SPLITS, grid_size(pool_out.device, 1 << 30, 1) // bs))
    _scatter_packed_token_ids_kernel[(bs, splits)](
        packed,
        packed.shape[0],
        req_pool_indices,
        pool_out,
        pool_out.shape[0],
        pool_out.shape[1],
        valid_lens_out,
        NUM_REQS=PACKED_TOKENS_NUM_REQS,
        HEADER=PACKED_TOKENS_HEADER,
        ROW_FIELDS=PACKED_TOKENS_ROW_FIELDS,
        ROW_LEN=PACKED_TOKENS_ROW_LEN,
        ROW_START=PACKED_TOKENS_ROW_START,
        ROW_OFFSET=PACKED_TOKENS_ROW_OFFSET,
        BLOCK=SCATTER_BLOCK,
    )


def scatter_packed_token_ids_torch_reference(
    *,
    packed: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    valid_lens_out: torch.Tensor,
) -> None:
    """Vectorised torch twin of :func:`launch_scatter_packed_token_ids_kernel`: validate the
    arguments, then :func:`run_scatter_packed_token_ids_reference`."""
    validation.validate_packed_scatter_args(packed, req_pool_indices, pool_out, valid_lens_out)
    run_scatter_packed_token_ids_reference(
        packed=packed,
        req_pool_indices=req_pool_indices,
        pool_out=pool_out,
        valid_lens_out=valid_lens_out,
    )


def run_scatter_packed_token_ids_reference(
    *,
    packed: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    valid_lens_out: torch.Tensor,
) -> None:
    """The packed scatter reference on already validated arguments (the launcher's CPU path;
    reads the request count on the host)."""
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    n_all = int(packed[PACKED_TOKENS_NUM_REQS].item())
    n = max(0, min(n_all, bs))
    rows = packed[PACKED_TOKENS_HEADER : PACKED_TOKENS_HEADER + PACKED_TOKENS_ROW_FIELDS * n]
    rows = rows.view(n, PACKED_TOKENS_ROW_FIELDS)
    length = rows[:, PACKED_TOKENS_ROW_LEN]
    dst0 = rows[:, PACKED_TOKENS_ROW_START]
    src0 = (
        PACKED_TOKENS_HEADER + n_all * PACKED_TOKENS_ROW_FIELDS + rows[:, PACKED_TOKENS_ROW_OFFSET]
    )
    valid_lens_out[:n] = length
    valid_lens_out[n:] = 0
    rpi = req_pool_indices[:n]
    ok = (rpi >= 0) & (rpi < pool_out.shape[0]) & (dst0 >= 0) & (src0 >= 0)
    cnt = torch.minimum(length.clamp(max=pool_out.shape[1]) - dst0, packed.shape[0] - src0)
    cnt = torch.where(ok, cnt.clamp(min=0), 0)
    total = int(cnt.sum().item())
    if total == 0:
        return
    req = torch.repeat_interleave(torch.arange(n, device=packed.device), cnt)
    pos = torch.arange(total, device=packed.device) - (cnt.cumsum(0) - cnt)[req]
    pool_out[rpi[req], dst0[req] + pos] = packed[src0[req] + pos].to(torch.int32)


def launch_scatter_req_token_ids_kernel(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    dst_starts: Optional[torch.Tensor] = None,
) -> None:
    """``flat_in`` int64 ``[total]``, ``offsets`` int64 ``[bs + 1]`` (exclusive prefix sum of
    the per-request segment lengths), ``req_pool_indices`` int64 ``[bs]``, ``pool_out`` int32
    ``[rows, max_context_len]``, ``dst_starts`` optional int64 ``[bs]`` (first column of each
    request's segment; default 0). Tokens past ``pool_out.shape[1]`` are dropped; rows outside
    the pool and negative starts are skipped. Empty batch → no-op."""
    validation.validate_scatter_args(flat_in, offsets, req_pool_indices, pool_out, dst_starts)
    if not use_triton(pool_out.device):
        return run_scatter_req_token_ids_reference(
            flat_in=flat_in,
            offsets=offsets,
            req_pool_indices=req_pool_indices,
            pool_out=pool_out,
            dst_starts=dst_starts,
        )
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    # splits per request: enough programs to fill the GPU at small batch sizes
    splits = max(1, min(SCATTER_MAX_SPLITS, grid_size(pool_out.device, 1 << 30, 1) // bs))
    _scatter_req_token_ids_kernel[(bs, splits)](
        flat_in,
        flat_in.shape[0],
        offsets,
        req_pool_indices,
        dst_starts if dst_starts is not None else offsets,
        pool_out,
        pool_out.shape[0],
        pool_out.shape[1],
        HAS_STARTS=dst_starts is not None,
        BLOCK=SCATTER_BLOCK,
    )


def scatter_req_token_ids_torch_reference(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    dst_starts: Optional[torch.Tensor] = None,
) -> None:
    """Vectorised torch twin of :func:`launch_scatter_req_token_ids_kernel`: validate the
    arguments, then :func:`run_scatter_req_token_ids_reference`."""
    validation.validate_scatter_args(flat_in, offsets, req_pool_indices, pool_out, dst_starts)
    run_scatter_req_token_ids_reference(
        flat_in=flat_in,
        offsets=offsets,
        req_pool_indices=req_pool_indices,
        pool_out=pool_out,
        dst_starts=dst_starts,
    )


def run_scatter_req_token_ids_reference(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    dst_starts: Optional[torch.Tensor] = None,
) -> None:
    """The scatter reference on already validated arguments (the launcher's CPU path)."""
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    start = offsets[:-1]
    end = offsets[1:].clamp(max=flat_in.shape[0])
    dst0 = dst_starts if dst_starts is not None else torch.zeros_like(start)
    rows_ok = (req_pool_indices >= 0) & (req_pool_indices < pool_out.shape[0]) & (dst0 >= 0)
    room = (pool_out.shape[1] - dst0).clamp(min=0)
    length = torch.where(rows_ok, torch.minimum((end - start).clamp(min=0), room), 0)
    total = int(length.sum().item())
    if total == 0:
        return
    req = torch.repeat_interleave(torch.arange(bs, device=flat_in.device), length)
    pos = torch.arange(total, device=flat_in.device) - (length.cumsum(0) - length)[req]
    src = start[req] + pos
    keep = src >= 0
    pool_out[req_pool_indices[req][keep], (dst0[req] + pos)[keep]] = flat_in[src[keep]].to(
        torch.int32
    )
