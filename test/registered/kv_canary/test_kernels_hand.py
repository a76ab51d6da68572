"""Hand cases for the KV-canary kernels, checked against an independent scalar oracle
(``kernel_oracle.py``): the plan, verify, real-KV fingerprint and chain checks (the writes,
the violation ring and the token-id scatter: ``test_kernels_hand_writes.py``).

The oracle below is plain Python (python ints, one entry at a time) written from
docs/architecture.md ("Record format" through "Token-id scatter") and the launchers' docstrings;
it only borrows the hash primitives of ``consts`` (themselves checked against the documented
formula in ``test_hash_primitives_match_spec``). Real-KV fingerprints are computed from the
source tensors' raw bytes (``tensor.view(torch.uint8)``).

Every kernel case runs twice (the ``impl`` fixture):

- ``triton``: the public launchers on ``device`` tensors (compiled on CUDA; on CPU, Triton's
  interpreter, since conftest sets ``TRITON_INTERPRET=1``). The launchers' reference path
  (``run_*``) is patched to raise so a silent fallback to the reference cannot pass for Triton.
- ``torch_ref``: the ``*_torch_reference`` functions on CPU tensors.

Both are asserted against the oracle exactly: records (``ctx.canary_words``), plan tensors,
violation-ring rows (as multisets: Triton lanes may append in any order),
``violation_write_index`` and the slot / kernel run counters.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch


from sglang.jit_kernel.kv_canary import (
    CANARY_CHAIN_ANCHOR,
    CanaryLaunchTag,
    CanaryPhase,
    FailReason,
    KvHalf,
    PoolKind,
    RealKvHashMode,
    RealKvSource,
)
from sglang.jit_kernel.kv_canary.consts import (
    NO_KV_LAYER,
    canary_chain_head_hash,
    splitmix64,
    canary_chain_step,
    to_int64,
)
from kernel_oracle import (
    perm_slots,
    r2t_table,
    sm64_spec,
    BIT_CHAIN,
    BIT_POS,
    BIT_REAL_KV,
    BIT_TOKEN,
    BIT_WRITE_POS,
    BIT_WRITE_TOKEN,
    Canary,
    hand_verify_plan,
    hand_write_plan,
    HEAD,
    MASK64,
    rec_hash,
    run_plan,
    SENTINEL,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")


def test_hash_primitives_match_spec():
    for x in (0, 1, 2, 0xDEADBEEF, MASK64, 1 << 63, CANARY_CHAIN_ANCHOR, -1, -12345):
        assert splitmix64(x) == sm64_spec(x)
    for a, b, c in ((0, 0, 0), (1, 2, 3), (MASK64, -1, 7), (HEAD, 12345, -9)):
        key = sm64_spec(sm64_spec(b & MASK64) ^ (c & MASK64))
        assert canary_chain_step(a, b, c) == ((a & MASK64) * 0xD1342543DE82EF95 + key) & MASK64
    assert CANARY_CHAIN_ANCHOR == 0xC0FFEE1234567890
    assert canary_chain_head_hash() == sm64_spec(0xC0FFEE1234567890)
    assert to_int64(MASK64) == -1 and to_int64(5) == 5 and to_int64(1 << 63) == -(1 << 63)


SPEC_TAGS = {
    "HEAD_K_FULL": 0,
    "HEAD_V_FULL": 1,
    "TAIL_K_FULL": 2,
    "TAIL_V_FULL": 3,
    "SWEEP_K_FULL": 4,
    "SWEEP_V_FULL": 5,
    "HEAD_K_SWA": 6,
    "HEAD_V_SWA": 7,
    "TAIL_K_SWA": 8,
    "TAIL_V_SWA": 9,
    "SWEEP_K_SWA": 10,
    "SWEEP_V_SWA": 11,
}


def test_launch_tag_values_and_roundtrip():
    assert {t.name: t.value for t in CanaryLaunchTag} == SPEC_TAGS
    seen = set()
    for name, value in SPEC_TAGS.items():
        tag = CanaryLaunchTag(value)
        phase, half, kind = name.split("_")
        assert tag.phase is CanaryPhase[phase]
        assert tag.half is KvHalf[half]
        assert tag.pool_kind is PoolKind[kind]
        assert CanaryLaunchTag.of(tag.phase, tag.half, tag.pool_kind) is tag
        assert CanaryLaunchTag.of(CanaryPhase[phase], KvHalf[half], PoolKind[kind]) is tag
        seen.add((tag.phase, tag.half, tag.pool_kind))
    assert len(seen) == 12


def test_fail_reason_values_and_describe():
    assert {r.name: r.value for r in FailReason} == {
        "VERIFY_CHAIN_HASH_MISMATCH": 1,
        "VERIFY_POSITION_MISMATCH": 2,
        "VERIFY_REAL_KV_HASH_MISMATCH": 4,
        "WRITE_TOKEN_MISMATCH": 8,
        "WRITE_POSITION_MISMATCH": 16,
        "VERIFY_TOKEN_MISMATCH": 32,
    }
    assert FailReason.describe(5) == "verify_chain_hash+verify_real_kv_hash"
    assert FailReason.describe(4) == "verify_real_kv_hash"
    assert FailReason.describe(8 | 16) == "write_token+write_position"
    assert FailReason.describe(2 | 32) == "verify_position+verify_token"
    assert FailReason.describe(63) == (
        "verify_chain_hash+verify_position+verify_real_kv_hash+"
        "write_token+write_position+verify_token"
    )
    assert RealKvHashMode.NONE == 0 and RealKvHashMode.PARTIAL == 1 and RealKvHashMode.ALL == 2


# =============================================================================================
# Plan + write + verify flows
# =============================================================================================


def test_single_request_extend_then_decode(impl):
    num_slots, rows, cols = 64, 6, 16
    slots = [5, 9, 2, 17, 30, 11, 40, 3]
    toks = [101, 7, 55, 1000, 3, 42, 8, 77]
    r2t = r2t_table(rows, cols)
    r2t[3][:8] = slots
    r2t[0][:8] = [1] * 8  # padding row content must never matter
    c = Canary(impl, num_slots, kind=CanaryLaunchTag.HEAD_K_FULL)

    # Extend from prefix 0: chain head, nothing to verify.
    p = run_plan(impl, rpi=[3], prefix=[0], ext=[6], r2t=r2t, write_req_capacity=4)
    assert p.exp.num_valid == 0 and p.exp.enable == 1
    assert p.exp.write_offsets == [0, 6, 0, 0, 0] and p.exp.seeds == [-1] * 4
    c.verify(p)
    rows6 = c.write(p, toks[:6], range(6), slots[:6])
    assert rows6 == []
    assert c.record(5) == [101, 0, to_int64(HEAD), 0]  # position 0: prev_hash == H(none)
    assert c.record(9)[2] == to_int64(canary_chain_step(HEAD, 101, 0))

    # Decode on top: seed = slot of position prefix-1, whole prefix verified.
    p = run_plan(impl, rpi=[3], prefix=[6], ext=[1], r2t=r2t, write_req_capacity=4)
    assert p.exp.seeds == [11, -1, -1, -1]
    assert p.exp.entries == [
        (5, -1, 0, -1),
        (9, -1, 1, 5),
        (2, -1, 2, 9),
        (17, -1, 3, 2),
        (30, -1, 4, 17),
        (11, -1, 5, 30),
    ]
    assert c.verify(p) == []
    assert int(c.ctx.slot_run_counter[0]) == 6 + 6
    c.write(p, [toks[6]], [6], [slots[6]])
    assert c.record(40)[2] == to_int64(rec_hash(c.oracle.recs[11]))
    assert c.ring_rows() == []

    # And once more: 7 entries, zero violations, counters exact.
    p = run_plan(impl, rpi=[3], prefix=[7], ext=[1], r2t=r2t, write_req_capacity=4)
    assert c.verify(p) == []
    c.write(p, [toks[7]], [7], [slots[7]])
    p = run_plan(impl, rpi=[3], prefix=[8], ext=[1], r2t=r2t, write_req_capacity=4)
    assert c.verify(p) == []
    assert int(c.ctx.violation_write_index[0]) == 0
    assert int(c.ctx.kernel_run_counter[0]) == 7


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_record_corrupted_at_either_end_of_the_plan_is_reported_there(impl, where):
    """Every entry of a verify plan is read, its ends included: a record whose position is
    wrong at the plan's first or last entry gives one violation, at that slot and position,
    from the kernel and the oracle alike (the last entry has no successor in the plan, so
    only its own read can see it)."""
    num_slots, rows, cols = 64, 6, 16
    slots = [5, 9, 2, 17, 30, 11]
    r2t = r2t_table(rows, cols)
    r2t[3][:6] = slots
    c = Canary(impl, num_slots, kind=CanaryLaunchTag.HEAD_K_FULL)
    p = run_plan(impl, rpi=[3], prefix=[0], ext=[6], r2t=r2t, write_req_capacity=4)
    assert c.write(p, [101, 7, 55, 1000, 3, 42], range(6), slots) == []
    p = run_plan(impl, rpi=[3], prefix=[6], ext=[1], r2t=r2t, write_req_capacity=4)
    assert [e[0] for e in p.exp.entries] == slots
    index = 0 if where == "first" else len(slots) - 1
    slot = slots[index]
    # the position field alone: the record's hash changes too, which the next entry's chain
    # check sees, except after the last entry
    c.set_field(slot, 1, 40)
    found = c.verify(p)
    assert found == c.ring_rows()  # kernel and oracle agree row for row
    by_slot = {row[1]: row for row in found}
    assert slot in by_slot and by_slot[slot][2] == 40 and by_slot[slot][8] == index
    assert by_slot[slot][7] & BIT_POS
    assert set(by_slot) == ({slot, slots[1]} if where == "first" else {slot})
    assert int(c.ctx.slot_run_counter[0]) == 2 * len(slots)  # six written, six verified


def test_mixed_batch_with_padding_rows(impl):
    num_slots, rows, cols = 64, 8, 8
    rng = random.Random(1)
    perm = perm_slots(63, num_slots, seed=2)
    r2t = r2t_table(rows, cols)
    for rp in range(1, rows):
        r2t[rp] = perm[(rp - 1) * cols : rp * cols]
    pad_slot = perm[56]
    r2t[0] = [pad_slot] * cols  # padding row: a real-looking slot that must never be read
    tok = {rp: [rng.randrange(1, 50000) for _ in range(cols)] for rp in range(rows)}
    c = Canary(impl, num_slots, kind=CanaryLaunchTag.TAIL_K_FULL)

    # Stage A: prefixes of the live rows are written by a first extend.
    p = run_plan(impl, rpi=[2, 1, 6], prefix=[0, 0, 0], ext=[3, 5, 2], r2t=r2t)
    ids, pos, loc = [], [], []
    for rp, n in ((2, 3), (1, 5), (6, 2)):
        ids += tok[rp][:n]
        pos += list(range(n))
        loc += r2t[rp][:n]
    c.write(p, ids, pos, loc)

    # Stage B: the mixed batch with padding rows (rp 0) and a live row with extend 0.
    rpi = [2, 0, 5, 0, 1, 6]
    prefix = [3, 4, 0, 0, 5, 2]
    ext = [2, 3, 4, 1, 1, 0]
    p = run_plan(
        impl, rpi=rpi, prefix=prefix, ext=ext, r2t=r2t, write_req_capacity=8, dtype=torch.int32
    )
    assert p.exp.write_offsets == [0, 2, 2, 6, 6, 7, 7, 0, 0]
    assert p.exp.seeds == [r2t[2][2], -1, -1, -1, r2t[1][4], r2t[6][1], -1, -1]
    assert len(p.exp.entries) == 3 + 5 + 2
    assert all(e[0] != pad_slot and e[3] != pad_slot for e in p.exp.entries)
    assert c.verify(p) == []
    ids = tok[2][3:5] + tok[5][0:4] + tok[1][5:6]
    pos = [3, 4, 0, 1, 2, 3, 5]
    loc = r2t[2][3:5] + r2t[5][0:4] + r2t[1][5:6]
    assert c.write(p, ids, pos, loc) == []

    # Stage C: decode step over everyone, zero violations.
    p = run_plan(impl, rpi=[0, 2, 5, 1], prefix=[9, 5, 4, 6], ext=[1, 1, 1, 1], r2t=r2t)
    assert len(p.exp.entries) == 5 + 4 + 6
    assert c.verify(p) == []
    assert int(c.ctx.violation_write_index[0]) == 0


def test_plan_out_of_range_data_is_padding(impl):
    """Out-of-range rows / prefixes / table indices are clamped or treated as padding."""
    rows, cols = 4, 6
    r2t = r2t_table(rows, cols)
    r2t[1] = [3, 4, 5, 6, 7, 8]
    r2t[2] = [9, 10, 70, 11, 12, 13]  # 70 is outside the 64-entry SWA table
    r2t[3] = [14, 15, 16, 17, 18, 19]
    lut = list(range(64))
    lut[16] = 0
    # rp 4 (== rows) and -1 are padding; prefix 9 > cols clamps to cols; prefix -2 → 0;
    # negative extend writes nothing.
    p = run_plan(
        impl,
        rpi=[4, 1, -1, 2, 3],
        prefix=[2, 9, 2, 4, -2],
        ext=[1, -3, 1, 2, 2],
        r2t=r2t,
        window=100,
        lut=lut,
        write_req_capacity=6,
    )
    assert p.exp.write_offsets == [0, 0, 0, 0, 2, 4, 0]
    assert p.exp.seeds == [-1, 8, -1, 11, -1, -1]
    assert p.exp.entries[:6] == [
        (3, -1, 0, -1),
        (4, -1, 1, 3),
        (5, -1, 2, 4),
        (6, -1, 3, 5),
        (7, -1, 4, 6),
        (8, -1, 5, 7),
    ]
    assert p.exp.entries[6:] == [(9, -1, 0, -1), (10, -1, 1, 9), (0, -1, 2, 10), (11, -1, 3, 0)]
    # Without a table, rp == rows is still padding and the rest is the identity.
    p = run_plan(impl, rpi=[3, 4], prefix=[3, 3], ext=[1, 1], r2t=r2t, write_req_capacity=2)
    assert p.exp.entries == [(14, -1, 0, -1), (15, -1, 1, 14), (16, -1, 2, 15)]
    assert p.exp.seeds == [16, -1]


def test_swa_window_with_evicted_slots(impl):
    full_slots, swa_slots, rows, cols = 64, 32, 5, 10
    r2t = r2t_table(rows, cols)
    r2t[1][:8] = [3, 8, 12, 5, 20, 9, 33, 40]
    r2t[3][:3] = [14, 15, 16]
    r2t[4][:2] = [50, 51]
    lut_live = [0] * full_slots  # the table while every position was resident
    for f, s in {
        3: 1,
        8: 2,
        12: 6,
        5: 19,
        20: 7,
        9: 21,
        33: 4,
        40: 11,
        14: 25,
        15: 26,
        16: 27,
        50: 28,
        51: 29,
    }.items():
        lut_live[f] = s
    window = 3
    c = Canary(impl, swa_slots, kind=CanaryLaunchTag.HEAD_K_SWA)
    toks1 = [11, 12, 13, 14, 15, 16, 17, 18]

    # Prefill (prefix 0): seeds -1, no verify entries; the caller translates out_cache_loc.
    p = run_plan(
        impl,
        rpi=[1, 3],
        prefix=[0, 0],
        ext=[7, 2],
        r2t=r2t,
        window=window,
        lut=lut_live,
        write_req_capacity=4,
    )
    assert p.exp.seeds == [-1] * 4 and p.exp.num_valid == 0
    loc = [lut_live[f] for f in r2t[1][:7]] + [lut_live[f] for f in r2t[3][:2]]
    c.write(p, toks1[:7] + [31, 32], list(range(7)) + [0, 1], loc)

    # Positions 3 and 5 of request 1 leave the SWA pool: their table entries become 0.
    lut = list(lut_live)
    lut[5] = 0
    lut[9] = 0
    p = run_plan(
        impl,
        rpi=[1, 3, 4],
        prefix=[7, 2, 0],
        ext=[1, 1, 2],
        r2t=r2t,
        window=window,
        lut=lut,
        write_req_capacity=4,
    )
    # Request 1: only [4, 7), translated; p=4's predecessor and p=5 itself are evicted → 0.
    assert p.exp.entries == [
        (7, -1, 4, 0),
        (0, -1, 5, 7),
        (4, -1, 6, 0),
        (25, -1, 0, -1),
        (26, -1, 1, 25),
    ]
    assert p.exp.seeds == [4, 26, -1, -1]
    assert c.verify(p) == []

    # prev == 0: the chain of that entry is not checked; slot 0 entries are skipped.
    c.set_field(7, 2, 0x0BADC0DE)  # p=4's prev_hash: unverifiable, so no report
    c.set_field(4, 2, 0x0BADBEEF)  # p=6's prev_hash: idem
    assert c.verify(p) == []
    c.set_field(7, 1, 99)  # p=4's position: reported, expected_aux = stored prev_hash
    rows = c.verify(p)
    # located: attention read req_to_token[1, 4] for position 4
    assert c.ring_rows() == [
        (
            int(CanaryLaunchTag.HEAD_K_SWA),
            7,
            99,
            15,
            -1,
            0x0BADC0DE,
            0x0BADC0DE,
            BIT_POS,
            4,
            1,
            NO_KV_LAYER,
        )
    ]
    assert rows == c.ring_rows()
    c.set_field(7, 1, 4)

    # Decode on top of the window: seed T(slot of position 6) = 4.
    c.set_field(
        4,
        2,
        to_int64(
            canary_chain_step(
                canary_chain_step(
                    canary_chain_step(
                        canary_chain_step(
                            canary_chain_step(canary_chain_step(HEAD, 11, 0), 12, 1), 13, 2
                        ),
                        14,
                        3,
                    ),
                    15,
                    4,
                ),
                16,
                5,
            )
        ),
    )
    rows = c.write(p, [18, 33, 41, 42], [7, 2, 0, 1], [lut[40], lut[r2t[3][2]], lut[50], lut[51]])
    assert rows == []
    assert c.record(11)[2] == to_int64(rec_hash(c.oracle.recs[4]))
    p = run_plan(
        impl,
        rpi=[1, 3, 4],
        prefix=[8, 3, 2],
        ext=[1, 1, 1],
        r2t=r2t,
        window=window,
        lut=lut,
        write_req_capacity=4,
    )
    assert [e[2] for e in p.exp.entries] == [5, 6, 7, 0, 1, 2, 0, 1]
    assert c.verify(p) == []


def test_verify_overflow_disables_plan(impl):
    num_slots, rows, cols = 32, 4, 8
    r2t = r2t_table(rows, cols)
    r2t[1][:4] = [1, 2, 3, 4]
    r2t[2][:5] = [5, 6, 7, 8, 9]
    c = Canary(impl, num_slots)
    for s in range(1, num_slots):  # garbage everywhere: any verified entry would report
        c.set_record(s, [s, 1000 + s, 3 * s, 0])
    # 3 + 4 = 7 > 5: disabled, entries untouched (sentinels), num_valid == capacity.
    p = run_plan(
        impl,
        rpi=[1, 2],
        prefix=[3, 4],
        ext=[1, 1],
        r2t=r2t,
        verify_capacity=5,
        write_req_capacity=2,
    )
    assert p.exp.enable == 0 and p.exp.num_valid == 5
    assert p.exp.slots == [SENTINEL] * 5
    assert p.exp.write_offsets == [0, 1, 2] and p.exp.seeds == [3, 8]
    assert c.verify(p) == []
    assert int(c.ctx.kernel_run_counter[0]) == 1 and int(c.ctx.slot_run_counter[0]) == 0
    assert c.verify(p) == []
    assert int(c.ctx.kernel_run_counter[0]) == 2 and int(c.ctx.slot_run_counter[0]) == 0
    # Exactly at capacity: enabled (and every garbage record reports).
    p = run_plan(
        impl,
        rpi=[1, 2],
        prefix=[2, 3],
        ext=[1, 1],
        r2t=r2t,
        verify_capacity=5,
        write_req_capacity=2,
    )
    assert p.exp.enable == 1 and p.exp.num_valid == 5
    assert len(c.verify(p)) == 5
    assert int(c.ctx.slot_run_counter[0]) == 5
    # The SWA window counts too: windows of 2 fit in the capacity again.
    p = run_plan(
        impl,
        rpi=[1, 2],
        prefix=[3, 4],
        ext=[1, 1],
        r2t=r2t,
        window=2,
        lut=list(range(num_slots)),
        verify_capacity=5,
        write_req_capacity=2,
    )
    assert p.exp.enable == 1 and p.exp.num_valid == 4


def test_verify_num_valid_clamped_to_capacity(impl):
    c = Canary(impl, 16)
    c.set_record(3, [5, 0, to_int64(HEAD), 0])
    c.set_record(4, [6, 1, to_int64(rec_hash([5, 0, to_int64(HEAD), 0])), 0])
    entries = [(3, -1, 0, -1), (4, -1, 1, 3), (4, -1, 7, 3)]
    # num_valid beyond capacity: clamped to capacity (2), third entry never read.
    p = hand_verify_plan(impl, entries[:2], capacity=2, num_valid=9)
    assert c.verify(p) == []
    assert int(c.ctx.slot_run_counter[0]) == 2
    # A capacity-3 plan with num_valid 2 ignores its third (bad) entry.
    p = hand_verify_plan(impl, entries, capacity=3, num_valid=2)
    assert c.verify(p) == []
    p = hand_verify_plan(impl, entries, capacity=3, num_valid=3)
    assert [r[7] for r in c.verify(p)] == [BIT_POS]
    # Disabled by hand: nothing checked, slot counter unchanged.
    p = hand_verify_plan(impl, entries, capacity=3, enable=0)
    assert c.verify(p) == []
    assert int(c.ctx.slot_run_counter[0]) == 2 + 2 + 3
    assert int(c.ctx.kernel_run_counter[0]) == 4


@pytest.mark.parametrize("offset", [0, 1])
def test_expected_tokens_plan_and_verify(impl, offset):
    num_slots, rows, cols = 32, 4, 8
    r2t = r2t_table(rows, cols)
    r2t[1][:5] = [2, 4, 6, 8, 10]
    r2t[2][:4] = [3, 5, 7, 9]
    r2t[3][:3] = [11, 12, 13]
    history = {
        1: [500, 501, 502, 503, 504, 505],
        2: [600, 601, 602, 603, 604],
        3: [700, 701, 702, 703],
    }
    exp_pool = [[-9] * 6 for _ in range(rows)]  # 6 columns: narrower than req_to_token
    for rp, h in history.items():
        exp_pool[rp][: len(h[:6])] = h[:6]
    exp_pool[0] = [1] * 6
    # valid lens: short (2) for request 1, 4 for request 2, beyond the pool width for 3.
    valid_lens = [2, 4, 9]
    p = run_plan(
        impl,
        rpi=[1, 2, 3],
        prefix=[5, 4, 3],
        ext=[1, 1, 1],
        r2t=r2t,
        exp_pool=exp_pool,
        valid_lens=valid_lens,
        offset=offset,
    )

    def want(rp, vl, n):
        out = []
        for pp in range(n):
            idx = pp + offset
            out.append(exp_pool[rp][idx] if 0 <= idx < min(vl, 6) else -1)
        return out

    assert [e[1] for e in p.exp.entries] == want(1, 2, 5) + want(2, 4, 4) + want(3, 9, 3)
    if offset == 0:
        assert [e[1] for e in p.exp.entries][:5] == [500, 501, -1, -1, -1]
    else:
        assert [e[1] for e in p.exp.entries][:5] == [501, -1, -1, -1, -1]
        assert [e[1] for e in p.exp.entries][5:9] == [601, 602, 603, -1]

    # Records: the KV at position p holds token history[p + offset].
    c = Canary(impl, num_slots)
    for rp, n in ((1, 5), (2, 4), (3, 3)):
        running = HEAD
        for pp in range(n):
            t = history[rp][pp + offset]
            c.set_record(r2t[rp][pp], [t, pp, to_int64(running), 0])
            running = canary_chain_step(running, t, pp)
    for check in (False, True):
        assert c.verify(p, check_token=check) == []
    # Wrong token where the expected token is known (request 1, position 0) and where it is
    # unknown (request 1, position 4; request 3 position 2 at offset 1).
    c.set_field(2, 0, 4242)
    c.set_field(10, 0, 4343)
    rows_off = c.verify(p, check_token=False)
    assert sorted(r[1] for r in rows_off) == [4]  # only the chain of the successor breaks
    rows_on = c.verify(p, check_token=True)
    by_slot = {r[1]: r for r in rows_on}
    assert set(by_slot) == {2, 4}
    assert by_slot[2][7] == BIT_TOKEN and by_slot[2][3] == 4242
    assert by_slot[2][4] == exp_pool[1][offset]
    assert by_slot[4][7] == BIT_CHAIN and by_slot[4][4] == want(1, 2, 2)[1]
    # expected_token column is -1 when token checks are off.
    c.set_field(5, 1, 77)
    rows_off = c.verify(p, check_token=False)
    # (slot 7, the successor of slot 5, breaks its chain: the position is part of H)
    assert {r[1]: (r[4], r[7]) for r in rows_off} == {
        4: (-1, BIT_CHAIN),
        5: (-1, BIT_POS),
        7: (-1, BIT_CHAIN),
    }


# =============================================================================================
# Real-KV fingerprints
# =============================================================================================


def _make_two_sources(device, *, seed=0):
    """Two sources over 16 slots, page_size 2: A = bf16 24-byte tokens, B = uint8 rows with a
    gap (row stride 64 > row bytes 56), 24-byte tokens of which the first 8 are read."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-32768, 32767, (8, 2, 12), dtype=torch.int16, generator=g)
    a = a.view(torch.bfloat16).to(device)
    big = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=g).to(device)
    b = big[:, :56]
    src_a = RealKvSource(tensor=a, page_size=2, num_bytes_per_token=24, read_bytes=24)
    src_b = RealKvSource(tensor=b, page_size=2, num_bytes_per_token=24, read_bytes=8)
    return src_a, src_b


