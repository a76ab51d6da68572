"""Canary verify kernel (docs/architecture.md, "Verify").

``launch_canary_verify_kernel`` re-checks the canary records of every slot a forward's attention
is about to read. It is read-only on the records; violations go to the context's ring.
Graph-safe: no allocation, no host sync, no branching on device values on the launch path.

The launch tags, real-KV sources, launch context and verify plan live in
:mod:`~sglang.jit_kernel.kv_canary.types` (no Triton); they are re-exported here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary import _hash_triton as H
from sglang.jit_kernel.kv_canary import validation, verify_ref
from sglang.jit_kernel.kv_canary._kernel_consts import (
    FAIL_VERIFY_CHAIN,
    FAIL_VERIFY_POSITION,
    FAIL_VERIFY_REAL_KV,
    FAIL_VERIFY_TOKEN,
    FIELD_POSITION,
    FIELD_PREV_HASH,
    FIELD_REAL_KV_HASH,
    FIELD_TOKEN,
    NO_EXPECTED_TOKEN,
    NO_PREV_SLOT,
    NO_KV_LAYER,
    NO_REQ_TO_TOKEN_ROW,
    RECORD_WORDS,
)
from sglang.jit_kernel.kv_canary._launch import grid_size, use_triton
from sglang.jit_kernel.kv_canary._ring_triton import append_violations

# Re-exports from ``types``, kept for the documented import paths
# (``from sglang.jit_kernel.kv_canary.verify import CanaryLaunchTag`` etc.).
from sglang.jit_kernel.kv_canary.types import (  # noqa: F401
    CANARY_SLOT_BYTES,
    NUM_CANARY_LAUNCH_TAGS,
    CanaryLaunchTag,
    CanaryPhase,
    KvHalf,
    PoolKind,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
)

__all__ = [
    "CANARY_SLOT_BYTES",
    "NUM_CANARY_LAUNCH_TAGS",
    "CanaryLaunchTag",
    "CanaryPhase",
    "KvHalf",
    "PoolKind",
    "RealKvSource",
    "VerifyOrWriteContext",
    "VerifyPlan",
    "launch_canary_verify_kernel",
]


@triton.jit
def _canary_verify_kernel(
    canary_ptr,
    num_slots,
    slot_idx_ptr,
    exp_tok_ptr,
    exp_pos_ptr,
    prev_idx_ptr,
    row_ptr,
    num_valid_ptr,
    enable_ptr,
    capacity,
    ring_ptr,
    ring_index_ptr,
    ring_capacity,
    slot_counter_ptr,
    kernel_counter_ptr,
    kernel_kind,
    src_desc_ptr,
    CHECK_TOKEN: tl.constexpr,
    NUM_SOURCES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    enabled = tl.load(enable_ptr) == 1
    n = tl.minimum(tl.maximum(tl.load(num_valid_ptr).to(tl.int64), 0), capacity)
    n = tl.where(enabled, n, 0)
    if pid == 0:
        tl.atomic_add(kernel_counter_ptr, 1)
        tl.atomic_add(slot_counter_ptr, n)
    head = H.chain_head_hash()
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_plan = offs < n
        slot = tl.load(slot_idx_ptr + offs, mask=in_plan, other=0)
        live = in_plan & (slot > 0) & (slot < num_slots)
        rec = canary_ptr + slot * RECORD_WORDS
        st_tok = tl.load(rec + FIELD_TOKEN, mask=live, other=0)
        st_pos = tl.load(rec + FIELD_POSITION, mask=live, other=0)
        st_prev = tl.load(rec + FIELD_PREV_HASH, mask=live, other=0)
        prev = tl.load(prev_idx_ptr + offs, mask=live, other=0)
        has_prev_rec = live & (prev > 0) & (prev < num_slots)
        check_chain = has_prev_rec | (live & (prev == NO_PREV_SLOT))
        expected_chain = tl.where(
            prev == NO_PREV_SLOT, head, H.record_hash(canary_ptr, prev, has_prev_rec)
        )
        expected_chain = H.as_i64(expected_chain)
        exp_pos = tl.load(exp_pos_ptr + offs, mask=live, other=0)
        bits = tl.where(check_chain & (st_prev != expected_chain), FAIL_VERIFY_CHAIN, 0)
        bits |= tl.where(live & (st_pos != exp_pos), FAIL_VERIFY_POSITION, 0)
        if CHECK_TOKEN:
            exp_tok = tl.load(exp_tok_ptr + offs, mask=live, other=NO_EXPECTED_TOKEN)
            bad_tok = live & (exp_tok != NO_EXPECTED_TOKEN) & (st_tok != exp_tok)
            bits |= tl.where(bad_tok, FAIL_VERIFY_TOKEN, 0)
        else:
            exp_tok = tl.full(offs.shape, NO_EXPECTED_TOKEN, tl.int64)
        if NUM_SOURCES > 0:
            st_kv = tl.load(rec + FIELD_REAL_KV_HASH, mask=live, other=0)
            fp = H.real_kv_fingerprint(slot, live, src_desc_ptr, NUM_SOURCES)
            bits |= tl.where(live & (st_kv != H.as_i64(fp)), FAIL_VERIFY_REAL_KV, 0)
        aux = tl.where(check_chain, expected_chain, st_prev)
        viol = live & (bits != 0)
        req_row = tl.load(row_ptr + offs, mask=viol, other=NO_REQ_TO_TOKEN_ROW)
        append_violations(
            ring_ptr,
            ring_index_ptr,
            ring_capacity,
            viol,
            kernel_kind,
            slot,
            st_pos,
            st_tok,
            exp_tok,
            st_prev,
            aux,
            bits.to(tl.int64),
            exp_pos,
            req_row,
            NO_KV_LAYER,
        )


VERIFY_BLOCK = 256


def launch_canary_verify_kernel(
    *, context: VerifyOrWriteContext, plan: VerifyPlan, check_verify_expected_token: bool
) -> None:
    """Verify the first ``plan.verify_num_valid`` entries of ``plan`` if ``plan.enable == 1``.

    Checks per entry (slot 0 skipped): chain hash vs ``H(record[prev])`` (``prev == -1`` → chain
    head, ``prev == 0`` → predecessor unreachable, not checked), stored position, stored token
    (when ``check_verify_expected_token`` and the expected token is not -1), real-KV
    fingerprint (when the context's mode is not NONE). Appends violation rows (located by the
    entry's expected position and ``req_to_token`` row), bumps the kernel
    counter by 1 and the slot counter by ``min(num_valid, capacity)`` when enabled.
    Graph-safe on CUDA.
    """
    validation.validate_verify_args(context, plan, check_verify_expected_token)
    if not use_triton(context.device):
        return verify_ref.run_canary_verify_reference(
            context=context, plan=plan, check_verify_expected_token=check_verify_expected_token
        )
    grid = (grid_size(context.device, plan.capacity, VERIFY_BLOCK),)
    _canary_verify_kernel[grid](
        context.canary_words,
        context.num_slots,
        plan.verify_slot_indices,
        plan.verify_expected_tokens,
        plan.verify_expected_positions,
        plan.verify_prev_slot_indices,
        plan.verify_req_to_token_rows,
        plan.verify_num_valid,
        plan.enable,
        plan.capacity,
        context.violation_ring,
        context.violation_write_index,
        context.ring_capacity,
        context.slot_run_counter,
        context.kernel_run_counter,
        int(context.kernel_kind),
        context.source_descriptors,
        CHECK_TOKEN=check_verify_expected_token,
        NUM_SOURCES=len(context.real_kv_sources) if context.fingerprint_mode else 0,
        BLOCK=VERIFY_BLOCK,
    )
