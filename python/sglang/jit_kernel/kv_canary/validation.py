"""Host-side argument validation of the kernel launchers and their torch references.

Each public launcher and each public torch reference validates its arguments exactly once,
with the function of this module, then runs the unvalidated implementation. The checks read
metadata only (no device sync, no allocation), so they are safe on every launch, CUDA-graph
capture included. Errors are ``TypeError`` (wrong type / dtype) or ``ValueError`` (shape,
contiguity, capacity, device) naming the argument (docs/architecture.md, "Kernel rules").

No Triton here: imports only ``_checks``, ``types`` and ``consts``.
"""

from __future__ import annotations

import torch

from sglang.jit_kernel.kv_canary._checks import (
    INDEX_DTYPES,
    check_int,
    check_tensor,
    same_device,
)
from sglang.jit_kernel.kv_canary.consts import VIOLATION_NUM_FIELDS
from sglang.jit_kernel.kv_canary.types import (
    CANARY_SLOT_BYTES,
    CanaryLaunchTag,
    DeepFingerprintTable,
    VerifyOrWriteContext,
    PlanLanes,
    VerifyPlan,
    WriteParts,
    WritePlan,
    WriteTree,
)
from sglang.jit_kernel.kv_canary.consts import (
    packed_tokens_numel,
)


def validate_verify_args(context, plan, check_verify_expected_token) -> None:
    """Host-side checks shared by the launcher and the torch reference (metadata only)."""
    if not isinstance(context, VerifyOrWriteContext):
        raise TypeError(f"context must be a VerifyOrWriteContext, got {type(context).__name__}")
    if not isinstance(plan, VerifyPlan):
        raise TypeError(f"plan must be a VerifyPlan, got {type(plan).__name__}")
    if not isinstance(check_verify_expected_token, bool):
        raise TypeError(
            "check_verify_expected_token must be a bool, got "
            f"{type(check_verify_expected_token).__name__}"
        )
    if plan.device != context.device:
        raise ValueError(f"plan is on {plan.device} but context.canary_buf is on {context.device}")


def validate_copy_rows_args(src, dst, src_indices, dst_indices) -> None:
    """Host-side checks of a row copy (metadata only)."""
    for name, t in (("src", src), ("dst", dst)):
        check_tensor(name, t, dtypes=(torch.int64,), ndim=2)
    width = src.shape[1]
    if dst.shape[1] != width or width < 1:
        raise ValueError(
            f"src and dst must have the same row width in words, got "
            f"{src.shape[1]} and {dst.shape[1]}"
        )
    n = check_tensor("src_indices", src_indices, dtypes=INDEX_DTYPES, ndim=1).shape[0]
    check_tensor("dst_indices", dst_indices, dtypes=INDEX_DTYPES, shape=(n,))
    devices = {src.device.type, dst.device.type}
    if devices == {"cuda"} and src.device != dst.device:
        raise ValueError(f"src is on {src.device} but dst on {dst.device}")
    if devices == {"cuda", "cpu"}:
        host = src if src.device.type == "cpu" else dst
        if not host.is_pinned():
            raise ValueError(
                "a row copy between the GPU and host memory needs the host "
                "tensor pinned (page-locked)"
            )
    elif devices - {"cuda", "cpu"}:
        raise ValueError(f"row copies support cuda and cpu tensors, got {sorted(devices)}")


def validate_deep_write_args(table, plan, out_cache_loc) -> None:
    """Host-side checks of a per-layer fingerprint write (metadata only)."""
    if not isinstance(table, DeepFingerprintTable):
        raise TypeError(f"table must be a DeepFingerprintTable, got {type(table).__name__}")
    if not isinstance(plan, WritePlan):
        raise TypeError(f"plan must be a WritePlan, got {type(plan).__name__}")
    check_tensor("out_cache_loc", out_cache_loc, dtypes=INDEX_DTYPES, ndim=1)
    same_device(
        {
            "table.table": table.table,
            "plan.write_offsets": plan.write_offsets,
            "out_cache_loc": out_cache_loc,
        }
    )


