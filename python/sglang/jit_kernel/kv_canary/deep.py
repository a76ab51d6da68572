"""Per-layer (deep) fingerprint kernels (docs/subsystems.md, "Per-layer fingerprints").

With ``--kv-canary-real-data-layers all`` every buffer group has a
:class:`~sglang.jit_kernel.kv_canary.types.DeepFingerprintTable`: one fingerprint per slot and
(layer, half) column. ``launch_deep_fingerprint_write`` fills the columns of every slot a
forward wrote (after the forward: it reads the bytes the model just wrote);
``launch_deep_fingerprint_verify`` checks, for every slot of a verify plan, either the
forward's rotating window of columns (``rotate=True``: ``columns_per_forward`` columns from the
table's cursor, which then advances) or every column (the sweep). A mismatch appends a ring row
with the column half's tag, fail reason ``VERIFY_REAL_KV_HASH_MISMATCH``, the stored column
value as ``stored_chain_hash``, the recomputed one as ``expected_aux`` and the column's layer
as ``kv_layer``. Graph-safe on CUDA: fixed grids, no allocation, no host sync; the cursor
advances on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary import _hash_triton as H
from sglang.jit_kernel.kv_canary import deep_ref, validation
from sglang.jit_kernel.kv_canary._kernel_consts import (
    DESC_HALF,
    DESC_LAYER,
    DESC_WORDS,
    FAIL_VERIFY_REAL_KV,
    FIELD_POSITION,
    FIELD_TOKEN,
    HALF_V,
    NO_EXPECTED_TOKEN,
    NO_REQ_TO_TOKEN_ROW,
    RECORD_WORDS,
)
from sglang.jit_kernel.kv_canary._launch import grid_size, use_triton
from sglang.jit_kernel.kv_canary._ring_triton import append_violations
from sglang.jit_kernel.kv_canary.types import (
    CanaryLaunchTag,
    DeepFingerprintTable,
    VerifyPlan,
    WritePlan,
)

__all__ = ["launch_deep_fingerprint_write", "launch_deep_fingerprint_verify"]


@triton.jit
def _column_fingerprint(desc_ptr, col, slot, mask):
    # a column descriptor begins with its source's descriptor
    return H.single_source_fingerprint(desc_ptr + col * DESC_WORDS, slot, mask)


@triton.jit
def _deep_write_kernel(
    table_ptr,
    num_slots,
    num_columns,
    desc_ptr,
    offsets_ptr,
    num_reqs_ptr,
    req_capacity,
    loc_ptr,
    num_tokens,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    col = tl.program_id(1)
    nprog = tl.num_programs(0)
    num_reqs = tl.minimum(tl.maximum(tl.load(num_reqs_ptr), 0), req_capacity)
    total = tl.minimum(tl.maximum(tl.load(offsets_ptr + num_reqs), 0), num_tokens)
    for start in range(pid * BLOCK, total, nprog * BLOCK):
        i = start + tl.arange(0, BLOCK)
        m = i < total
        slot = tl.load(loc_ptr + i, mask=m, other=-1).to(tl.int64)
        ok = m & (slot >= 0) & (slot < num_slots)
        fp = _column_fingerprint(desc_ptr, col, slot, ok)
        tl.store(table_ptr + slot * num_columns + col, H.as_i64(fp), mask=ok)


@triton.jit
def _deep_verify_kernel(
    table_ptr,
    num_slots,
    num_columns,
    desc_ptr,
    cursor_ptr,
    canary_ptr,
    slot_idx_ptr,
    exp_pos_ptr,
    row_ptr,
    num_valid_ptr,
    enable_ptr,
    capacity,
    ring_ptr,
    ring_index_ptr,
    ring_capacity,
    tag_k,
    tag_v,
    ROTATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    j = tl.program_id(1)
    nprog = tl.num_programs(0)
    if ROTATE:
        col = (tl.load(cursor_ptr) + j) % num_columns
    else:
        col = j.to(tl.int64)
    layer = tl.load(desc_ptr + col * DESC_WORDS + DESC_LAYER)
    tag = tl.where(tl.load(desc_ptr + col * DESC_WORDS + DESC_HALF) == HALF_V, tag_v, tag_k)
    enabled = tl.load(enable_ptr) == 1
    n = tl.minimum(tl.maximum(tl.load(num_valid_ptr).to(tl.int64), 0), capacity)
    n = tl.where(enabled, n, 0)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_plan = offs < n
        slot = tl.load(slot_idx_ptr + offs, mask=in_plan, other=0)
        live = in_plan & (slot > 0) & (slot < num_slots)
        stored = tl.load(table_ptr + slot * num_columns + col, mask=live, other=0)
        fp = H.as_i64(_column_fingerprint(desc_ptr, col, slot, live))
        bad = live & (stored != fp)
        rec = canary_ptr + slot * RECORD_WORDS
        st_pos = tl.load(rec + FIELD_POSITION, mask=bad, other=0)
        st_tok = tl.load(rec + FIELD_TOKEN, mask=bad, other=0)
        exp_pos = tl.load(exp_pos_ptr + offs, mask=bad, other=0)
        req_row = tl.load(row_ptr + offs, mask=bad, other=NO_REQ_TO_TOKEN_ROW)
        append_violations(
            ring_ptr,
            ring_index_ptr,
            ring_capacity,
            bad,
            tag,
            slot,
            st_pos,
            st_tok,
            tl.full(offs.shape, NO_EXPECTED_TOKEN, tl.int64),
            stored,
            fp,
            tl.full(offs.shape, FAIL_VERIFY_REAL_KV, tl.int64),
            exp_pos,
            req_row,
            layer,
        )


DEEP_WRITE_BLOCK = 128
DEEP_VERIFY_BLOCK = 256


def launch_deep_fingerprint_write(
    *, table: DeepFingerprintTable, plan: WritePlan, out_cache_loc: torch.Tensor
) -> None:
    """Fill every column of the slots this forward wrote: entries
    ``[0, plan.write_offsets[num_valid_reqs])`` of ``out_cache_loc`` (int32/int64
    ``[num_tokens]``, the group's slot space; a slot < 0 or out of range is skipped).
    Graph-safe on CUDA."""
    validation.validate_deep_write_args(table, plan, out_cache_loc)
    if not use_triton(table.device):
        return deep_ref.run_deep_write_reference(
            table=table, plan=plan, out_cache_loc=out_cache_loc
        )
    num_tokens = out_cache_loc.shape[0]
    grid = (grid_size(table.device, num_tokens, DEEP_WRITE_BLOCK), table.num_columns)
    if grid[0] == 0:
        return
    _deep_write_kernel[grid](
        table.table,
        table.num_slots,
        table.num_columns,
        table.descriptors,
        plan.write_offsets,
        plan.write_num_valid_reqs,
        plan.req_capacity,
        out_cache_loc,
        num_tokens,
        BLOCK=DEEP_WRITE_BLOCK,
    )


def launch_deep_fingerprint_verify(
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
    """Check the first ``plan.verify_num_valid`` entries of ``plan`` (if ``plan.enable == 1``;
    slot 0 skipped) against the table: the window of ``table.columns_per_forward`` columns
    starting at ``cursor mod num_columns`` when ``rotate`` (the cursor then advances by the
    window, also when the plan is disabled), else every column. ``canary_buf``: the group's
    records (uint8 ``[num_slots, 32]``), read for the report's position and token. Violation
    rows: ``tag_k`` / ``tag_v`` by the column's half. Graph-safe on CUDA."""
    validation.validate_deep_verify_args(
        table, plan, canary_buf, violation_ring, violation_write_index, tag_k, tag_v
    )
    if not use_triton(table.device):
        deep_ref.run_deep_verify_reference(
            table=table,
            plan=plan,
            canary_buf=canary_buf,
            violation_ring=violation_ring,
            violation_write_index=violation_write_index,
            tag_k=tag_k,
            tag_v=tag_v,
            rotate=rotate,
        )
    else:
        window = table.columns_per_forward if rotate else table.num_columns
        grid = (grid_size(table.device, plan.capacity, DEEP_VERIFY_BLOCK), window)
        if grid[0] > 0:
            _deep_verify_kernel[grid](
                table.table,
                table.num_slots,
                table.num_columns,
                table.descriptors,
                table.cursor,
                canary_buf.view(torch.int64),
                plan.verify_slot_indices,
                plan.verify_expected_positions,
                plan.verify_req_to_token_rows,
                plan.verify_num_valid,
                plan.enable,
                plan.capacity,
                violation_ring,
                violation_write_index,
                violation_ring.shape[0],
                int(tag_k),
                int(tag_v),
                ROTATE=rotate,
                BLOCK=DEEP_VERIFY_BLOCK,
            )
    if rotate:
        table.cursor.add_(table.columns_per_forward)
