"""Torch reference of the per-layer (deep) fingerprint kernels (the oracle, and the CPU serving
path).

Same signatures and semantics as :mod:`~sglang.jit_kernel.kv_canary.deep`, vectorised over
slots, one column at a time. Host-synchronous (reads the plan's counts and the cursor), so it
is not for CUDA-graph capture. The ``*_torch_reference`` launchers validate their arguments;
the ``run_*`` functions are what the public launchers' CPU paths call (already validated).
Violation rows are appended column by column in window order, entries in plan order.
"""

from __future__ import annotations

import torch

from sglang.jit_kernel.kv_canary import validation
from sglang.jit_kernel.kv_canary._hash_torch import real_kv_fingerprint_t
from sglang.jit_kernel.kv_canary._ring_torch import append_violation_rows, violation_rows
from sglang.jit_kernel.kv_canary.consts import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_TOKEN,
    NO_EXPECTED_TOKEN,
    FailReason,
)
from sglang.jit_kernel.kv_canary.types import (
    CanaryLaunchTag,
    DeepFingerprintTable,
    KvHalf,
    VerifyPlan,
    WritePlan,
)


def column_fingerprints(table: DeepFingerprintTable, col: int, slots: torch.Tensor) -> torch.Tensor:
    """Column ``col``'s fingerprint of ``slots`` (int64 ``[n]``, all in range)."""
    source = table.columns[col].source
    return real_kv_fingerprint_t((source,), (source.words_to_fold(table.mode),), slots)


def launch_deep_fingerprint_write_torch_reference(
    *, table: DeepFingerprintTable, plan: WritePlan, out_cache_loc: torch.Tensor
) -> None:
    validation.validate_deep_write_args(table, plan, out_cache_loc)
    run_deep_write_reference(table=table, plan=plan, out_cache_loc=out_cache_loc)


def run_deep_write_reference(
    *, table: DeepFingerprintTable, plan: WritePlan, out_cache_loc: torch.Tensor
) -> None:
    num_reqs = min(max(int(plan.write_num_valid_reqs[0].item()), 0), plan.req_capacity)
    total = min(max(int(plan.write_offsets[num_reqs].item()), 0), out_cache_loc.shape[0])
    slots = out_cache_loc[:total].to(torch.int64)
    slots = slots[(slots >= 0) & (slots < table.num_slots)]
    if slots.numel() == 0:
        return
    for col in range(table.num_columns):
        table.table[slots, col] = column_fingerprints(table, col, slots)


def launch_deep_fingerprint_verify_torch_reference(
    *,
    table: DeepFingerprintTable,
    plan: VerifyPlan,
    canary_buf: torch.Tensor,
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    tag_k: CanaryLaunchTag,
    tag_v: CanaryLaunchTag,
    rotate: bool,
) -> None:
    validation.validate_deep_verify_args(
        table, plan, canary_buf, violation_ring, violation_write_index, tag_k, tag_v
    )
    run_deep_verify_reference(
        table=table,
        plan=plan,
        canary_buf=canary_buf,
        violation_ring=violation_ring,
        violation_write_index=violation_write_index,
        tag_k=tag_k,
        tag_v=tag_v,
        rotate=rotate,
    )
    if rotate:
        table.cursor.add_(table.columns_per_forward)


def window_columns(table: DeepFingerprintTable, rotate: bool) -> list:
    """The columns a launch checks, in order (reads the cursor: host sync)."""
    if not rotate:
        return list(range(table.num_columns))
    start = int(table.cursor[0].item())
    return [(start + j) % table.num_columns for j in range(table.columns_per_forward)]


def run_deep_verify_reference(
    *,
    table: DeepFingerprintTable,
    plan: VerifyPlan,
    canary_buf: torch.Tensor,
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    tag_k: CanaryLaunchTag,
    tag_v: CanaryLaunchTag,
    rotate: bool,
) -> None:
    """The verify reference on validated arguments; does not advance the cursor (the
    launcher does, on either path)."""
    columns = window_columns(table, rotate)
    if int(plan.enable[0].item()) != 1:
        return
    n = min(max(int(plan.verify_num_valid[0].item()), 0), plan.capacity)
    slot = plan.verify_slot_indices[:n]
    live = (slot > 0) & (slot < table.num_slots)
    slot = slot[live]
    if slot.numel() == 0:
        return
    exp_pos = plan.verify_expected_positions[:n][live]
    req_row = plan.verify_req_to_token_rows[:n][live]
    records = canary_buf.view(torch.int64)[slot]
    for col in columns:
        stored = table.table[slot, col]
        fp = column_fingerprints(table, col, slot)
        bad = stored != fp
        if not bool(bad.any()):
            continue
        column = table.columns[col]
        tag = tag_v if column.half == KvHalf.V else tag_k
        nbad = int(bad.sum().item())
        rows = violation_rows(
            int(tag),
            slot[bad],
            records[bad][:, CANARY_FIELD_POSITION],
            records[bad][:, CANARY_FIELD_TOKEN],
            torch.full((nbad,), NO_EXPECTED_TOKEN, dtype=torch.int64, device=slot.device),
            stored[bad],
            fp[bad],
            torch.full(
                (nbad,),
                int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH),
                dtype=torch.int64,
                device=slot.device,
            ),
            exp_pos[bad],
            req_row[bad],
            torch.full((nbad,), column.layer_id, dtype=torch.int64, device=slot.device),
        )
        append_violation_rows(violation_ring, violation_write_index, rows)