def _flip_byte(src: RealKvSource, slot: int, byte: int):
    page = slot // src.page_size
    off = (slot % src.page_size) * src.num_bytes_per_token + byte
    row_u8 = src.tensor[page].view(torch.uint8).view(-1)  # a view: flips the source in place
    row_u8[off] ^= 0xFF


@pytest.mark.parametrize(
    "mode", [RealKvHashMode.NONE, RealKvHashMode.PARTIAL, RealKvHashMode.ALL], ids=lambda m: m.name
)
def test_real_kv_two_sources_page_size_2(impl, mode):
    src_a, src_b = _make_two_sources(impl.device)
    num_slots, rows, cols = 16, 3, 8
    r2t = r2t_table(rows, cols)
    r2t[1][:7] = [3, 5, 6, 9, 12, 15, 8]
    c = Canary(impl, num_slots, kind=CanaryLaunchTag.TAIL_K_FULL, sources=(src_a, src_b), mode=mode)
    for s in range(1, num_slots):  # stale real_kv_hash values must be overwritten (0 for NONE)
        c.set_record(s, [0, 0, 0, 0x5EED + s])
    toks = [9, 8, 7, 6, 5, 4, 3]
    p = run_plan(impl, rpi=[1], prefix=[0], ext=[6], r2t=r2t)
    c.write(p, toks[:6], range(6), r2t[1][:6])
    fps = {s: c.record(s)[3] for s in r2t[1][:6]}
    if mode == RealKvHashMode.NONE:
        assert set(fps.values()) == {0}
    else:
        assert 0 not in fps.values() and len(set(fps.values())) == 6
    p = run_plan(impl, rpi=[1], prefix=[6], ext=[1], r2t=r2t)
    assert c.verify(p) == []

    # Flip one byte of one source for slot 5 (page 2, second token): only slot 5 may report.
    detected = {}
    for name, src, byte in (
        ("A3", src_a, 3),
        ("A20", src_a, 20),
        ("B2", src_b, 2),
        ("B10", src_b, 10),
    ):
        _flip_byte(src, 5, byte)
        rows = c.verify(p)
        _flip_byte(src, 5, byte)
        assert all(r[1] == 5 and r[7] == BIT_REAL_KV for r in rows)
        detected[name] = bool(rows)
    want = {
        RealKvHashMode.NONE: {"A3": False, "A20": False, "B2": False, "B10": False},
        # PARTIAL folds min(16, read_bytes): 16 bytes of A, the 8 read bytes of B.
        RealKvHashMode.PARTIAL: {"A3": True, "A20": False, "B2": True, "B10": False},
        # ALL folds read_bytes: 24 of A, 8 of B (byte 10 of B is never read).
        RealKvHashMode.ALL: {"A3": True, "A20": True, "B2": True, "B10": False},
    }[mode]
    assert detected == want
    if mode != RealKvHashMode.NONE:
        row = c.ring_rows()[0]
        assert row == (
            int(CanaryLaunchTag.TAIL_K_FULL),
            5,
            1,
            8,
            -1,
            c.oracle.recs[5][2],
            c.oracle.recs[5][2],
            BIT_REAL_KV,
            1,
            1,
            NO_KV_LAYER,
        )
    # The decode write on top fingerprints its slot too; a stale record is reported.
    c.write(p, [toks[6]], [6], [8])
    p = run_plan(impl, rpi=[1], prefix=[7], ext=[1], r2t=r2t)
    assert c.verify(p) == []
    _flip_byte(src_b, 8, 0)
    rows = c.verify(p)
    assert [r[1] for r in rows] == ([] if mode == RealKvHashMode.NONE else [8])


