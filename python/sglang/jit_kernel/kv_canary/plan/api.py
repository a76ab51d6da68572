"""``launch_canary_plan_kernels``: fill a VerifyPlan and a WritePlan for one forward
(docs/architecture.md, "Plans")."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.jit_kernel.kv_canary import plan_ref, validation
from sglang.jit_kernel.kv_canary._launch import grid_size, use_triton
from sglang.jit_kernel.kv_canary.plan.entries_kernel import plan_entries_kernel
from sglang.jit_kernel.kv_canary.plan.offsets_kernel import plan_offsets_kernel
from sglang.jit_kernel.kv_canary.plan.utils import search_steps
from sglang.jit_kernel.kv_canary.types import PlanLanes, VerifyPlan, WritePlan

PLAN_OFFSETS_BLOCK = 1024
PLAN_ENTRIES_BLOCK = 512


def launch_canary_plan_kernels(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int,
    full_to_swa_index_mapping: Optional[torch.Tensor],
    verify_capacity: int,
    req_to_verify_expected_tokens: Optional[torch.Tensor],
    req_to_verify_expected_tokens_valid_lens: Optional[torch.Tensor],
    kv_token_id_vs_position_offset: int,
    lanes: Optional[PlanLanes] = None,
) -> None:
    """Fill both plans on the device for a batch of ``bs = req_pool_indices.shape[0]`` rows.

    Inputs are int32/int64: ``req_pool_indices`` / ``prefix_lens`` / ``extend_seq_lens``
    ``[bs]`` (``req_pool_indices == 0`` marks a padding row), ``req_to_token`` ``[rows, ctx]``,
    optional ``full_to_swa_index_mapping`` (required iff ``swa_window_size > 0``), optional
    int32 ``req_to_verify_expected_tokens`` ``[rows, cols]`` with per-request valid lengths.
    Verify entries cover positions ``[max(0, prefix - window), prefix)`` (whole prefix without
    a window); each entry and each request also records its ``req_to_token`` row (for the
    report). On overflow of ``verify_capacity`` the plan is disabled (``enable = 0``).
    With ``lanes`` (:class:`PlanLanes`: a draft round's lanes, topk > 1) a row verifies from
    its ``verify_from`` and reads position p (its entries, predecessors and seed) at its
    shifted column. Two launches (offsets, then entries); graph-safe on CUDA. Out-of-range indices in the data
    are clamped or treated as padding, never dereferenced.
    """
    kwargs = dict(
        verify_plan_out=verify_plan_out,
        write_plan_out=write_plan_out,
        req_pool_indices=req_pool_indices,
        prefix_lens=prefix_lens,
        extend_seq_lens=extend_seq_lens,
        req_to_token=req_to_token,
        swa_window_size=swa_window_size,
        full_to_swa_index_mapping=full_to_swa_index_mapping,
        verify_capacity=verify_capacity,
        req_to_verify_expected_tokens=req_to_verify_expected_tokens,
        req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
        lanes=lanes,
    )
    validation.validate_plan_args(**kwargs)
    if not use_triton(req_to_token.device):
        return plan_ref.run_canary_plan_reference(**kwargs)

    bs = req_pool_indices.shape[0]
    rows, cols = req_to_token.shape
    lut = full_to_swa_index_mapping
    has_lut = lut is not None
    has_expected = req_to_verify_expected_tokens is not None
    vp, wp = verify_plan_out, write_plan_out
    # never dereferenced without lanes: HAS_LANES is a constexpr
    lane_args = (
        (lanes.verify_from, lanes.branch_split, lanes.branch_shift)
        if lanes is not None
        else (prefix_lens, prefix_lens, prefix_lens)
    )
    plan_offsets_kernel[(1,)](
        req_pool_indices,
        prefix_lens,
        extend_seq_lens,
        bs,
        req_to_token,
        rows,
        cols,
        lut if has_lut else req_to_token,
        lut.shape[0] if has_lut else 0,
        swa_window_size,
        verify_capacity,
        wp.verify_req_offsets,
        wp.write_offsets,
        wp.write_seed_slot_indices,
        wp.write_req_to_token_rows,
        wp.req_capacity,
        wp.write_num_valid_reqs,
        vp.verify_num_valid,
        vp.enable,
        *lane_args[:3],
        HAS_LUT=has_lut,
        HAS_LANES=lanes is not None,
        BLOCK=PLAN_OFFSETS_BLOCK,
    )
    exp = req_to_verify_expected_tokens
    plan_entries_kernel[(grid_size(req_to_token.device, verify_capacity, PLAN_ENTRIES_BLOCK),)](
        wp.verify_req_offsets,
        bs,
        search_steps(bs),
        req_pool_indices,
        prefix_lens,
        req_to_token,
        cols,
        lut if has_lut else req_to_token,
        lut.shape[0] if has_lut else 0,
        exp if has_expected else req_to_token,
        exp.shape[0] if has_expected else 0,
        exp.shape[1] if has_expected else 0,
        req_to_verify_expected_tokens_valid_lens if has_expected else prefix_lens,
        kv_token_id_vs_position_offset,
        vp.verify_num_valid,
        vp.enable,
        vp.verify_slot_indices,
        vp.verify_expected_tokens,
        vp.verify_expected_positions,
        vp.verify_prev_slot_indices,
        vp.verify_req_to_token_rows,
        *lane_args[1:],
        HAS_LUT=has_lut,
        HAS_LANES=lanes is not None,
        HAS_EXPECTED=has_expected,
        BLOCK=PLAN_ENTRIES_BLOCK,
    )
