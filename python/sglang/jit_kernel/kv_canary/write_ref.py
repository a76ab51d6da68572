"""Torch reference of the write kernel (the oracle, and the CPU serving path).

Same signature and semantics as :func:`~sglang.jit_kernel.kv_canary.write.launch_canary_write_kernel`.
Loops over chain steps (vectorised over requests), then fingerprints all written slots at once.
Host-synchronous; not for CUDA-graph capture. ``launch_canary_write_kernel_torch_reference``
validates its arguments once, then runs :func:`run_canary_write_reference`, which the public
launcher's CPU path calls directly (it has validated already).
"""

from __future__ import annotations

import torch

from sglang.jit_kernel.kv_canary import validation
from sglang.jit_kernel.kv_canary._hash_torch import (
    CHAIN_HEAD_HASH_I64,
    mix3_t,
    real_kv_fingerprint_t,
    record_hash_t,
)
from sglang.jit_kernel.kv_canary._ring_torch import append_violation_rows, violation_rows
from sglang.jit_kernel.kv_canary.consts import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    FailReason,
)
from sglang.jit_kernel.kv_canary.types import WriteParts


def launch_canary_write_kernel_torch_reference(
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
) -> None:
    """Validate the arguments, then :func:`run_canary_write_reference`."""
    kwargs = dict(
        context=context,
        plan=plan,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        enable_write_input_assert=enable_write_input_assert,
        expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions,
        parts=parts,
    )
    validation.validate_write_args(**kwargs)
    run_canary_write_reference(**kwargs)


def run_canary_write_reference(
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
) -> None:
    """The write reference on already validated arguments (the launcher's CPU path)."""
    records = context.canary_words
    num_slots = context.num_slots
    num_tokens = input_ids.shape[0]
    nreq = min(max(int(plan.write_num_valid_reqs[0].item()), 0), plan.req_capacity)
    offsets = plan.write_offsets[: nreq + 1]
    if parts != WriteParts.FINGERPRINT:
        _chain(
            context,
            plan,
            input_ids,
            positions,
            out_cache_loc,
            enable_write_input_assert,
            expected_input_tokens,
            expected_input_positions,
            nreq,
            offsets,
            zero_fp=parts == WriteParts.CHAIN or not context.fingerprint_mode,
        )
    if parts != WriteParts.CHAIN and context.fingerprint_mode and nreq:
        total = min(max(int(offsets[nreq].item()), 0), num_tokens)
        slots = out_cache_loc[:total].long()
        slots = slots[(slots >= 0) & (slots < num_slots)]
        mode = context.fingerprint_mode
        records[slots, CANARY_FIELD_REAL_KV_HASH] = real_kv_fingerprint_t(
            context.real_kv_sources, [s.words_to_fold(mode) for s in context.real_kv_sources], slots
        )


def _chain(
    context,
    plan,
    input_ids,
    positions,
    out_cache_loc,
    enable_write_input_assert,
    expected_input_tokens,
    expected_input_positions,
    nreq,
    offsets,
    *,
    zero_fp,
):
    """The serial chain part: records (with ``real_kv_hash`` 0 when ``zero_fp``), checks,
    counters."""
    context.kernel_run_counter.add_(1)
    records = context.canary_words
    num_slots = context.num_slots
    num_tokens = input_ids.shape[0]
    start = offsets[:-1]
    length = (offsets[1:] - start).clamp_min(0)
    seeds = plan.write_seed_slot_indices[:nreq]
    req_rows = plan.write_req_to_token_rows[:nreq]
    seed_ok = (seeds >= 0) & (seeds < num_slots)
    running = torch.full_like(seeds, CHAIN_HEAD_HASH_I64)
    running[seed_ok] = record_hash_t(records[seeds[seed_ok]])
    prev_pos = torch.zeros_like(seeds)
    prev_pos[seed_ok] = records[seeds[seed_ok], CANARY_FIELD_POSITION]
    check_pos = (
        seed_ok & (seeds > 0) & bool(int(context.enable_chain_position_assert[0].item()) == 1)
    )

    written = 0
    max_len = int(length.max().item()) if nreq and num_tokens else 0
    for j in range(max_len):
        i = start + j
        act = (j < length) & (i >= 0) & (i < num_tokens)
        ia = i.clamp(0, num_tokens - 1)
        tok = torch.where(act, input_ids[ia].long(), 0)
        pos = torch.where(act, positions[ia].long(), 0)
        slot = torch.where(act, out_cache_loc[ia].long(), -1)
        ok = act & (slot >= 0) & (slot < num_slots)
        s = slot[ok]
        records[s, CANARY_FIELD_TOKEN] = tok[ok]
        records[s, CANARY_FIELD_POSITION] = pos[ok]
        records[s, CANARY_FIELD_PREV_HASH] = running[ok]
        if zero_fp:
            records[s, CANARY_FIELD_REAL_KV_HASH] = 0
        bits = torch.zeros_like(tok)
        if enable_write_input_assert:
            exp_tok = expected_input_tokens[ia].long()
            exp_pos = expected_input_positions[ia].long()
            bits |= (tok != exp_tok).long() * FailReason.WRITE_TOKEN_MISMATCH
            bits |= (pos != exp_pos).long() * FailReason.WRITE_POSITION_MISMATCH
        else:
            exp_tok, exp_pos = tok, pos
        chain_bad = check_pos & (pos != prev_pos + 1)
        bits |= chain_bad.long() * FailReason.WRITE_POSITION_MISMATCH
        exp_pos = torch.where(chain_bad, prev_pos + 1, exp_pos)
        bad = ok & (bits != 0)
        if bool(bad.any()):
            append_violation_rows(
                context.violation_ring,
                context.violation_write_index,
                violation_rows(
                    int(context.kernel_kind),
                    slot[bad],
                    pos[bad],
                    tok[bad],
                    exp_tok[bad],
                    running[bad],
                    exp_pos[bad],
                    bits[bad],
                    pos[bad],
                    req_rows[bad],
                ),
            )
        written += int(ok.sum().item())
        running = torch.where(act, mix3_t(running, tok, pos), running)
        prev_pos = torch.where(act, pos, prev_pos)
    context.slot_run_counter.add_(written)
