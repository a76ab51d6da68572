"""Torch reference of the write kernel (the oracle, and the CPU serving path).

Same signature and semantics as :func:`~sglang.jit_kernel.kv_canary.write.launch_canary_write_kernel`.
Loops over chain steps (vectorised over requests), then fingerprints all written slots at once.
Host-synchronous; not for CUDA-graph capture. ``launch_canary_write_kernel_torch_reference``
validates its arguments once, then runs :func:`run_canary_write_reference`, which the public
launcher's CPU path calls directly (it has validated already).
"""

from __future__ import annotations

import functools

import torch

from sglang.jit_kernel.kv_canary import validation
from sglang.jit_kernel.kv_canary._hash_torch import (
    CHAIN_HEAD_HASH_I64,
    chain_step_t,
    real_kv_fingerprint_t,
    record_hash_t,
)
from sglang.jit_kernel.kv_canary._ring_torch import append_violation_rows, violation_rows
from sglang.jit_kernel.kv_canary.consts import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    TREE_PARENT_ORPHAN,
    TREE_PARENT_SEED,
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
    tree=None,
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
        tree=tree,
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
    tree=None,
) -> None:
    """The write reference on already validated arguments (the launcher's CPU path); with a
    ``tree`` (:class:`~sglang.jit_kernel.kv_canary.types.WriteTree`) the chain part follows
    each entry's tree path (:func:`_tree_chain`)."""
    records = context.canary_words
    num_slots = context.num_slots
    num_tokens = input_ids.shape[0]
    nreq = min(max(int(plan.write_num_valid_reqs[0].item()), 0), plan.req_capacity)
    offsets = plan.write_offsets[: nreq + 1]
    if parts != WriteParts.FINGERPRINT:
        (_chain if tree is None else functools.partial(_tree_chain, tree=tree))(
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
        written += _store(records, ok, slot, tok, pos, running, zero_fp)
        bits, exp_tok, exp_pos = _input_check(
            tok,
            pos,
            ia,
            expected_input_tokens if enable_write_input_assert else None,
            expected_input_positions,
        )
        chain_bad = check_pos & (pos != prev_pos + 1)
        bits |= chain_bad.long() * FailReason.WRITE_POSITION_MISMATCH
        exp_pos = torch.where(chain_bad, prev_pos + 1, exp_pos)
        _append(
            context, ok & (bits != 0), slot, pos, tok, exp_tok, running, exp_pos, bits, req_rows
        )
        running = torch.where(act, chain_step_t(running, tok, pos), running)
        prev_pos = torch.where(act, pos, prev_pos)
    context.slot_run_counter.add_(written)


# an entry's walk up its tree path (:func:`_tree_chain`)
_WALKING, _ROOTED, _ORPHAN, _BAD_LINK = 0, 1, 2, 3


def _tree_chain(
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
    tree,
):
    """The chain part over a draft tree (docs/speculative_trees.md, "3. Record semantics for
    tree tokens"): each entry's record is chained from its tree path (the request's seed, then
    its ancestors root first), its position checked against its parent's; an orphan (itself
    or an ancestor ``TREE_PARENT_ORPHAN``) is skipped; a bad link (a parent index not smaller
    than its child's, or a path of more than ``tree.max_depth`` entries) is reported
    (``WRITE_POSITION_MISMATCH``, expected position -1) and not stored. Vectorised over a
    request's entries, one request at a time."""
    context.kernel_run_counter.add_(1)
    records = context.canary_words
    num_slots = context.num_slots
    num_tokens = input_ids.shape[0]
    chain_assert = int(context.enable_chain_position_assert[0].item()) == 1
    depth_bound = tree.max_depth
    written = 0
    for r in range(nreq):
        start = int(offsets[r].item())
        length = min(max(int(offsets[r + 1].item()) - start, 0), max(num_tokens - start, 0))
        if start < 0 or length == 0:
            continue
        seed = int(plan.write_seed_slot_indices[r].item())
        seed_ok = 0 <= seed < num_slots
        g = torch.arange(start, start + length, device=input_ids.device)
        tok, pos = input_ids[g].long(), positions[g].long()
        slot = out_cache_loc[g].long()
        parent = tree.parent[g]
        local = torch.arange(length, device=g.device)

        def parent_of(i):
            return parent[i.clamp(0, length - 1)]

        # walk up: depth = entries on the path from the seed to the entry, itself included
        status = torch.full_like(local, _WALKING)
        cur, depth = local.clone(), torch.ones_like(local)
        for _ in range(depth_bound):
            p = parent_of(cur)
            walking = status == _WALKING
            status = torch.where(walking & (p == TREE_PARENT_SEED), _ROOTED, status)
            status = torch.where(walking & (p == TREE_PARENT_ORPHAN), _ORPHAN, status)
            status = torch.where(
                walking & ((p < TREE_PARENT_ORPHAN) | (p >= cur)), _BAD_LINK, status
            )
            step = walking & (p >= 0) & (p < cur)
            cur = torch.where(step, p, cur)
            depth = depth + step.long()
        status = torch.where(status == _WALKING, _BAD_LINK, status)  # deeper than the bound
        rooted = status == _ROOTED

        seed_hash = record_hash_t(records[seed : seed + 1])[0] if seed_ok else CHAIN_HEAD_HASH_I64
        running = torch.full_like(local, int(seed_hash))
        for level in range(depth_bound - 1):  # the ancestor `level` entries below the root
            anc = local.clone()
            for hop in range(depth_bound):
                anc = torch.where(hop < depth - 1 - level, parent_of(anc), anc)
            fold = rooted & (level < depth - 1)
            running = torch.where(fold, chain_step_t(running, tok[anc], pos[anc]), running)
        seed_pos = int(records[seed, CANARY_FIELD_POSITION].item()) if seed_ok else 0
        has_parent = rooted & (depth > 1)
        prev_pos = torch.where(has_parent, pos[parent_of(local).clamp_min(0)], seed_pos)

        in_range = (slot >= 0) & (slot < num_slots)
        bits, exp_tok, exp_pos = _input_check(
            tok,
            pos,
            g,
            expected_input_tokens if enable_write_input_assert else None,
            expected_input_positions,
        )
        check_pos = seed_ok and seed > 0 and chain_assert
        chain_bad = rooted & check_pos & (pos != prev_pos + 1)
        bad_link = status == _BAD_LINK
        bits |= (chain_bad | bad_link).long() * FailReason.WRITE_POSITION_MISMATCH
        exp_pos = torch.where(chain_bad, prev_pos + 1, exp_pos)
        exp_pos = torch.where(bad_link, -1, exp_pos)

        written += _store(records, rooted & in_range, slot, tok, pos, running, zero_fp)
        bad = (rooted | bad_link) & in_range & (bits != 0)
        rows = plan.write_req_to_token_rows[r].expand(length)
        _append(context, bad, slot, pos, tok, exp_tok, running, exp_pos, bits, rows)
    context.slot_run_counter.add_(written)


def _store(records, mask, slot, tok, pos, running, zero_fp) -> int:
    """Store the records of the entries ``mask`` selects (``real_kv_hash`` 0 when
    ``zero_fp``); returns how many."""
    s = slot[mask]
    records[s, CANARY_FIELD_TOKEN] = tok[mask]
    records[s, CANARY_FIELD_POSITION] = pos[mask]
    records[s, CANARY_FIELD_PREV_HASH] = running[mask]
    if zero_fp:
        records[s, CANARY_FIELD_REAL_KV_HASH] = 0
    return int(mask.sum().item())


def _input_check(tok, pos, idx, expected_tokens, expected_positions):
    """The write-input check of the entries at ``idx`` (``expected_tokens`` None: off):
    ``(fail bits, expected token, expected position)``."""
    bits = torch.zeros_like(tok)
    if expected_tokens is None:
        return bits, tok, pos
    exp_tok = expected_tokens[idx].long()
    exp_pos = expected_positions[idx].long()
    bits |= (tok != exp_tok).long() * FailReason.WRITE_TOKEN_MISMATCH
    bits |= (pos != exp_pos).long() * FailReason.WRITE_POSITION_MISMATCH
    return bits, exp_tok, exp_pos


def _append(context, bad, slot, pos, tok, exp_tok, running, exp_pos, bits, req_rows) -> None:
    """The violation rows of the entries ``bad`` selects (read position: their own)."""
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