@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL], ids=lambda m: m.name)
def test_real_kv_24_byte_rows_fold(impl, mode):
    """num_bytes_per_token = read_bytes = 24: PARTIAL folds 16 bytes, ALL folds all 24."""
    g = torch.Generator().manual_seed(5)
    t = torch.randint(0, 256, (4, 2 * 24), dtype=torch.uint8, generator=g).to(impl.device)
    src = RealKvSource(tensor=t, page_size=2, num_bytes_per_token=24, read_bytes=24)
    c = Canary(impl, 8, sources=(src,), mode=mode)
    p = hand_write_plan(impl, [2], [-1])
    c.write(p, [10, 11], [0, 1], [5, 6])
    raw = t.cpu()[2].tolist()  # slot 5 = page 2, token 1 → bytes 24..47 of the row
    words = [int.from_bytes(bytes(raw[24 + 8 * k : 32 + 8 * k]), "little") for k in range(3)]
    src_hash = 0
    for w in words[:2] if mode == RealKvHashMode.PARTIAL else words:
        src_hash = splitmix64(src_hash ^ w)
    assert c.record(5)[3] == to_int64(splitmix64(src_hash))
    # Byte 17 of the token is folded in ALL only.
    t.view(torch.uint8)[2, 24 + 17] ^= 1
    rows = c.verify(hand_verify_plan(impl, [(5, -1, 0, -1), (6, -1, 1, 5)]))
    assert [r[1] for r in rows] == ([5] if mode == RealKvHashMode.ALL else [])


