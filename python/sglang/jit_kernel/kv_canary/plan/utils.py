"""Helpers shared by the two plan stages: SWA slot translation, binary-search depth.

The torch twin of :func:`translate_slots` is ``plan_ref.translate_slots_torch``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def translate_slots(lut_ptr, lut_len, x, mask, HAS_LUT: tl.constexpr):
    """``T(x)``: ``lut[x]`` for ``0 <= x < lut_len``, ``x`` itself for ``x < 0`` (keeps -1),
    0 (skipped, as an evicted slot) for ``x >= lut_len``; identity without a table."""
    if HAS_LUT:
        in_range = mask & (x >= 0) & (x < lut_len)
        y = tl.load(lut_ptr + x, mask=in_range, other=0).to(tl.int64)
        return tl.where(x < 0, x, y)
    else:
        return x


@triton.jit
def lane_column(q, split, shift, cols):
    """The ``req_to_token`` column of position ``q`` in a lane row (``types.PlanLanes``),
    clamped into the row (sglang wrote the lane there, so it is in range)."""
    c = q + tl.where(q >= split, shift, 0)
    return tl.minimum(tl.maximum(c, 0), cols - 1)


def search_steps(bs: int) -> int:
    """Binary-search iterations that locate an entry's request among ``bs`` requests."""
    return max(1, int(bs).bit_length())
