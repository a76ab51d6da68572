"""Torch reference of the verify kernel (the oracle, and the CPU serving path).

Same signature and semantics as :func:`~sglang.jit_kernel.kv_canary.verify.launch_canary_verify_kernel`,
vectorised over plan entries. Host-synchronous (reads ``enable`` / ``verify_num_valid``), so it is
not for CUDA-graph capture. ``launch_canary_verify_kernel_torch_reference`` validates its
arguments once, then runs :func:`run_canary_verify_reference`, which the public launcher's CPU
path calls directly (it has validated already).
"""

from __future__ import annotations

import torch

from sglang.jit_kernel.kv_canary import validation
from sglang.jit_kernel.kv_canary._hash_torch import (
    CHAIN_HEAD_HASH_I64,
    real_kv_fingerprint_t,
    record_hash_t,
)
from sglang.jit_kernel.kv_canary._ring_torch import append_violation_rows, violation_rows
from sglang.jit_kernel.kv_canary.consts import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    NO_EXPECTED_TOKEN,
    NO_PREV_SLOT,
    FailReason,
)
from sglang.jit_kernel.kv_canary.types import VerifyOrWriteContext, VerifyPlan


def launch_canary_verify_kernel_torch_reference(
    *, context: VerifyOrWriteContext, plan: VerifyPlan, check_verify_expected_token: bool
) -> None:
    """Validate the arguments, then :func:`run_canary_verify_reference`."""
    validation.validate_verify_args(context, plan, check_verify_expected_token)
    run_canary_verify_reference(
        context=context, plan=plan, check_verify_expected_token=check_verify_expected_token
    )


def run_canary_verify_reference(
    *, context: VerifyOrWriteContext, plan: VerifyPlan, check_verify_expected_token: bool
) -> None:
    """The verify reference on already validated arguments (the launcher's CPU path)."""
    context.kernel_run_counter.add_(1)
    if int(plan.enable[0].item()) != 1:
        return
    n = min(max(int(plan.verify_num_valid[0].item()), 0), plan.capacity)
    context.slot_run_counter.add_(n)
    if n == 0:
        return
    records = context.canary_words
    num_slots = context.num_slots
    slot = plan.verify_slot_indices[:n]
    live = (slot > 0) & (slot < num_slots)
    slot = slot[live]
    prev = plan.verify_prev_slot_indices[:n][live]
    exp_pos = plan.verify_expected_positions[:n][live]
    stored = records[slot]
    st_tok = stored[:, CANARY_FIELD_TOKEN]
    st_pos = stored[:, CANARY_FIELD_POSITION]
    st_prev = stored[:, CANARY_FIELD_PREV_HASH]

    has_prev_rec = (prev > 0) & (prev < num_slots)
    check_chain = has_prev_rec | (prev == NO_PREV_SLOT)
    expected_chain = torch.full_like(st_prev, CHAIN_HEAD_HASH_I64)
    expected_chain[has_prev_rec] = record_hash_t(records[prev[has_prev_rec]])

    bits = torch.zeros_like(slot)
    bits |= (
        check_chain & (st_prev != expected_chain)
    ).long() * FailReason.VERIFY_CHAIN_HASH_MISMATCH
    bits |= (st_pos != exp_pos).long() * FailReason.VERIFY_POSITION_MISMATCH
    if check_verify_expected_token:
        exp_tok = plan.verify_expected_tokens[:n][live]
        token_bad = (exp_tok != NO_EXPECTED_TOKEN) & (st_tok != exp_tok)
        bits |= token_bad.long() * FailReason.VERIFY_TOKEN_MISMATCH
    else:
        exp_tok = torch.full_like(slot, NO_EXPECTED_TOKEN)
    mode = context.fingerprint_mode
    if mode:
        fp = real_kv_fingerprint_t(
            context.real_kv_sources, [s.words_to_fold(mode) for s in context.real_kv_sources], slot
        )
        bits |= (
            stored[:, CANARY_FIELD_REAL_KV_HASH] != fp
        ).long() * FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    aux = torch.where(check_chain, expected_chain, st_prev)
    bad = bits != 0
    req_row = plan.verify_req_to_token_rows[:n][live]
    rows = violation_rows(
        int(context.kernel_kind),
        slot[bad],
        st_pos[bad],
        st_tok[bad],
        exp_tok[bad],
        st_prev[bad],
        aux[bad],
        bits[bad],
        exp_pos[bad],
        req_row[bad],
    )
    append_violation_rows(context.violation_ring, context.violation_write_index, rows)