# =============================================================================================
# Write checks
# =============================================================================================


@pytest.mark.parametrize("chain_assert", [0, 1])
def test_chain_position_assert(impl, chain_assert):
    num_slots, rows, cols = 32, 4, 8
    r2t = r2t_table(rows, cols)
    r2t[1][:5] = [4, 5, 6, 7, 8]
    r2t[2][:2] = [10, 11]
    r2t[3][:4] = [12, 13, 14, 15]
    c = Canary(impl, num_slots, kind=CanaryLaunchTag.HEAD_V_FULL, chain_assert=chain_assert)
    p = run_plan(impl, rpi=[1, 3], prefix=[0, 0], ext=[3, 2], r2t=r2t)
    # Chain heads (no seed) are never position-checked, even when starting at 4.
    assert c.write(p, [1, 2, 3, 21, 22], [0, 1, 2, 4, 5], [4, 5, 6, 12, 13]) == []
    p = run_plan(impl, rpi=[1, 2, 3], prefix=[3, 0, 2], ext=[2, 2, 2], r2t=r2t)
    # Request 1 (seed position 2) starts at 5 instead of 3, then continues 5 → 6 (fine);
    # request 2 has no seed and starts at 7; request 3 (seed position 5) writes 6, 8.
    rows = c.write(p, [31, 32, 41, 42, 51, 52], [5, 6, 7, 8, 6, 8], [7, 8, 10, 11, 14, 15])
    if chain_assert:
        running7 = c.oracle.recs[7][2]
        running15 = c.oracle.recs[15][2]
        assert c.ring_rows() == sorted(
            [
                (
                    int(CanaryLaunchTag.HEAD_V_FULL),
                    7,
                    5,
                    31,
                    31,
                    running7,
                    3,
                    BIT_WRITE_POS,
                    5,
                    1,
                    NO_KV_LAYER,
                ),
                (
                    int(CanaryLaunchTag.HEAD_V_FULL),
                    15,
                    8,
                    52,
                    52,
                    running15,
                    7,
                    BIT_WRITE_POS,
                    8,
                    3,
                    NO_KV_LAYER,
                ),
            ]
        )
    else:
        assert rows == [] and c.ring_rows() == []
    # The chain advances on actual values either way.
    assert c.record(8)[2] == to_int64(rec_hash(c.oracle.recs[7]))


