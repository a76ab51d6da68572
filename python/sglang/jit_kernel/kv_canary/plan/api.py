"""``launch_canary_plan_kernels``: fill a VerifyPlan and a WritePlan for one forward (SPEC §4)."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.jit_kernel.kv_canary._launch import (
    INDEX_DTYPES,
    check_int,
    check_tensor,
    grid_size,
    same_device,
    use_triton,
)
from sglang.jit_kernel.kv_canary.plan.entries_kernel import plan_entries_kernel
from sglang.jit_kernel.kv_canary.plan.offsets_kernel import plan_offsets_kernel
from sglang.jit_kernel.kv_canary.plan.utils import search_steps
from sglang.jit_kernel.kv_canary.verify import VerifyPlan
from sglang.jit_kernel.kv_canary.write import WritePlan

PLAN_OFFSETS_BLOCK = 1024
PLAN_ENTRIES_BLOCK = 512


def validate_plan_args(*, verify_plan_out, write_plan_out, req_pool_indices, prefix_lens,
                       extend_seq_lens, req_to_token, swa_window_size, full_to_swa_index_mapping,
                       verify_capacity, req_to_verify_expected_tokens,
                       req_to_verify_expected_tokens_valid_lens,
                       kv_token_id_vs_position_offset) -> None:
    """Host-side checks shared by the launcher and the torch reference (metadata only)."""
    if not isinstance(verify_plan_out, VerifyPlan):
        raise TypeError(f"verify_plan_out must be a VerifyPlan, got {type(verify_plan_out).__name__}")
    if not isinstance(write_plan_out, WritePlan):
        raise TypeError(f"write_plan_out must be a WritePlan, got {type(write_plan_out).__name__}")
    bs = check_tensor("req_pool_indices", req_pool_indices, dtypes=INDEX_DTYPES, ndim=1).shape[0]
    check_tensor("prefix_lens", prefix_lens, dtypes=INDEX_DTYPES, shape=(bs,))
    check_tensor("extend_seq_lens", extend_seq_lens, dtypes=INDEX_DTYPES, shape=(bs,))
    check_tensor("req_to_token", req_to_token, dtypes=INDEX_DTYPES, ndim=2)
    check_int("swa_window_size", swa_window_size, minimum=0)
    if swa_window_size > 0 and full_to_swa_index_mapping is None:
        raise ValueError(
            f"swa_window_size={swa_window_size} needs full_to_swa_index_mapping (the SWA slot table)"
        )
    if swa_window_size == 0 and full_to_swa_index_mapping is not None:
        raise ValueError("full_to_swa_index_mapping is given but swa_window_size is 0: a SWA "
                         "group must pass its window size")
    if full_to_swa_index_mapping is not None:
        check_tensor("full_to_swa_index_mapping", full_to_swa_index_mapping, dtypes=INDEX_DTYPES,
                     ndim=1)
    check_int("verify_capacity", verify_capacity, minimum=0)
    if verify_capacity != verify_plan_out.capacity:
        raise ValueError(f"verify_capacity={verify_capacity} does not match verify_plan_out's "
                         f"capacity {verify_plan_out.capacity}")
    if bs > write_plan_out.req_capacity:
        raise ValueError(f"batch size {bs} (req_pool_indices) exceeds write_plan_out's request "
                         f"capacity {write_plan_out.req_capacity}")
    if req_to_verify_expected_tokens is not None:
        check_tensor("req_to_verify_expected_tokens", req_to_verify_expected_tokens,
                     dtypes=(torch.int32,), ndim=2)
        if req_to_verify_expected_tokens_valid_lens is None:
            raise ValueError("req_to_verify_expected_tokens_valid_lens is required when "
                             "req_to_verify_expected_tokens is given")
        check_tensor("req_to_verify_expected_tokens_valid_lens",
                     req_to_verify_expected_tokens_valid_lens, dtypes=INDEX_DTYPES, shape=(bs,))
    check_int("kv_token_id_vs_position_offset", kv_token_id_vs_position_offset)
    same_device({
        "verify_plan_out": verify_plan_out.verify_slot_indices,
        "write_plan_out": write_plan_out.write_offsets,
        "req_pool_indices": req_pool_indices, "prefix_lens": prefix_lens,
        "extend_seq_lens": extend_seq_lens, "req_to_token": req_to_token,
        "full_to_swa_index_mapping": full_to_swa_index_mapping,
        "req_to_verify_expected_tokens": req_to_verify_expected_tokens,
        "req_to_verify_expected_tokens_valid_lens":
            req_to_verify_expected_tokens_valid_lens if req_to_verify_expected_tokens is not None
            else None,
    })


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
) -> None:
    """Fill both plans on the device for a batch of ``bs = req_pool_indices.shape[0]`` rows.

    Inputs are int32/int64: ``req_pool_indices`` / ``prefix_lens`` / ``extend_seq_lens``
    ``[bs]`` (``req_pool_indices == 0`` marks a padding row), ``req_to_token`` ``[rows, ctx]``,
    optional ``full_to_swa_index_mapping`` (required iff ``swa_window_size > 0``), optional
    int32 ``req_to_verify_expected_tokens`` ``[rows, cols]`` with per-request valid lengths.
    Verify entries cover positions ``[max(0, prefix - window), prefix)`` (whole prefix without
    a window); on overflow of ``verify_capacity`` the plan is disabled (``enable = 0``).
    Two launches (offsets, then entries); graph-safe on CUDA. Out-of-range indices in the data
    are clamped or treated as padding, never dereferenced.
    """
    kwargs = dict(
        verify_plan_out=verify_plan_out, write_plan_out=write_plan_out,
        req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
        extend_seq_lens=extend_seq_lens, req_to_token=req_to_token,
        swa_window_size=swa_window_size, full_to_swa_index_mapping=full_to_swa_index_mapping,
        verify_capacity=verify_capacity, req_to_verify_expected_tokens=req_to_verify_expected_tokens,
        req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
    )
    validate_plan_args(**kwargs)
    if not use_triton(req_to_token.device):
        from sglang.jit_kernel.kv_canary.plan_ref import (
            launch_canary_plan_kernels_torch_reference,
        )

        return launch_canary_plan_kernels_torch_reference(**kwargs)

    bs = req_pool_indices.shape[0]
    rows, cols = req_to_token.shape
    lut = full_to_swa_index_mapping
    has_lut = lut is not None
    has_expected = req_to_verify_expected_tokens is not None
    vp, wp = verify_plan_out, write_plan_out
    plan_offsets_kernel[(1,)](
        req_pool_indices, prefix_lens, extend_seq_lens, bs,
        req_to_token, rows, cols,
        lut if has_lut else req_to_token, lut.shape[0] if has_lut else 0,
        swa_window_size, verify_capacity,
        wp.verify_req_offsets, wp.write_offsets, wp.write_seed_slot_indices, wp.req_capacity,
        wp.write_num_valid_reqs, vp.verify_num_valid, vp.enable,
        HAS_LUT=has_lut,
        BLOCK=PLAN_OFFSETS_BLOCK,
    )
    exp = req_to_verify_expected_tokens
    plan_entries_kernel[(grid_size(req_to_token.device, verify_capacity, PLAN_ENTRIES_BLOCK),)](
        wp.verify_req_offsets, bs, search_steps(bs),
        req_pool_indices, prefix_lens,
        req_to_token, cols,
        lut if has_lut else req_to_token, lut.shape[0] if has_lut else 0,
        exp if has_expected else req_to_token,
        exp.shape[0] if has_expected else 0,
        exp.shape[1] if has_expected else 0,
        req_to_verify_expected_tokens_valid_lens if has_expected else prefix_lens,
        kv_token_id_vs_position_offset,
        vp.verify_num_valid, vp.enable,
        vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
        vp.verify_prev_slot_indices,
        HAS_LUT=has_lut,
        HAS_EXPECTED=has_expected,
        BLOCK=PLAN_ENTRIES_BLOCK,
    )
