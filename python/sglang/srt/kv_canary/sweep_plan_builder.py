"""Turn a radix-cache walk into verify-plan chunks for the sweep (docs/subsystems.md, "Radix
sweep")."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.jit_kernel.kv_canary.consts import NO_EXPECTED_TOKEN, NO_REQ_TO_TOKEN_ROW
from sglang.jit_kernel.kv_canary.types import VerifyPlan
from sglang.srt.kv_canary.radix_cache_walker import RadixCacheWalkResult


def translate_for_swa(lut: Optional[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """FULL → SWA slots through ``lut``; -1 stays -1, evicted slots map to 0 (skipped)."""
    if lut is None:
        return slots
    return torch.where(slots < 0, slots, lut[slots.clamp(min=0)].to(torch.int64))


def build_verify_plan_radix_sweep(
    *,
    walk: RadixCacheWalkResult,
    plan_out: VerifyPlan,
    start: int = 0,
    swa_index_lut: Optional[torch.Tensor] = None,
) -> int:
    """Fill ``plan_out`` (reused across passes) with walk entries ``[start, start + k)``,
    ``k = min(capacity, remaining)``; returns ``k``. Expected tokens are -1 (the sweep checks
    chain, position and real-KV fingerprint); ``req_to_token`` rows are -1 (a cached slot is
    read through the radix tree, not a request). The caller loops over chunks."""
    if start < 0 or start > walk.num_slots:
        raise ValueError(f"start={start} out of range for a walk of {walk.num_slots} slots")
    k = min(plan_out.capacity, walk.num_slots - start)
    end = start + k
    plan_out.verify_slot_indices[:k].copy_(
        translate_for_swa(swa_index_lut, walk.slot_indices[start:end])
    )
    plan_out.verify_prev_slot_indices[:k].copy_(
        translate_for_swa(swa_index_lut, walk.prev_slot_indices[start:end])
    )
    plan_out.verify_expected_positions[:k].copy_(walk.positions[start:end])
    plan_out.verify_expected_tokens[:k].fill_(NO_EXPECTED_TOKEN)
    plan_out.verify_req_to_token_rows[:k].fill_(NO_REQ_TO_TOKEN_ROW)  # no request reads it
    plan_out.verify_num_valid.fill_(k)
    plan_out.enable.fill_(1)
    return k