def test_write_seed_zero_is_not_position_checked(impl):
    """A SWA seed translated to slot 0 (predecessor evicted from the window) starts the chain
    from the padding record but is never position-checked against it."""
    c = Canary(impl, 32, kind=CanaryLaunchTag.HEAD_K_SWA, chain_assert=1)
    c.set_record(0, [0, 0, 0, 0])  # the padding record: position 0
    c.set_record(3, [50, 8, 0x99, 0])
    p = hand_write_plan(impl, [2, 2], [0, 3])
    c.write(p, [61, 62, 71, 72], [17, 18, 9, 11], [5, 6, 7, 8])
    # request 0 (seed 0) starts at 17: not a violation; request 1 jumps 9 -> 11: one is
    assert [(r[1], r[6]) for r in c.ring_rows()] == [(8, 10)]
    assert c.record(5)[2] == to_int64(rec_hash([0, 0, 0, 0]))  # chain from H(record[0])


@pytest.mark.parametrize("input_assert", [False, True])
def test_write_input_assert(impl, input_assert):
    c = Canary(impl, 32, kind=CanaryLaunchTag.TAIL_K_FULL, chain_assert=1)
    # Seeded request (seed record at slot 2 holds position 9): chain check also active.
    c.set_record(2, [77, 9, 0x1111, 0])
    p = hand_write_plan(impl, [4, 2], [2, -1])
    ids = [100, 101, 102, 103, 200, 201]
    pos = [10, 11, 12, 14, 0, 1]
    exp_tok = [100, 999, 102, 998, 200, 201]
    exp_pos = [10, 11, 50, 51, 0, 7]
    loc = [3, 4, 5, 6, 7, 8]
    kw = dict(input_assert=True, exp_tok=exp_tok, exp_pos=exp_pos) if input_assert else {}
    c.write(p, ids, pos, loc, dtype=torch.int32, **kw)
    got = {r[1]: (r[4], r[6], r[7]) for r in c.ring_rows()}
    if input_assert:
        assert got == {
            4: (999, 11, BIT_WRITE_TOKEN),
            5: (102, 50, BIT_WRITE_POS),
            # token and chain position both wrong: expected position is the chain's (13)
            6: (998, 13, BIT_WRITE_TOKEN | BIT_WRITE_POS),
            8: (201, 7, BIT_WRITE_POS),
        }
    else:
        assert got == {6: (103, 13, BIT_WRITE_POS)}
    # The running hash column is the prev_hash that was stored.
    for r in c.ring_rows():
        assert r[5] == c.record(r[1])[2]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
