"""The write kernel's chain part over a speculative draft tree (docs/speculative_trees.md,
"3. Record semantics for tree tokens"): one lane per entry, all in parallel. Each lane walks its
entry's path up to the request's seed (at most ``MAX_DEPTH`` entries), then folds the path's
(token, position) pairs root first into the seed's hash: the record a plain decode of the same
tokens would store. Launched by ``write.launch_canary_write_kernel`` /
``write.launch_canary_chain_writes`` when given a ``WriteTree``; graph-safe (no host work, the
depth bound a constexpr). The torch twin: ``write_ref._tree_chain``.
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
    TREE_PARENT_ORPHAN,
    TREE_PARENT_SEED,
)
from sglang.jit_kernel.kv_canary._chain_triton import load_expected
from sglang.jit_kernel.kv_canary._ring_triton import append_violations

# an entry's walk up its path: still walking, reached the seed, below an orphan, a bad link
_WALKING = tl.constexpr(0)
_ROOTED = tl.constexpr(1)
_ORPHAN = tl.constexpr(2)
_BAD_LINK = tl.constexpr(3)


@triton.jit
def _pick(b, v0, v1, v2, v3):
    """Buffer ``b``'s one of four per-buffer arguments."""
    return tl.where(b == 0, v0, tl.where(b == 1, v1, tl.where(b == 2, v2, v3)))


@triton.jit
def tree_write_kernel(
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
    parent_ptr,
    INPUT_ASSERT: tl.constexpr,
    ZERO_FP: tl.constexpr,
    MAX_DEPTH: tl.constexpr,
    TBLOCK: tl.constexpr,
):
    """Grid ``(programs, buffers)``: program ``pid`` takes requests ``pid, pid + programs, ...``
    in blocks of ``TBLOCK`` entries; axis 1 picks the canary buffer (its counters and kind)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    b = tl.program_id(1)
    canary_ptr = _pick(b, c0_ptr, c1_ptr, c2_ptr, c3_ptr)
    slot_counter = _pick(b, sc0_ptr, sc1_ptr, sc2_ptr, sc3_ptr)
    kernel_kind = _pick(b, kind0, kind1, kind2, kind3)
    if pid == 0:
        tl.atomic_add(_pick(b, kc0_ptr, kc1_ptr, kc2_ptr, kc3_ptr), 1)
    chain_assert_on = tl.load(chain_assert_ptr) == 1
    num_reqs = tl.minimum(tl.maximum(tl.load(num_reqs_ptr), 0), req_capacity)
    lane = tl.arange(0, TBLOCK)
    zero = tl.zeros([TBLOCK], dtype=tl.int64)
    written = zero
    for r in range(pid, num_reqs, nprog):
        start = tl.load(offsets_ptr + r)
        length = tl.maximum(tl.load(offsets_ptr + r + 1) - start, 0)
        seed = tl.load(seeds_ptr + r) + zero
        req_row = tl.load(rows_ptr + r) + zero
        seed_ok = (seed >= 0) & (seed < num_slots)
        seed_hash = tl.where(seed_ok, H.record_hash(canary_ptr, seed, seed_ok), H.chain_head_hash())
        seed_pos = tl.load(canary_ptr + seed * RECORD_WORDS + FIELD_POSITION, mask=seed_ok, other=0)
        check_pos = seed_ok & (seed > 0) & chain_assert_on
        for jb in range(0, length, TBLOCK):
            j = (jb + lane).to(tl.int64)
            g = start + j
            act = (j < length) & (g >= 0) & (g < num_tokens)
            tok = tl.load(input_ids_ptr + g, mask=act, other=0).to(tl.int64)
            pos = tl.load(positions_ptr + g, mask=act, other=0).to(tl.int64)
            slot = tl.load(loc_ptr + g, mask=act, other=-1).to(tl.int64)
            parent = tl.load(parent_ptr + g, mask=act, other=TREE_PARENT_ORPHAN)
            # walk up: depth = entries on the path from the seed to the entry, itself included
            status = tl.where(act, _WALKING, _ORPHAN)
            cur = j
            depth = zero + 1
            for _hop in range(MAX_DEPTH):
                walking = status == _WALKING
                p = tl.load(parent_ptr + start + cur, mask=walking, other=TREE_PARENT_SEED)
                status = tl.where(walking & (p == TREE_PARENT_SEED), _ROOTED, status)
                status = tl.where(walking & (p == TREE_PARENT_ORPHAN), _ORPHAN, status)
                status = tl.where(
                    walking & ((p < TREE_PARENT_ORPHAN) | (p >= cur)), _BAD_LINK, status
                )
                step = walking & (p >= 0) & (p < cur)
                cur = tl.where(step, p, cur)
                depth += step.to(tl.int64)
            status = tl.where(status == _WALKING, _BAD_LINK, status)  # deeper than the bound
            rooted = status == _ROOTED
            bad_link = status == _BAD_LINK
            # fold the path root first: the ancestor `level` entries below the root
            running = H.as_u64(seed_hash + zero)
            for level in range(MAX_DEPTH - 1):
                fold = rooted & (level < depth - 1)
                anc = j
                for hop in range(MAX_DEPTH):
                    up = fold & (hop < depth - 1 - level)
                    anc = tl.where(up, tl.load(parent_ptr + start + anc, mask=up, other=0), anc)
                a_tok = tl.load(input_ids_ptr + start + anc, mask=fold, other=0).to(tl.int64)
                a_pos = tl.load(positions_ptr + start + anc, mask=fold, other=0).to(tl.int64)
                running = tl.where(
                    fold, H.chain_step(running, H.as_u64(a_tok), H.as_u64(a_pos)), running
                )
            has_parent = rooted & (depth > 1)
            parent_pos = tl.load(positions_ptr + start + parent, mask=has_parent, other=0).to(
                tl.int64
            )
            prev_pos = tl.where(has_parent, parent_pos, seed_pos)

            in_range = (slot >= 0) & (slot < num_slots)
            exp_tok, exp_pos = load_expected(
                exp_tok_ptr, exp_pos_ptr, g, act, tok, pos, INPUT_ASSERT
            )
            bits = tl.where(tok != exp_tok, FAIL_WRITE_TOKEN, 0)
            bits |= tl.where(pos != exp_pos, FAIL_WRITE_POSITION, 0)
            chain_bad = rooted & check_pos & (pos != prev_pos + 1)
            bits |= tl.where(chain_bad | bad_link, FAIL_WRITE_POSITION, 0)
            exp_pos = tl.where(chain_bad, prev_pos + 1, exp_pos)
            exp_pos = tl.where(bad_link, -1, exp_pos)

            store = rooted & in_range
            rec = canary_ptr + slot * RECORD_WORDS
            tl.store(rec + FIELD_TOKEN, tok, mask=store)
            tl.store(rec + FIELD_POSITION, pos, mask=store)
            tl.store(rec + FIELD_PREV_HASH, H.as_i64(running), mask=store)
            if ZERO_FP:
                tl.store(rec + FIELD_REAL_KV_HASH, zero, mask=store)
            written += store.to(tl.int64)
            bad = (rooted | bad_link) & in_range & (bits != 0)
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
                    H.as_i64(running),
                    exp_pos,
                    bits.to(tl.int64),
                    pos,
                    req_row,
                    NO_KV_LAYER,
                )
    tl.atomic_add(slot_counter, tl.sum(written, axis=0))
