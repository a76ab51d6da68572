"""Scatter requests' token histories into the expected-token pool (SPEC §7).

For every t in ``[0, offsets[bs])`` owned by request r at ``pos = t - offsets[r]``:
``pool_out[req_pool_indices[r], pos] = int32(flat_in[t])`` when ``pos < pool_out.shape[1]``.
Rows not named are untouched. Grid ``(bs, splits)``: the programs of a request stride over
its tokens, so any batch size works in one launch and long histories are split. Runs outside CUDA graphs (its inputs are fresh per forward),
but is itself allocation- and sync-free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary._launch import check_tensor, grid_size, same_device, use_triton


@triton.jit
def _scatter_req_token_ids_kernel(
    flat_ptr, num_flat, offsets_ptr, rpi_ptr, pool_ptr, pool_rows, pool_cols,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    start = tl.load(offsets_ptr + r)
    end = tl.minimum(tl.load(offsets_ptr + r + 1), num_flat)
    rp = tl.load(rpi_ptr + r)
    if (rp >= 0) & (rp < pool_rows):
        n = tl.minimum(end - start, pool_cols)
        for pos0 in range(split * BLOCK, n, nsplit * BLOCK):
            pos = pos0 + tl.arange(0, BLOCK)
            m = (pos < n) & (start + pos >= 0)
            tok = tl.load(flat_ptr + start + pos, mask=m, other=0)
            tl.store(pool_ptr + rp * pool_cols + pos, tok.to(tl.int32), mask=m)


SCATTER_BLOCK = 256
SCATTER_MAX_SPLITS = 64


def _validate(flat_in, offsets, req_pool_indices, pool_out) -> None:
    check_tensor("flat_in", flat_in, dtypes=(torch.int64,), ndim=1)
    bs = check_tensor("req_pool_indices", req_pool_indices, dtypes=(torch.int64,),
                      ndim=1).shape[0]
    check_tensor("offsets", offsets, dtypes=(torch.int64,), shape=(bs + 1,))
    check_tensor("pool_out", pool_out, dtypes=(torch.int32,), ndim=2)
    same_device({"flat_in": flat_in, "offsets": offsets, "req_pool_indices": req_pool_indices,
                 "pool_out": pool_out})


def launch_scatter_req_token_ids_kernel(
    *, flat_in: torch.Tensor, offsets: torch.Tensor, req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
) -> None:
    """``flat_in`` int64 ``[total]``, ``offsets`` int64 ``[bs + 1]`` (exclusive prefix sum of
    the per-request lengths), ``req_pool_indices`` int64 ``[bs]``, ``pool_out`` int32
    ``[rows, max_context_len]``. Tokens past ``pool_out.shape[1]`` are dropped; rows outside the
    pool are skipped. Empty batch → no-op."""
    _validate(flat_in, offsets, req_pool_indices, pool_out)
    if not use_triton(pool_out.device):
        return scatter_req_token_ids_torch_reference(
            flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices, pool_out=pool_out
        )
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    # splits per request: enough programs to fill the GPU at small batch sizes
    splits = max(1, min(SCATTER_MAX_SPLITS, grid_size(pool_out.device, 1 << 30, 1) // bs))
    _scatter_req_token_ids_kernel[(bs, splits)](
        flat_in, flat_in.shape[0], offsets, req_pool_indices, pool_out,
        pool_out.shape[0], pool_out.shape[1], BLOCK=SCATTER_BLOCK,
    )


def scatter_req_token_ids_torch_reference(
    *, flat_in: torch.Tensor, offsets: torch.Tensor, req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
) -> None:
    """Vectorised torch twin of :func:`launch_scatter_req_token_ids_kernel`."""
    _validate(flat_in, offsets, req_pool_indices, pool_out)
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    start = offsets[:-1]
    end = offsets[1:].clamp(max=flat_in.shape[0])
    rows_ok = (req_pool_indices >= 0) & (req_pool_indices < pool_out.shape[0])
    length = torch.where(rows_ok, (end - start).clamp(0, pool_out.shape[1]), 0)
    total = int(length.sum().item())
    if total == 0:
        return
    req = torch.repeat_interleave(torch.arange(bs, device=flat_in.device), length)
    pos = torch.arange(total, device=flat_in.device) - (length.cumsum(0) - length)[req]
    src = start[req] + pos
    keep = src >= 0
    pool_out[req_pool_indices[req][keep], pos[keep]] = flat_in[src[keep]].to(torch.int32)
