"""The chain walk of the write kernel, as Triton device functions (docs/architecture.md, "One
forward"): :func:`chain_walk` walks every lane's chain (lanes = request x buffer) in blocks of
``CHAIN_UNROLL`` steps, storing and checking each step's record and, on a second walk, appending
the failed steps' violation rows. Called by ``write._canary_write_kernel`` only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary import _hash_triton as H
from sglang.jit_kernel.kv_canary._kernel_consts import (
    FAIL_WRITE_POSITION,
    FAIL_WRITE_TOKEN,
    FIELD_POSITION,
    FIELD_PREV_HASH,
    FIELD_REAL_KV_HASH,
    FIELD_TOKEN,
    NO_KV_LAYER,
    RECORD_WORDS,
)
from sglang.jit_kernel.kv_canary._ring_triton import append_violations

CHAIN_UNROLL = tl.constexpr(4)  # chain steps per block of the walk (the loop is written for 4)


@triton.jit
def _load_step(
    input_ids_ptr,
    positions_ptr,
    loc_ptr,
    exp_tok_ptr,
    exp_pos_ptr,
    start,
    j,
    length,
    num_tokens,
    INPUT_ASSERT: tl.constexpr,
):
    """Chain step ``j``'s token, position, slot and (``INPUT_ASSERT``) expected token and
    position per lane (int64; slot -1 where the lane has no step ``j``)."""
    i = start + j
    act = (j < length) & (i >= 0) & (i < num_tokens)
    tok = tl.load(input_ids_ptr + i, mask=act, other=0).to(tl.int64)
    pos = tl.load(positions_ptr + i, mask=act, other=0).to(tl.int64)
    slot = tl.load(loc_ptr + i, mask=act, other=-1).to(tl.int64)
    if INPUT_ASSERT:
        exp_tok = tl.load(exp_tok_ptr + i, mask=act, other=0).to(tl.int64)
        exp_pos = tl.load(exp_pos_ptr + i, mask=act, other=0).to(tl.int64)
    else:
        exp_tok = tok
        exp_pos = pos
    return tok, pos, slot, exp_tok, exp_pos


@triton.jit
def _chain_step(
    canary_ptr,
    num_slots,
    start,
    j,
    length,
    num_tokens,
    tok,
    pos,
    slot,
    exp_tok,
    exp_pos,
    running,
    prev_pos,
    written,
    failed,
    check_pos,
    ring_ptr,
    ring_index_ptr,
    ring_capacity,
    kernel_kind,
    req_row,
    NUM_SOURCES: tl.constexpr,
    REPORT: tl.constexpr,
):
    """Chain step ``j`` of every lane (a no-op where the lane has no step ``j``): check it,
    then store its record and note a failure in ``failed`` (``REPORT`` off) or append the
    failure's ring row (``REPORT`` on); advance ``running`` / ``prev_pos``."""
    i = start + j
    act = (j < length) & (i >= 0) & (i < num_tokens)
    store_ok = act & (slot >= 0) & (slot < num_slots)
    bits = tl.where(tok != exp_tok, FAIL_WRITE_TOKEN, 0)
    bits |= tl.where(pos != exp_pos, FAIL_WRITE_POSITION, 0)
    chain_bad = check_pos & (pos != prev_pos + 1)
    bits |= tl.where(chain_bad, FAIL_WRITE_POSITION, 0)
    exp_pos = tl.where(chain_bad, prev_pos + 1, exp_pos)
    bad = store_ok & (bits != 0)
    if REPORT:
        append_violations(
            ring_ptr,
            ring_index_ptr,
            ring_capacity,
            bad,
            kernel_kind,
            slot,
            pos,
            tok,
            exp_tok,
            H.as_i64(running),
            exp_pos,
            bits.to(tl.int64),
            pos,
            req_row,
            NO_KV_LAYER,
        )
    else:
        rec = canary_ptr + slot * RECORD_WORDS
        tl.store(rec + FIELD_TOKEN, tok, mask=store_ok)
        tl.store(rec + FIELD_POSITION, pos, mask=store_ok)
        tl.store(rec + FIELD_PREV_HASH, H.as_i64(running), mask=store_ok)
        if NUM_SOURCES == 0:
            tl.store(rec + FIELD_REAL_KV_HASH, tl.zeros_like(tok), mask=store_ok)
        written += store_ok.to(tl.int64)
        failed |= bad
    running = tl.where(act, H.mix3(running, H.as_u64(tok), H.as_u64(pos)), running)
    prev_pos = tl.where(act, pos, prev_pos)
    return running, prev_pos, written, failed


