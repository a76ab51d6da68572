"""Canary write kernels (docs/architecture.md, "Write"; the chain part: docs/architecture.md,
"One forward", and docs/chain_scan_design.md).

``launch_canary_write_kernel`` stores a fresh record for every slot a forward writes: token,
position, the request's chain hash before it and (TAIL) the real-KV fingerprint; one part of
the grid takes the requests' chains (one-step requests side by side, a lane each; a longer
request in a program of its own, a block of steps at a time, one parallel scan per block), the
other fingerprints all written slots in parallel.
``launch_canary_chain_writes`` writes the chains of up to four buffers of one pool group in one
launch (the buffers share each block's scan); the block's device functions are
:mod:`~sglang.jit_kernel.kv_canary._chain_triton`. Graph-safe on CUDA. :class:`WriteParts` and
:class:`WritePlan` live in :mod:`~sglang.jit_kernel.kv_canary.types` (no Triton); they are
re-exported here.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary import _hash_triton as H
from sglang.jit_kernel.kv_canary import validation, write_ref
from sglang.jit_kernel.kv_canary._kernel_consts import (
    FIELD_REAL_KV_HASH,
    RECORD_WORDS,
)
from sglang.jit_kernel.kv_canary._chain_triton import (
    load_expected,
    scan_block,
    seed_state,
    single_steps,
    store_block,
)
from sglang.jit_kernel.kv_canary._tree_triton import tree_write_kernel
from sglang.jit_kernel.kv_canary._launch import grid_size, use_triton
from sglang.jit_kernel.kv_canary.types import VerifyOrWriteContext, WriteTree

# Re-exports from ``types``, kept for the documented import paths
# (``from sglang.jit_kernel.kv_canary.write import WritePlan`` etc.).
from sglang.jit_kernel.kv_canary.types import WriteParts, WritePlan  # noqa: F401

__all__ = [
    "MAX_CHAIN_WRITE_BUFFERS",
    "WriteParts",
    "WritePlan",
    "launch_canary_chain_writes",
    "launch_canary_write_kernel",
]


@triton.jit
def _canary_write_kernel(
    c0_ptr,
    c1_ptr,
    c2_ptr,
    c3_ptr,
    num_slots,
    offsets_ptr,
    seeds_ptr,
    rows_ptr,
    num_reqs_ptr,
    req_capacity,
    input_ids_ptr,
    positions_ptr,
    loc_ptr,
    num_tokens,
    exp_tok_ptr,
    exp_pos_ptr,
    chain_assert_ptr,
    ring_ptr,
    ring_index_ptr,
    ring_capacity,
    sc0_ptr,
    sc1_ptr,
    sc2_ptr,
    sc3_ptr,
    kc0_ptr,
    kc1_ptr,
    kc2_ptr,
    kc3_ptr,
    kind0,
    kind1,
    kind2,
    kind3,
    src_desc_ptr,
    num_chain_programs,
    INPUT_ASSERT: tl.constexpr,
    NUM_SOURCES: tl.constexpr,
    NUM_BUFS: tl.constexpr,
    SBLOCK: tl.constexpr,
    RBLOCK: tl.constexpr,
    FBLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_reqs = tl.minimum(tl.maximum(tl.load(num_reqs_ptr), 0), req_capacity)
    if pid < num_chain_programs:
        # ---- the chains: kernel counters once per launch ----
        if pid == 0:
            tl.atomic_add(kc0_ptr, 1)
            if NUM_BUFS > 1:
                tl.atomic_add(kc1_ptr, 1)
            if NUM_BUFS > 2:
                tl.atomic_add(kc2_ptr, 1)
            if NUM_BUFS > 3:
                tl.atomic_add(kc3_ptr, 1)
        chain_assert_on = tl.load(chain_assert_ptr) == 1
        head = H.chain_head_hash()
        written = tl.zeros([], dtype=tl.int64)
        # ---- one-step requests (decode): RBLOCK side by side, a lane each, no scan ----
        lanes = tl.arange(0, RBLOCK)
        for rb in range(pid * RBLOCK, num_reqs, num_chain_programs * RBLOCK):
            r = rb + lanes
            live = r < num_reqs
            i = tl.load(offsets_ptr + r, mask=live, other=0)
            live &= tl.load(offsets_ptr + r + 1, mask=live, other=0) - i == 1
            seed = tl.load(seeds_ptr + r, mask=live, other=-1)
            req_row = tl.load(rows_ptr + r, mask=live, other=0)
            seed_ok = live & (seed >= 0) & (seed < num_slots)
            # slot 0 (an evicted SWA predecessor) holds no real record: no position to follow
            check_pos = seed_ok & (seed > 0) & chain_assert_on
            act = live & (i >= 0) & (i < num_tokens)
            tok = tl.load(input_ids_ptr + i, mask=act, other=0).to(tl.int64)
            pos = tl.load(positions_ptr + i, mask=act, other=0).to(tl.int64)
            slot = tl.load(loc_ptr + i, mask=act, other=-1).to(tl.int64)
            exp_tok, exp_pos = load_expected(
                exp_tok_ptr, exp_pos_ptr, i, act, tok, pos, INPUT_ASSERT
            )
            store_ok = act & (slot >= 0) & (slot < num_slots)
            written += tl.sum(store_ok.to(tl.int64), axis=0)
            a, b, key, a_blk, b_blk = single_steps(tok, pos, act)
            no_before = tl.zeros_like(pos)  # a request's first step follows its seed record
            step = (a, b, key, a_blk, b_blk, tok, pos, slot, exp_tok, exp_pos, no_before)
            flags = (no_before != 0, store_ok, check_pos, ring_ptr, ring_index_ptr, ring_capacity)
            st, sp = seed_state(c0_ptr, seed, seed_ok, head)
            store_block(c0_ptr, st, sp, *step, *flags, kind0, req_row, NUM_SOURCES)
            if NUM_BUFS > 1:
                st, sp = seed_state(c1_ptr, seed, seed_ok, head)
                store_block(c1_ptr, st, sp, *step, *flags, kind1, req_row, NUM_SOURCES)
            if NUM_BUFS > 2:
                st, sp = seed_state(c2_ptr, seed, seed_ok, head)
                store_block(c2_ptr, st, sp, *step, *flags, kind2, req_row, NUM_SOURCES)
            if NUM_BUFS > 3:
                st, sp = seed_state(c3_ptr, seed, seed_ok, head)
                store_block(c3_ptr, st, sp, *step, *flags, kind3, req_row, NUM_SOURCES)
        # ---- longer requests: one per program at a time, its steps SBLOCK at a time (one
        # scan composes a block's steps); the NUM_BUFS buffers share the scan, each from its
        # own seed record's state ----
        idx = tl.arange(0, SBLOCK)
        for r in range(pid, num_reqs, num_chain_programs):
            start = tl.load(offsets_ptr + r)
            length = tl.maximum(tl.load(offsets_ptr + r + 1) - start, 0)
            if length > 1:
                seed = tl.load(seeds_ptr + r)
                req_row = tl.load(rows_ptr + r)
                seed_ok = (seed >= 0) & (seed < num_slots)
                check_pos = seed_ok & (seed > 0) & chain_assert_on
                st0, sp0 = seed_state(c0_ptr, seed, seed_ok, head)
                st1, sp1, st2, sp2, st3, sp3 = st0, sp0, st0, sp0, st0, sp0  # not launched
                if NUM_BUFS > 1:
                    st1, sp1 = seed_state(c1_ptr, seed, seed_ok, head)
                if NUM_BUFS > 2:
                    st2, sp2 = seed_state(c2_ptr, seed, seed_ok, head)
                if NUM_BUFS > 3:
                    st3, sp3 = seed_state(c3_ptr, seed, seed_ok, head)
                for jb in range(0, length, SBLOCK):
                    j = jb + idx
                    i = start + j
                    act = (j < length) & (i >= 0) & (i < num_tokens)
                    tok = tl.load(input_ids_ptr + i, mask=act, other=0).to(tl.int64)
                    pos = tl.load(positions_ptr + i, mask=act, other=0).to(tl.int64)
                    slot = tl.load(loc_ptr + i, mask=act, other=-1).to(tl.int64)
                    # the step before (its position; before the first, the seed record's)
                    use_before = act & (j > 0) & (i > 0)
                    before = tl.load(positions_ptr + i - 1, mask=use_before, other=0).to(tl.int64)
                    exp_tok, exp_pos = load_expected(
                        exp_tok_ptr, exp_pos_ptr, i, act, tok, pos, INPUT_ASSERT
                    )
                    store_ok = act & (slot >= 0) & (slot < num_slots)
                    written += tl.sum(store_ok.to(tl.int64), axis=0)
                    a, b, key, a_blk, b_blk = scan_block(tok, pos, act)
                    step = (a, b, key, a_blk, b_blk, tok, pos, slot, exp_tok, exp_pos, before)
                    flags = (
                        use_before,
                        store_ok,
                        check_pos,
                        ring_ptr,
                        ring_index_ptr,
                        ring_capacity,
                    )
                    st0 = store_block(c0_ptr, st0, sp0, *step, *flags, kind0, req_row, NUM_SOURCES)
                    if NUM_BUFS > 1:
                        st1 = store_block(
                            c1_ptr, st1, sp1, *step, *flags, kind1, req_row, NUM_SOURCES
                        )
                    if NUM_BUFS > 2:
                        st2 = store_block(
                            c2_ptr, st2, sp2, *step, *flags, kind2, req_row, NUM_SOURCES
                        )
                    if NUM_BUFS > 3:
                        st3 = store_block(
                            c3_ptr, st3, sp3, *step, *flags, kind3, req_row, NUM_SOURCES
                        )
        tl.atomic_add(sc0_ptr, written)
        if NUM_BUFS > 1:
            tl.atomic_add(sc1_ptr, written)
        if NUM_BUFS > 2:
            tl.atomic_add(sc2_ptr, written)
        if NUM_BUFS > 3:
            tl.atomic_add(sc3_ptr, written)
    else:
        # ---- real-KV fingerprints of every written slot, in parallel ----
        if NUM_SOURCES > 0:
            fpid = pid - num_chain_programs
            nfp = tl.num_programs(0) - num_chain_programs
            total = tl.minimum(tl.maximum(tl.load(offsets_ptr + num_reqs), 0), num_tokens)
            for fstart in range(fpid * FBLOCK, total, nfp * FBLOCK):
                i = fstart + tl.arange(0, FBLOCK)
                m = i < total
                slot = tl.load(loc_ptr + i, mask=m, other=-1).to(tl.int64)
                ok = m & (slot >= 0) & (slot < num_slots)
                fp = H.real_kv_fingerprint(slot, ok, src_desc_ptr, NUM_SOURCES)
                tl.store(c0_ptr + slot * RECORD_WORDS + FIELD_REAL_KV_HASH, H.as_i64(fp), mask=ok)


# the chain part's tiles: a request of several steps takes them a block at a time, a power of
# two from CHAIN_MIN_BLOCK to CHAIN_MAX_BLOCK (the launch's tokens rounded up: its requests'
# lengths are known only on the device, and the eager graphs are captured once for every
# batch), a warp per 32 steps up to CHAIN_MAX_WARPS; one-step requests (decode)
# CHAIN_STEP_LANES at a time, a lane each
CHAIN_MIN_BLOCK = 16
CHAIN_MAX_BLOCK = 1024
CHAIN_MAX_WARPS = 4
CHAIN_STEP_LANES = 128
MAX_CHAIN_WRITE_BUFFERS = 4  # the kernel's buffer arguments (a group's K/V x HEAD/TAIL)
WRITE_FINGERPRINT_BLOCK = 128


def launch_canary_write_kernel(
    *,
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: Optional[torch.Tensor],
    expected_input_positions: Optional[torch.Tensor],
    parts: WriteParts = WriteParts.ALL,
    tree: Optional[WriteTree] = None,
) -> None:
    """Write the canary records of this forward's new KV slots (``parts``: all of it, or only
    the chain / only the fingerprints, see :class:`WriteParts`).

    ``input_ids`` / ``positions`` / ``out_cache_loc``: int32 or int64 ``[num_tokens]``, laid out
    as ``plan.write_offsets`` says (SWA callers pass translated slots). Per live request,
    serially, from ``running = H(record[seed])`` or ``H(none)``: a slot < 0 is skipped (no store,
    no check; the chain still advances); else store ``(token, position, running, fingerprint)``
    and advance ``running = H(record)`` (an affine step of the state: docs/chain_scan_design.md). Checks: token / position against
    ``expected_input_*`` (``enable_write_input_assert``) and, with a real seed (``seed > 0``) and
    ``context.enable_chain_position_assert == 1``, position == previous + 1 (from the seed's).
    Violation rows (docs/architecture.md, "Record format"): ``expected_token`` is
    ``expected_input_tokens[i]`` with the input assert, else the token; ``stored_chain_hash`` the
    running hash, ``expected_aux`` the expected position. Counters: kernel +1, slot + entries
    stored. With a ``tree`` (:class:`WriteTree`: a draft tree's target verify) each entry is
    chained from its tree path instead (the seed, then its ancestors root first), its position
    checked against its parent's, all entries in parallel (``_tree_triton``).
    """
    inputs = dict(
        plan=plan,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        enable_write_input_assert=enable_write_input_assert,
        expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions,
    )
    validation.validate_write_args(context=context, parts=parts, tree=tree, **inputs)
    if not use_triton(context.device):
        return write_ref.run_canary_write_reference(
            context=context, parts=parts, tree=tree, **inputs
        )
    num_tokens = input_ids.shape[0]
    num_sources = len(context.real_kv_sources) if context.fingerprint_mode else 0
    n_chain = chain_programs(context.device, plan, num_tokens)
    n_fp = grid_size(context.device, num_tokens, WRITE_FINGERPRINT_BLOCK) if num_sources else 0
    if parts == WriteParts.CHAIN:
        num_sources, n_fp = 0, 0  # the chain part then stores real_kv_hash = 0
    elif parts == WriteParts.FINGERPRINT:
        if not n_fp:
            return
        n_chain = 0
    if tree is not None and n_chain:
        _launch_tree([context], tree, inputs, zero_fp=num_sources == 0)
        if not n_fp:
            return
        n_chain = 0
    _launch([context], inputs, num_sources=num_sources, n_chain=n_chain, n_fp=n_fp)


def launch_canary_chain_writes(
    *,
    contexts: Sequence[VerifyOrWriteContext],
    plan: WritePlan,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: Optional[torch.Tensor],
    expected_input_positions: Optional[torch.Tensor],
    tree: Optional[WriteTree] = None,
) -> None:
    """The chain part (:attr:`WriteParts.CHAIN`) of :func:`launch_canary_write_kernel` for up
    to ``MAX_CHAIN_WRITE_BUFFERS`` canary buffers of one pool group at once, byte for byte what
    one launch per context writes (violation rows may come in another order; a slot written by
    several steps of the launch holds one of those writes). One launch: each request's
    buffers share its lanes and each block's scan, each buffer from its own seed record.
    The contexts must be distinct buffers of one pool (same
    slot count) sharing one violation ring and chain-position flag. Graph-safe on CUDA."""
    contexts = list(contexts)
    if not 1 <= len(contexts) <= MAX_CHAIN_WRITE_BUFFERS:
        raise ValueError(
            f"launch_canary_chain_writes takes 1 to {MAX_CHAIN_WRITE_BUFFERS} "
            f"contexts, got {len(contexts)}"
        )
    inputs = dict(
        plan=plan,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        enable_write_input_assert=enable_write_input_assert,
        expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions,
    )
    for c in contexts:
        validation.validate_write_args(context=c, parts=WriteParts.CHAIN, tree=tree, **inputs)
    first = contexts[0]
    for name in ("violation_ring", "violation_write_index", "enable_chain_position_assert"):
        if any(getattr(c, name) is not getattr(first, name) for c in contexts[1:]):
            raise ValueError(f"launch_canary_chain_writes: the contexts must share one {name}")
    if any(c.num_slots != first.num_slots for c in contexts):
        raise ValueError(
            "launch_canary_chain_writes: the contexts' buffers must have the same "
            f"slot count, got {[c.num_slots for c in contexts]}"
        )
    if len({c.canary_buf.data_ptr() for c in contexts}) != len(contexts):
        raise ValueError(
            "launch_canary_chain_writes: the contexts must write distinct canary buffers"
        )
    if not use_triton(first.device):
        for c in contexts:
            write_ref.run_canary_write_reference(
                context=c, parts=WriteParts.CHAIN, tree=tree, **inputs
            )
        return
    if tree is not None:
        _launch_tree(contexts, tree, inputs, zero_fp=True)
        return
    n_chain = chain_programs(first.device, plan, input_ids.shape[0])
    _launch(contexts, inputs, num_sources=0, n_chain=n_chain, n_fp=0)


def _write_args(
    contexts,
    *,
    plan,
    input_ids,
    positions,
    out_cache_loc,
    enable_write_input_assert,
    expected_input_tokens,
    expected_input_positions,
) -> tuple:
    """The arguments both write kernels take first, in their order: the (padded) contexts'
    buffers, the plan, the forward's inputs and expected inputs, the chain-position flag, the
    ring, and the contexts' counters and kinds."""
    context = contexts[0]
    padded = contexts + [context] * (MAX_CHAIN_WRITE_BUFFERS - len(contexts))
    if enable_write_input_assert:
        exp_tok, exp_pos = expected_input_tokens, expected_input_positions
    else:  # never dereferenced: INPUT_ASSERT is a constexpr
        exp_tok, exp_pos = input_ids, positions
    return (
        *(c.canary_words for c in padded),
        context.num_slots,
        plan.write_offsets,
        plan.write_seed_slot_indices,
        plan.write_req_to_token_rows,
        plan.write_num_valid_reqs,
        plan.req_capacity,
        input_ids,
        positions,
        out_cache_loc,
        input_ids.shape[0],
        exp_tok,
        exp_pos,
        context.enable_chain_position_assert,
        context.violation_ring,
        context.violation_write_index,
        context.ring_capacity,
        *(c.slot_run_counter for c in padded),
        *(c.kernel_run_counter for c in padded),
        *(int(c.kernel_kind) for c in padded),
    )


def _launch(contexts, inputs: dict, *, num_sources, n_chain, n_fp):
    """One write launch on validated arguments (``inputs``: the keyword arguments of
    :func:`_write_args`): the chain part for every context (``n_chain`` programs; the contexts
    share each request's lanes and scans), the fingerprint part (``n_fp`` programs) for the
    first."""
    sblock = chain_block(inputs["input_ids"].shape[0])
    _canary_write_kernel[(n_chain + n_fp,)](
        *_write_args(contexts, **inputs),
        contexts[0].source_descriptors,
        n_chain,
        INPUT_ASSERT=inputs["enable_write_input_assert"],
        NUM_SOURCES=num_sources,
        NUM_BUFS=len(contexts),
        SBLOCK=sblock,
        RBLOCK=CHAIN_STEP_LANES,
        FBLOCK=WRITE_FINGERPRINT_BLOCK,
        num_warps=max(min(sblock // 32, CHAIN_MAX_WARPS), 1) if n_fp == 0 else 4,
    )


def chain_programs(device: torch.device, plan: WritePlan, num_tokens: int) -> int:
    """Programs of the chain part (and of a tree write) for a launch of ``num_tokens`` tokens
    (its capacity, host-known) over ``plan``: a request with work has one of them, so at most
    ``min(plan.req_capacity, num_tokens)`` requests have any (a decode graph captured for 32
    requests gets 32 programs, not one per row of a ``--max-running-requests`` plan). The loops
    are grid-stride: any count writes the same records."""
    return grid_size(device, min(plan.req_capacity, num_tokens), 1)


def chain_block(num_tokens: int) -> int:
    """The chain part's steps per block of a request for a launch of ``num_tokens`` tokens
    (its capacity, host-known)."""
    return max(CHAIN_MIN_BLOCK, min(CHAIN_MAX_BLOCK, triton.next_power_of_2(max(num_tokens, 1))))


TREE_ENTRY_BLOCK = 32  # entries of one request a tree-write program walks at once


def _launch_tree(contexts, tree, inputs: dict, *, zero_fp):
    """The chain part over a draft tree on validated arguments (``inputs``: the keyword
    arguments of :func:`_write_args`): one program per request (grid-stride), one grid column
    per context."""
    n_prog = chain_programs(contexts[0].device, inputs["plan"], inputs["input_ids"].shape[0])
    tree_write_kernel[(n_prog, len(contexts))](
        *_write_args(contexts, **inputs),
        tree.parent,
        INPUT_ASSERT=inputs["enable_write_input_assert"],
        ZERO_FP=zero_fp,
        MAX_DEPTH=tree.max_depth,
        TBLOCK=TREE_ENTRY_BLOCK,
        num_warps=1,
    )
