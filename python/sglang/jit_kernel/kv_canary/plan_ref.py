"""Torch reference of the plan kernels (the oracle, and the CPU serving path).

Same signature and semantics as :func:`~sglang.jit_kernel.kv_canary.plan.launch_canary_plan_kernels`,
fully vectorised. Host-synchronous (reads the total); not for CUDA-graph capture.
``launch_canary_plan_kernels_torch_reference`` validates its arguments once, then runs
:func:`run_canary_plan_reference`, which the public launcher's CPU path calls directly (it has
validated already).

Imports nothing under ``plan/`` (whose package init imports this module through ``plan.api``):
the torch twin of the SWA slot translation lives here.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.jit_kernel.kv_canary import validation
from sglang.jit_kernel.kv_canary.consts import (
    NO_EXPECTED_TOKEN,
    NO_PREV_SLOT,
    NO_REQ_TO_TOKEN_ROW,
    NO_SEED_SLOT,
)


def translate_slots_torch(lut: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`~sglang.jit_kernel.kv_canary.plan.utils.translate_slots` on an int64
    tensor."""
    if lut is None:
        return x
    in_range = (x >= 0) & (x < lut.shape[0])
    y = (
        torch.where(in_range, lut[x.clamp(0, max(lut.shape[0] - 1, 0))].long(), 0)
        if lut.shape[0]
        else torch.zeros_like(x)
    )
    return torch.where(x < 0, x, y)


def launch_canary_plan_kernels_torch_reference(
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
    """Validate the arguments, then :func:`run_canary_plan_reference`."""
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
    run_canary_plan_reference(**kwargs)


def run_canary_plan_reference(
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
    """The plan reference on already validated arguments (the launcher's CPU path); with
    ``lanes`` (:class:`~sglang.jit_kernel.kv_canary.types.PlanLanes`) each row verifies from
    its ``verify_from`` and reads position p at its shifted column."""
    vp, wp = verify_plan_out, write_plan_out
    lut = full_to_swa_index_mapping
    bs = req_pool_indices.shape[0]
    rows, cols = req_to_token.shape
    device = req_to_token.device

    rp = req_pool_indices.long()
    live = (rp > 0) & (rp < rows)
    rp_safe = torch.where(live, rp, 0)
    pl = prefix_lens.long().clamp(0, cols)
    ext = extend_seq_lens.long()
    ws = (pl - swa_window_size).clamp_min(0) if swa_window_size > 0 else torch.zeros_like(pl)
    if lanes is not None:
        ws = torch.maximum(ws, lanes.verify_from[:bs].clamp(0).minimum(pl))
        split, shift = lanes.branch_split[:bs], lanes.branch_shift[:bs]
    else:
        split = shift = torch.zeros_like(pl)

    def col(q, r_split, r_shift):
        """The req_to_token column of position q (in range: sglang wrote it)."""
        return (q + torch.where(q >= r_split, r_shift, 0)).clamp(0, max(cols - 1, 0))

    vcount = torch.where(live, pl - ws, 0)
    wcount = torch.where(live & (ext > 0), ext, 0)

    zero = torch.zeros(1, dtype=torch.int64, device=device)
    wp.verify_req_offsets.zero_()
    wp.verify_req_offsets[: bs + 1] = torch.cat([zero, vcount.cumsum(0)])
    wp.write_offsets.zero_()
    wp.write_offsets[: bs + 1] = torch.cat([zero, wcount.cumsum(0)])
    has_seed = live & (pl > 0)
    seed = (
        req_to_token[rp_safe, col((pl - 1).clamp_min(0), split, shift)].long()
        if cols
        else torch.zeros_like(pl)
    )
    seed = translate_slots_torch(lut, seed)
    wp.write_seed_slot_indices.fill_(NO_SEED_SLOT)
    wp.write_seed_slot_indices[:bs] = torch.where(has_seed, seed, NO_SEED_SLOT)
    wp.write_req_to_token_rows.fill_(NO_REQ_TO_TOKEN_ROW)
    wp.write_req_to_token_rows[:bs] = torch.where(live, rp, NO_REQ_TO_TOKEN_ROW)
    wp.write_num_valid_reqs.fill_(bs)

    total = int(vcount.sum().item())
    enable = total <= verify_capacity
    vp.enable.fill_(int(enable))
    vp.verify_num_valid.fill_(total if enable else verify_capacity)
    if not enable or total == 0:
        return
    req = torch.repeat_interleave(torch.arange(bs, device=device), vcount)
    starts = wp.verify_req_offsets[:bs]
    p = ws[req] + torch.arange(total, device=device) - starts[req]
    row = rp_safe[req]
    slot = translate_slots_torch(lut, req_to_token[row, col(p, split[req], shift[req])].long())
    has_prev = p > 0
    prev_col = col((p - 1).clamp_min(0), split[req], shift[req])
    prev = translate_slots_torch(lut, req_to_token[row, prev_col].long())
    prev = torch.where(has_prev, prev, NO_PREV_SLOT)
    if req_to_verify_expected_tokens is not None:
        exp = req_to_verify_expected_tokens
        idx = p + kv_token_id_vs_position_offset
        vl = req_to_verify_expected_tokens_valid_lens.long()[req]
        ok = (idx >= 0) & (idx < vl) & (idx < exp.shape[1]) & (row < exp.shape[0])
        gathered = (
            exp[
                row.clamp(0, max(exp.shape[0] - 1, 0)), idx.clamp(0, max(exp.shape[1] - 1, 0))
            ].long()
            if exp.numel()
            else torch.zeros_like(idx)
        )
        tok = torch.where(ok, gathered, NO_EXPECTED_TOKEN)
    else:
        tok = torch.full_like(p, NO_EXPECTED_TOKEN)
    vp.verify_slot_indices[:total] = slot
    vp.verify_expected_tokens[:total] = tok
    vp.verify_expected_positions[:total] = p
    vp.verify_prev_slot_indices[:total] = prev
    vp.verify_req_to_token_rows[:total] = row