@triton.jit
def chain_walk(
    canary_ptr,
    num_slots,
    start,
    length,
    input_ids_ptr,
    positions_ptr,
    loc_ptr,
    num_tokens,
    exp_tok_ptr,
    exp_pos_ptr,
    running,
    prev_pos,
    check_pos,
    ring_ptr,
    ring_index_ptr,
    ring_capacity,
    kernel_kind,
    req_row,
    INPUT_ASSERT: tl.constexpr,
    NUM_SOURCES: tl.constexpr,
    REPORT: tl.constexpr,
):
    """Walk every lane's chain from ``running`` / ``prev_pos``, CHAIN_UNROLL steps a block (a
    block's inputs are loaded while the block before it is hashed, so the serial hash never
    waits on a load). ``REPORT`` off: store the records, return (entries stored, any step
    failed) per lane; on: store nothing, append the failed steps' ring rows."""
    written = tl.zeros_like(running).to(tl.int64)
    failed = tl.zeros_like(running) != 0
    a = (
        input_ids_ptr,
        positions_ptr,
        loc_ptr,
        exp_tok_ptr,
        exp_pos_ptr,
    )
    t0, p0, s0, e0, f0 = _load_step(*a, start, 0, length, num_tokens, INPUT_ASSERT)
    t1, p1, s1, e1, f1 = _load_step(*a, start, 1, length, num_tokens, INPUT_ASSERT)
    t2, p2, s2, e2, f2 = _load_step(*a, start, 2, length, num_tokens, INPUT_ASSERT)
    t3, p3, s3, e3, f3 = _load_step(*a, start, 3, length, num_tokens, INPUT_ASSERT)
    c = (ring_ptr, ring_index_ptr, ring_capacity, kernel_kind, req_row)
    for jb in range(0, tl.max(length, axis=0), CHAIN_UNROLL):
        n0, q0, m0, x0, y0 = _load_step(*a, start, jb + 4, length, num_tokens, INPUT_ASSERT)
        n1, q1, m1, x1, y1 = _load_step(*a, start, jb + 5, length, num_tokens, INPUT_ASSERT)
        n2, q2, m2, x2, y2 = _load_step(*a, start, jb + 6, length, num_tokens, INPUT_ASSERT)
        n3, q3, m3, x3, y3 = _load_step(*a, start, jb + 7, length, num_tokens, INPUT_ASSERT)
        running, prev_pos, written, failed = _chain_step(
            canary_ptr,
            num_slots,
            start,
            jb,
            length,
            num_tokens,
            t0,
            p0,
            s0,
            e0,
            f0,
            running,
            prev_pos,
            written,
            failed,
            check_pos,
            *c,
            NUM_SOURCES,
            REPORT,
        )
        running, prev_pos, written, failed = _chain_step(
            canary_ptr,
            num_slots,
            start,
            jb + 1,
            length,
            num_tokens,
            t1,
            p1,
            s1,
            e1,
            f1,
            running,
            prev_pos,
            written,
            failed,
            check_pos,
            *c,
            NUM_SOURCES,
            REPORT,
        )
        running, prev_pos, written, failed = _chain_step(
            canary_ptr,
            num_slots,
            start,
            jb + 2,
            length,
            num_tokens,
            t2,
            p2,
            s2,
            e2,
            f2,
            running,
            prev_pos,
            written,
            failed,
            check_pos,
            *c,
            NUM_SOURCES,
            REPORT,
        )
        running, prev_pos, written, failed = _chain_step(
            canary_ptr,
            num_slots,
            start,
            jb + 3,
            length,
            num_tokens,
            t3,
            p3,
            s3,
            e3,
            f3,
            running,
            prev_pos,
            written,
            failed,
            check_pos,
            *c,
            NUM_SOURCES,
            REPORT,
        )
        t0, p0, s0, e0, f0 = n0, q0, m0, x0, y0
        t1, p1, s1, e1, f1 = n1, q1, m1, x1, y1
        t2, p2, s2, e2, f2 = n2, q2, m2, x2, y2
        t3, p3, s3, e3, f3 = n3, q3, m3, x3, y3
    return written, failed
