"""Plan stage 1 (one program): per-request verify / write offsets, chain seeds, req_to_token
rows, overflow flag.

Walks the batch in blocks of ``BLOCK`` requests carrying running sums, so any batch size works
in one launch (no single-block ceiling).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary._kernel_consts import NO_REQ_TO_TOKEN_ROW, NO_SEED_SLOT
from sglang.jit_kernel.kv_canary.plan.utils import lane_column, translate_slots


@triton.jit
def plan_offsets_kernel(
    rpi_ptr,
    prefix_ptr,
    extend_ptr,
    bs,
    r2t_ptr,
    r2t_rows,
    r2t_cols,
    lut_ptr,
    lut_len,
    window,
    verify_capacity,
    verify_offsets_ptr,
    write_offsets_ptr,
    seeds_ptr,
    rows_out_ptr,
    req_capacity,
    write_num_valid_ptr,
    num_valid_ptr,
    enable_ptr,
    vfrom_ptr,
    split_ptr,
    shift_ptr,
    HAS_LUT: tl.constexpr,
    HAS_LANES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    carry_v = tl.full([], 0, tl.int64)
    carry_w = tl.full([], 0, tl.int64)
    tl.store(verify_offsets_ptr, carry_v)
    tl.store(write_offsets_ptr, carry_w)
    for start in range(0, bs, BLOCK):
        r = start + tl.arange(0, BLOCK)
        m = r < bs
        rp = tl.load(rpi_ptr + r, mask=m, other=0).to(tl.int64)
        live = m & (rp > 0) & (rp < r2t_rows)
        pl = tl.load(prefix_ptr + r, mask=m, other=0).to(tl.int64)
        pl = tl.minimum(tl.maximum(pl, 0), r2t_cols)
        ext = tl.load(extend_ptr + r, mask=m, other=0).to(tl.int64)
        if window > 0:
            ws = tl.maximum(pl - window, 0)
        else:
            ws = tl.zeros_like(pl)
        seed_col = pl - 1
        if HAS_LANES:
            vfrom = tl.load(vfrom_ptr + r, mask=m, other=0)
            ws = tl.maximum(ws, tl.minimum(tl.maximum(vfrom, 0), pl))
            split = tl.load(split_ptr + r, mask=m, other=0)
            shift = tl.load(shift_ptr + r, mask=m, other=0)
            seed_col = lane_column(seed_col, split, shift, r2t_cols)
        vcount = tl.where(live, pl - ws, 0)
        wcount = tl.where(live & (ext > 0), ext, 0)
        tl.store(verify_offsets_ptr + r + 1, tl.cumsum(vcount, axis=0) + carry_v, mask=m)
        tl.store(write_offsets_ptr + r + 1, tl.cumsum(wcount, axis=0) + carry_w, mask=m)
        has_seed = live & (pl > 0)
        seed = tl.load(r2t_ptr + rp * r2t_cols + seed_col, mask=has_seed, other=NO_SEED_SLOT).to(
            tl.int64
        )
        seed = translate_slots(lut_ptr, lut_len, seed, has_seed, HAS_LUT)
        tl.store(seeds_ptr + r, tl.where(has_seed, seed, NO_SEED_SLOT), mask=m)
        tl.store(rows_out_ptr + r, tl.where(live, rp, NO_REQ_TO_TOKEN_ROW), mask=m)
        carry_v += tl.sum(vcount, axis=0)
        carry_w += tl.sum(wcount, axis=0)
    # Beyond the batch: offsets 0, seeds NO_SEED_SLOT, rows NO_REQ_TO_TOKEN_ROW.
    for start in range(bs, req_capacity, BLOCK):
        r = start + tl.arange(0, BLOCK)
        m = r < req_capacity
        tl.store(write_offsets_ptr + r + 1, tl.zeros([BLOCK], tl.int64), mask=m)
        tl.store(verify_offsets_ptr + r + 1, tl.zeros([BLOCK], tl.int64), mask=m)
        tl.store(seeds_ptr + r, tl.full([BLOCK], NO_SEED_SLOT, tl.int64), mask=m)
        tl.store(rows_out_ptr + r, tl.full([BLOCK], NO_REQ_TO_TOKEN_ROW, tl.int64), mask=m)
    enable = carry_v <= verify_capacity
    tl.store(enable_ptr, enable.to(tl.int32))
    tl.store(num_valid_ptr, tl.where(enable, carry_v, verify_capacity).to(tl.int32))
    tl.store(write_num_valid_ptr, bs)