def validate_deep_verify_args(
    table, plan, canary_buf, violation_ring, violation_write_index, tag_k, tag_v
) -> None:
    """Host-side checks of a per-layer fingerprint verify (metadata only)."""
    if not isinstance(table, DeepFingerprintTable):
        raise TypeError(f"table must be a DeepFingerprintTable, got {type(table).__name__}")
    if not isinstance(plan, VerifyPlan):
        raise TypeError(f"plan must be a VerifyPlan, got {type(plan).__name__}")
    for name, tag in (("tag_k", tag_k), ("tag_v", tag_v)):
        if not isinstance(tag, CanaryLaunchTag):
            raise TypeError(f"{name} must be a CanaryLaunchTag, got {tag!r}")
    check_tensor(
        "canary_buf", canary_buf, dtypes=(torch.uint8,), shape=(table.num_slots, CANARY_SLOT_BYTES)
    )
    check_tensor(
        "violation_ring", violation_ring, dtypes=(torch.int64,), shape=(None, VIOLATION_NUM_FIELDS)
    )
    check_tensor("violation_write_index", violation_write_index, dtypes=(torch.int32,), shape=(1,))
    same_device(
        {
            "table.table": table.table,
            "plan.verify_slot_indices": plan.verify_slot_indices,
            "canary_buf": canary_buf,
            "violation_ring": violation_ring,
            "violation_write_index": violation_write_index,
        }
    )


def validate_write_args(
    *,
    context,
    plan,
    input_ids,
    positions,
    out_cache_loc,
    enable_write_input_assert,
    expected_input_tokens,
    expected_input_positions,
    parts=WriteParts.ALL,
    tree=None,
) -> None:
    """Host-side checks shared by the launcher and the torch reference (metadata only)."""
    if not isinstance(parts, WriteParts):
        raise TypeError(f"parts must be a WriteParts, got {parts!r}")
    if not isinstance(context, VerifyOrWriteContext):
        raise TypeError(f"context must be a VerifyOrWriteContext, got {type(context).__name__}")
    if not isinstance(plan, WritePlan):
        raise TypeError(f"plan must be a WritePlan, got {type(plan).__name__}")
    if not isinstance(enable_write_input_assert, bool):
        raise TypeError(
            "enable_write_input_assert must be a bool, got "
            f"{type(enable_write_input_assert).__name__}"
        )
    n = check_tensor("input_ids", input_ids, dtypes=INDEX_DTYPES, ndim=1).shape[0]
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(n,))
    check_tensor("out_cache_loc", out_cache_loc, dtypes=INDEX_DTYPES, shape=(n,))
    if enable_write_input_assert:
        for name, t in (
            ("expected_input_tokens", expected_input_tokens),
            ("expected_input_positions", expected_input_positions),
        ):
            if t is None:
                raise ValueError(f"{name} is required when enable_write_input_assert=True")
            check_tensor(name, t, dtypes=INDEX_DTYPES, shape=(n,))
    if tree is not None:
        if not isinstance(tree, WriteTree):
            raise TypeError(f"tree must be a WriteTree or None, got {type(tree).__name__}")
        if tree.capacity < n:
            raise ValueError(
                f"tree.parent holds {tree.capacity} entries, fewer than the launch's {n} tokens"
            )
    same_device(
        {
            "context.canary_buf": context.canary_buf,
            "plan.write_offsets": plan.write_offsets,
            "tree.parent": tree.parent if tree is not None else None,
            "input_ids": input_ids,
            "positions": positions,
            "out_cache_loc": out_cache_loc,
            "expected_input_tokens": expected_input_tokens if enable_write_input_assert else None,
            "expected_input_positions": expected_input_positions
            if enable_write_input_assert
            else None,
        }
    )


