"""The chain part of the write kernel, as Triton device functions (docs/chain_scan_design.md):
a request's chain steps ``SBLOCK`` at a time, each block's composed chain steps computed by one
parallel scan (a step is the affine map ``x -> x * CHAIN_MUL + e(token, position)``), or the
single steps of a block of one-step requests (decode) side by side, a lane each; each buffer's
records stored from its own chain state and its failed steps' ring rows appended. Called by
``write._canary_write_kernel`` (:func:`load_expected` also by ``_tree_triton``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary import _hash_triton as H
from sglang.jit_kernel.kv_canary._kernel_consts import (
    CHAIN_MUL,
    CHAIN_MUL_INV,
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


@triton.jit
def _affine(a1, b1, a2, b2):
    """Two chain steps ``x -> x * a + b`` composed, the first one first."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def seed_state(canary_ptr, seed, seed_ok, head):
    """A buffer's chain state before a request's first new step and the position it follows:
    ``H(record[seed])`` and the seed record's position, or ``head`` and 0 without a seed
    (scalars: u64, int64)."""
    state = tl.where(seed_ok, H.record_hash(canary_ptr, seed, seed_ok), head)
    pos = tl.load(canary_ptr + seed * RECORD_WORDS + FIELD_POSITION, mask=seed_ok, other=0)
    return state, pos


@triton.jit
def load_expected(exp_tok_ptr, exp_pos_ptr, i, act, tok, pos, INPUT_ASSERT: tl.constexpr):
    """Each step's expected token and position (int64 lanes like ``tok`` / ``pos``): loaded at
    ``i`` where ``act`` with the write's input assert, the actual ones without."""
    if INPUT_ASSERT:
        exp_tok = tl.load(exp_tok_ptr + i, mask=act, other=0).to(tl.int64)
        exp_pos = tl.load(exp_pos_ptr + i, mask=act, other=0).to(tl.int64)
    else:
        exp_tok = tok
        exp_pos = pos
    return exp_tok, exp_pos


@triton.jit
def _steps(tok, pos, act):
    """Each step's map ``x -> x * mul + key``: ``(CHAIN_MUL, e(tok, pos))``, the identity
    ``(1, 0)`` where inactive (u64 lanes)."""
    key = tl.where(act, H.chain_key(H.as_u64(tok), H.as_u64(pos)), 0)
    mul = tl.where(act, tl.full([], CHAIN_MUL, tl.uint64), tl.full([], 1, tl.uint64))
    return mul, key


@triton.jit
def single_steps(tok, pos, act):
    """:func:`scan_block`'s outputs for lanes that are each a whole request's one step (no
    scan): per lane ``(a, b)`` of its step (the identity where inactive), its key, and the
    same ``(a, b)`` as the "block's" step (lanes, not a scalar)."""
    mul, key = _steps(tok, pos, act)
    return mul, key, key, mul, key


@triton.jit
def scan_block(tok, pos, act):
    """One block's steps composed from its first: per step ``(a, b)`` such that the state after
    it is ``state_before_block * a + b`` (inactive steps are the identity), each step's key
    ``e(tok, pos)`` (0 where inactive), and the whole block's ``(a, b)`` (u64 scalars: past a
    request's last step the steps are the identity, so the block's last element is the state
    after its last active step)."""
    mul, key = _steps(tok, pos, act)
    a, b = tl.associative_scan((mul, key), 0, _affine)
    last = tl.arange(0, a.shape[0]) == a.shape[0] - 1
    return a, b, key, tl.sum(tl.where(last, a, 0), axis=0), tl.sum(tl.where(last, b, 0), axis=0)


@triton.jit
def store_block(
    canary_ptr,
    state,
    seed_pos,
    a,
    b,
    key,
    a_block,
    b_block,
    tok,
    pos,
    slot,
    exp_tok,
    exp_pos,
    before,
    use_before,
    store_ok,
    check_pos,
    ring_ptr,
    ring_index_ptr,
    ring_capacity,
    kernel_kind,
    req_row,
    NUM_SOURCES: tl.constexpr,
):
    """One buffer's records of a block: each step stores ``(tok, pos, state before it[, 0])``
    where ``store_ok``; a step failing the input check (``exp_*``: the expected token and
    position, or the actual ones) or, with ``check_pos``, the chain-position check (position =
    the previous step's, the seed record's for the first: ``before`` / ``use_before``) appends
    its ring row. ``a_block`` / ``b_block``: the whole block's step (:func:`scan_block`), or
    each lane's own (:func:`single_steps`: ``state``, ``seed_pos``, ``check_pos`` and
    ``req_row`` are then lanes too). Returns the state after the block (u64, ``state``'s
    shape)."""
    after = state * a + b
    prev = (after - key) * CHAIN_MUL_INV  # the state before each step: its prev_hash
    expected_pos = tl.where(use_before, before, seed_pos) + 1
    chain_bad = check_pos & (pos != expected_pos)
    bits = tl.where(tok != exp_tok, FAIL_WRITE_TOKEN, 0)
    bits |= tl.where((pos != exp_pos) | chain_bad, FAIL_WRITE_POSITION, 0)
    bad = store_ok & (bits != 0)
    rec = canary_ptr + slot * RECORD_WORDS
    tl.store(rec + FIELD_TOKEN, tok, mask=store_ok)
    tl.store(rec + FIELD_POSITION, pos, mask=store_ok)
    tl.store(rec + FIELD_PREV_HASH, H.as_i64(prev), mask=store_ok)
    if NUM_SOURCES == 0:
        tl.store(rec + FIELD_REAL_KV_HASH, tl.zeros_like(tok), mask=store_ok)
    if tl.max(bad.to(tl.int32), axis=0) != 0:
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
            H.as_i64(prev),
            tl.where(chain_bad, expected_pos, exp_pos),
            bits.to(tl.int64),
            pos,
            req_row,
            NO_KV_LAYER,
        )
    return state * a_block + b_block
