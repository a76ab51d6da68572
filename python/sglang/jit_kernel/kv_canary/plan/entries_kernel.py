"""Plan stage 2 (grid-stride): one verify entry per (request, position in its window).

Each entry index finds its request by binary search over the stage-1 offsets, so the work is
balanced whatever the mix of context lengths. Writes nothing when stage 1 flagged an overflow.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary._kernel_consts import NO_EXPECTED_TOKEN, NO_PREV_SLOT
from sglang.jit_kernel.kv_canary.plan.utils import lane_column, translate_slots


@triton.jit
def plan_entries_kernel(
    verify_offsets_ptr,
    bs,
    search_steps,
    rpi_ptr,
    prefix_ptr,
    r2t_ptr,
    r2t_cols,
    lut_ptr,
    lut_len,
    exp_pool_ptr,
    exp_rows,
    exp_cols,
    valid_lens_ptr,
    token_offset,
    num_valid_ptr,
    enable_ptr,
    out_slot_ptr,
    out_tok_ptr,
    out_pos_ptr,
    out_prev_ptr,
    out_row_ptr,
    split_ptr,
    shift_ptr,
    HAS_LUT: tl.constexpr,
    HAS_LANES: tl.constexpr,
    HAS_EXPECTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    enabled = tl.load(enable_ptr) == 1
    n = tl.where(enabled, tl.load(num_valid_ptr), 0).to(tl.int64)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        e = start + tl.arange(0, BLOCK).to(tl.int64)
        m = e < n
        lo = tl.zeros([BLOCK], tl.int64)
        hi = tl.zeros([BLOCK], tl.int64) + bs
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            go = tl.load(verify_offsets_ptr + mid, mask=m, other=0) <= e
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        r = lo
        base = tl.load(verify_offsets_ptr + r, mask=m, other=0)
        cnt = tl.load(verify_offsets_ptr + r + 1, mask=m, other=0) - base
        pl = tl.load(prefix_ptr + r, mask=m, other=0).to(tl.int64)
        pl = tl.minimum(tl.maximum(pl, 0), r2t_cols)
        p = pl - cnt + (e - base)
        rp = tl.load(rpi_ptr + r, mask=m, other=0).to(tl.int64)
        row = r2t_ptr + rp * r2t_cols
        c = p
        prev_c = p - 1
        if HAS_LANES:
            split = tl.load(split_ptr + r, mask=m, other=0)
            shift = tl.load(shift_ptr + r, mask=m, other=0)
            c = lane_column(c, split, shift, r2t_cols)
            prev_c = lane_column(prev_c, split, shift, r2t_cols)
        slot = tl.load(row + c, mask=m, other=0).to(tl.int64)
        slot = translate_slots(lut_ptr, lut_len, slot, m, HAS_LUT)
        has_prev = m & (p > 0)
        prev = tl.load(row + prev_c, mask=has_prev, other=NO_PREV_SLOT).to(tl.int64)
        prev = translate_slots(lut_ptr, lut_len, prev, has_prev, HAS_LUT)
        prev = tl.where(has_prev, prev, NO_PREV_SLOT)
        if HAS_EXPECTED:
            idx = p + token_offset
            vl = tl.load(valid_lens_ptr + r, mask=m, other=0).to(tl.int64)
            ok = m & (idx >= 0) & (idx < vl) & (idx < exp_cols) & (rp < exp_rows)
            tok = tl.load(exp_pool_ptr + rp * exp_cols + idx, mask=ok, other=NO_EXPECTED_TOKEN).to(
                tl.int64
            )
        else:
            tok = tl.full([BLOCK], NO_EXPECTED_TOKEN, tl.int64)
        tl.store(out_slot_ptr + e, slot, mask=m)
        tl.store(out_tok_ptr + e, tok, mask=m)
        tl.store(out_pos_ptr + e, p, mask=m)
        tl.store(out_prev_ptr + e, prev, mask=m)
        tl.store(out_row_ptr + e, rp, mask=m)