def validate_plan_args(
    *,
    verify_plan_out,
    write_plan_out,
    req_pool_indices,
    prefix_lens,
    extend_seq_lens,
    req_to_token,
    swa_window_size,
    full_to_swa_index_mapping,
    verify_capacity,
    req_to_verify_expected_tokens,
    req_to_verify_expected_tokens_valid_lens,
    kv_token_id_vs_position_offset,
    lanes=None,
) -> None:
    """Host-side checks shared by the launcher and the torch reference (metadata only)."""
    if not isinstance(verify_plan_out, VerifyPlan):
        raise TypeError(
            f"verify_plan_out must be a VerifyPlan, got {type(verify_plan_out).__name__}"
        )
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
        raise ValueError(
            "full_to_swa_index_mapping is given but swa_window_size is 0: a SWA "
            "group must pass its window size"
        )
    if full_to_swa_index_mapping is not None:
        check_tensor(
            "full_to_swa_index_mapping", full_to_swa_index_mapping, dtypes=INDEX_DTYPES, ndim=1
        )
    check_int("verify_capacity", verify_capacity, minimum=0)
    if verify_capacity != verify_plan_out.capacity:
        raise ValueError(
            f"verify_capacity={verify_capacity} does not match verify_plan_out's "
            f"capacity {verify_plan_out.capacity}"
        )
    if bs > write_plan_out.req_capacity:
        raise ValueError(
            f"batch size {bs} (req_pool_indices) exceeds write_plan_out's request "
            f"capacity {write_plan_out.req_capacity}"
        )
    if req_to_verify_expected_tokens is not None:
        check_tensor(
            "req_to_verify_expected_tokens",
            req_to_verify_expected_tokens,
            dtypes=(torch.int32,),
            ndim=2,
        )
        if req_to_verify_expected_tokens_valid_lens is None:
            raise ValueError(
                "req_to_verify_expected_tokens_valid_lens is required when "
                "req_to_verify_expected_tokens is given"
            )
        check_tensor(
            "req_to_verify_expected_tokens_valid_lens",
            req_to_verify_expected_tokens_valid_lens,
            dtypes=INDEX_DTYPES,
            shape=(bs,),
        )
    check_int("kv_token_id_vs_position_offset", kv_token_id_vs_position_offset)
    if lanes is not None:
        if not isinstance(lanes, PlanLanes):
            raise TypeError(f"lanes must be a PlanLanes or None, got {type(lanes).__name__}")
        if lanes.capacity < bs:
            raise ValueError(
                f"lanes hold {lanes.capacity} rows, fewer than the batch's {bs} (req_pool_indices)"
            )
    same_device(
        {
            "lanes": lanes.verify_from if lanes is not None else None,
            "verify_plan_out": verify_plan_out.verify_slot_indices,
            "write_plan_out": write_plan_out.write_offsets,
            "req_pool_indices": req_pool_indices,
            "prefix_lens": prefix_lens,
            "extend_seq_lens": extend_seq_lens,
            "req_to_token": req_to_token,
            "full_to_swa_index_mapping": full_to_swa_index_mapping,
            "req_to_verify_expected_tokens": req_to_verify_expected_tokens,
            "req_to_verify_expected_tokens_valid_lens": req_to_verify_expected_tokens_valid_lens
            if req_to_verify_expected_tokens is not None
            else None,
        }
    )


def validate_packed_scatter_args(packed, req_pool_indices, pool_out, valid_lens_out) -> None:
    """Host-side checks of the packed token-id scatter and its torch reference (metadata only:
    the request count inside ``packed`` is device data, bounded by the kernel)."""
    packed = check_tensor("packed", packed, dtypes=(torch.int64,), ndim=1)
    rows = check_tensor("req_pool_indices", req_pool_indices, dtypes=(torch.int64,), ndim=1).shape[
        0
    ]
    check_tensor("pool_out", pool_out, dtypes=(torch.int32,), ndim=2)
    check_tensor("valid_lens_out", valid_lens_out, dtypes=(torch.int64,), shape=(rows,))
    if packed.shape[0] < packed_tokens_numel(rows, 0):
        raise ValueError(
            f"packed has {packed.shape[0]} words, fewer than the header of "
            f"{rows} requests ({packed_tokens_numel(rows, 0)} words)"
        )
    same_device(
        {
            "packed": packed,
            "req_pool_indices": req_pool_indices,
            "pool_out": pool_out,
            "valid_lens_out": valid_lens_out,
        }
    )


def validate_scatter_args(flat_in, offsets, req_pool_indices, pool_out, dst_starts) -> None:
    """Host-side checks of the token-id scatter and its torch reference (metadata only)."""
    check_tensor("flat_in", flat_in, dtypes=(torch.int64,), ndim=1)
    bs = check_tensor("req_pool_indices", req_pool_indices, dtypes=(torch.int64,), ndim=1).shape[0]
    check_tensor("offsets", offsets, dtypes=(torch.int64,), shape=(bs + 1,))
    check_tensor("pool_out", pool_out, dtypes=(torch.int32,), ndim=2)
    tensors = {
        "flat_in": flat_in,
        "offsets": offsets,
        "req_pool_indices": req_pool_indices,
        "pool_out": pool_out,
    }
    if dst_starts is not None:
        tensors["dst_starts"] = check_tensor(
            "dst_starts", dst_starts, dtypes=(torch.int64,), shape=(bs,)
        )
    same_device(tensors)
