"""Allocation of canary record buffers."""

from __future__ import annotations

import torch

from sglang.jit_kernel.kv_canary.types import CANARY_SLOT_BYTES


def allocate_canary_buffer(num_slots: int, device) -> torch.Tensor:
    """A zeroed uint8 ``[num_slots, 32]`` record buffer (one row per KV slot, slot 0 = padding)."""
    if num_slots < 1:
        raise ValueError(f"a canary buffer needs at least one slot, got num_slots={num_slots}")
    return torch.zeros(num_slots, CANARY_SLOT_BYTES, dtype=torch.uint8, device=device)
