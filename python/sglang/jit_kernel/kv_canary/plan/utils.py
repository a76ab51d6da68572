"""Helpers shared by the two plan stages and the torch reference: SWA slot translation."""

from __future__ import annotations

from typing import Optional

import torch
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


def translate_slots_torch(lut: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`translate_slots` on an int64 tensor."""
    if lut is None:
        return x
    in_range = (x >= 0) & (x < lut.shape[0])
    y = torch.where(in_range, lut[x.clamp(0, max(lut.shape[0] - 1, 0))].long(), 0) \
        if lut.shape[0] else torch.zeros_like(x)
    return torch.where(x < 0, x, y)


def search_steps(bs: int) -> int:
    """Binary-search iterations that locate an entry's request among ``bs`` requests."""
    return max(1, int(bs).bit_length())
