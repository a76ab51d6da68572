"""Hand cases for the KV-canary kernels' writes, the violation ring, corrupted records, slot 0,
larger batches and the token-id scatter, checked against the independent scalar oracle of
``kernel_oracle.py`` (the plan, verify and chain cases: ``test_kernels_hand.py``). Every case runs
on the Triton launchers and on the torch references (the ``impl`` fixture)."""

from __future__ import annotations

import collections
import random
import sys

import pytest
import torch


from sglang.jit_kernel.kv_canary import CanaryLaunchTag, RealKvHashMode, RealKvSource
from sglang.jit_kernel.kv_canary.consts import canary_chain_step, to_int64
from kernel_oracle import (
    perm_slots,
    r2t_table,
    tensor_of,
    BIT_CHAIN,
    BIT_POS,
    BIT_REAL_KV,
    BIT_TOKEN,
    BIT_WRITE_POS,
    Canary,
    hand_verify_plan,
    hand_write_plan,
    HEAD,
    rec_hash,
    run_plan,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")


def test_write_skips_negative_and_out_of_range_slots(impl):
    """slot < 0 (and slot >= num_slots) → entry skipped, chain still advances."""
    c = Canary(impl, 16, chain_assert=1)
    c.set_record(1, [5, 3, 0x77, 0])
    p = hand_write_plan(impl, [4, 3], [1, -1])
    ids = [10, 11, 12, 13, 20, 21, 22]
    pos = [4, 5, 6, 7, 0, 1, 2]
    loc = [2, -1, 3, 16, 4, 5, -7]
    assert c.write(p, ids, pos, loc) == []
    assert int(c.ctx.slot_run_counter[0]) == 4
    h = canary_chain_step(canary_chain_step(rec_hash([5, 3, 0x77, 0]), 10, 4), 11, 5)
    assert c.record(3) == [12, 6, to_int64(h), 0]
    assert c.record(5)[2] == to_int64(canary_chain_step(HEAD, 20, 0))


# =============================================================================================
# Violation ring
# =============================================================================================


def _bad_chain(impl, c, n):
    """A verify plan of ``n`` entries over slots 1..n whose records all have a wrong position."""
    for s in range(1, n + 1):
        c.set_record(s, [s, 100 + s, to_int64(HEAD), 0])
    return hand_verify_plan(impl, [(s, -1, s, -1) for s in range(1, n + 1)])


def test_violation_ring_overflow_verify(impl):
    c = Canary(impl, 32, ring_capacity=3)
    p = _bad_chain(impl, c, 7)
    rows = c.verify(p)
    assert len(rows) == 7 and int(c.ctx.violation_write_index[0]) == 7
    kept = c.ring_rows()
    assert len(kept) == 3 and set(kept) <= set(rows)
    # A second launch only counts: the kept rows stay those of the first one.
    c.verify(hand_verify_plan(impl, [(s, -1, s, -1) for s in range(1, 5)]))
    assert int(c.ctx.violation_write_index[0]) == 11
    assert c.ring_rows() == kept


def test_violation_ring_fill_then_overflow_verify(impl):
    c = Canary(impl, 32, ring_capacity=5)
    p = _bad_chain(impl, c, 3)
    first = c.verify(p)
    assert c.ring_rows() == sorted(first)
    c.verify(hand_verify_plan(impl, [(s, -1, s, -1) for s in range(1, 5)]))
    assert int(c.ctx.violation_write_index[0]) == 7
    kept = c.ring_rows()
    assert len(kept) == 5 and collections.Counter(first) <= collections.Counter(kept)


@pytest.mark.parametrize("ring_capacity", [0, 2])
def test_violation_ring_overflow_write(impl, ring_capacity):
    c = Canary(impl, 32, ring_capacity=ring_capacity, chain_assert=0)
    p = hand_write_plan(impl, [3, 3], [-1, -1])
    ids = [1, 2, 3, 4, 5, 6]
    rows = c.write(
        p,
        ids,
        [0, 1, 2, 0, 1, 2],
        [1, 2, 3, 4, 5, 6],
        input_assert=True,
        exp_tok=[9, 9, 9, 9, 9, 9],
        exp_pos=[0, 1, 2, 0, 1, 2],
    )
    assert len(rows) == 6 and int(c.ctx.violation_write_index[0]) == 6
    assert len(c.ring_rows()) == ring_capacity
    c.write(
        p,
        ids,
        [0, 1, 2, 0, 1, 2],
        [1, 2, 3, 4, 5, 6],
        input_assert=True,
        exp_tok=[1, 2, 3, 4, 5, 9],
        exp_pos=[0, 1, 2, 0, 1, 2],
    )
    assert int(c.ctx.violation_write_index[0]) == 7


def test_write_over_its_own_seed_reports_the_hash_it_walked(impl):
    """A chain whose first step overwrites its own seed record (a wrong slot) and whose second
    step breaks the position chain: the failure's row carries the running hash walked from the
    seed as it was before the forward, not from the record the forward left there."""
    c = Canary(impl, 16, chain_assert=1)
    seed_rec = [5, 3, 0x77, 0]
    c.set_record(1, seed_rec)
    p = hand_write_plan(impl, [2], [1])
    rows = c.write(p, [10, 11], [4, 9], [1, 2])
    walked = canary_chain_step(rec_hash(seed_rec), 10, 4)
    assert [(r[1], r[5], r[7]) for r in rows] == [(2, to_int64(walked), BIT_WRITE_POS)]
    assert c.record(1) == [10, 4, to_int64(rec_hash(seed_rec)), 0]


# =============================================================================================
# Corruption, slot 0, empty inputs, grid-stride sizes
# =============================================================================================


@pytest.mark.parametrize(
    "field", [0, 1, 2, 3], ids=["token", "position", "prev_hash", "real_kv_hash"]
)
def test_corrupted_record_field_detected(impl, field):
    g = torch.Generator().manual_seed(9)
    t = torch.randint(0, 256, (16, 32), dtype=torch.uint8, generator=g).to(impl.device)
    src = RealKvSource(tensor=t, page_size=1, num_bytes_per_token=32, read_bytes=32)
    num_slots, rows, cols = 16, 3, 8
    r2t = r2t_table(rows, cols)
    r2t[2][:6] = [9, 3, 14, 6, 1, 11]
    hist = [[0] * 8, [0] * 8, [70, 71, 72, 73, 74, 75, 76, 77]]
    c = Canary(impl, num_slots, sources=(src,), mode=RealKvHashMode.ALL)
    p = run_plan(impl, rpi=[2], prefix=[0], ext=[6], r2t=r2t)
    c.write(p, hist[2][:6], range(6), r2t[2][:6])
    p = run_plan(impl, rpi=[2], prefix=[6], ext=[1], r2t=r2t, exp_pool=hist, valid_lens=[6])
    assert c.verify(p, check_token=True) == []
    victim, succ = 14, 6  # positions 2 and 3
    orig = c.oracle.recs[victim][field]
    c.set_field(victim, field, orig ^ 0x40)
    rows = c.verify(p, check_token=True)
    got = {r[1]: r[7] for r in rows}
    want = {
        0: {victim: BIT_TOKEN, succ: BIT_CHAIN},
        1: {victim: BIT_POS, succ: BIT_CHAIN},
        2: {victim: BIT_CHAIN, succ: BIT_CHAIN},
        3: {victim: BIT_REAL_KV},
    }[field]
    assert got == want
    if field == 2:
        row = [r for r in rows if r[1] == victim][0]
        assert row[5] == orig ^ 0x40 and row[6] == orig
        assert row[6] == to_int64(rec_hash(c.oracle.recs[3]))


def test_slot_zero_entries_skipped(impl):
    num_slots, rows, cols = 16, 2, 8
    r2t = r2t_table(rows, cols)
    r2t[1][:5] = [4, 5, 0, 6, 7]  # a hole (slot 0) in the middle of the prefix
    c = Canary(impl, num_slots)
    running = HEAD
    for pp, s in enumerate(r2t[1][:5]):
        if s:
            c.set_record(s, [50 + pp, pp, to_int64(running), 0])
        running = canary_chain_step(running, 50 + pp, pp)
    p = run_plan(impl, rpi=[1], prefix=[5], ext=[1], r2t=r2t)
    assert p.exp.entries[2] == (0, -1, 2, 5) and p.exp.entries[3] == (6, -1, 3, 0)
    assert c.verify(p) == []  # slot 0 (garbage) skipped; its successor's chain unchecked
    assert int(c.ctx.slot_run_counter[0]) == 5  # slot-0 entries still counted
    # Hand plan: slot 0 entries with wrong everything are skipped, the live one is checked.
    p = hand_verify_plan(impl, [(0, 1, 7, -1), (0, 2, 8, 4), (4, -1, 9, -1)])
    assert [(r[1], r[7]) for r in c.verify(p, check_token=True)] == [(4, BIT_POS)]
    assert int(c.ctx.slot_run_counter[0]) == 8


def test_empty_inputs_are_noops(impl):
    c = Canary(impl, 8)
    c.set_record(3, [1, 2, 3, 4])
    r2t = r2t_table(2, 4)
    # bs 0 plan: offsets all 0, seeds all -1, nothing to verify.
    p = run_plan(impl, rpi=[], prefix=[], ext=[], r2t=r2t, write_req_capacity=3, verify_capacity=4)
    assert p.exp.write_offsets == [0, 0, 0, 0] and p.exp.seeds == [-1, -1, -1]
    assert p.exp.enable == 1 and p.exp.num_valid == 0 and p.exp.nreq == 0
    c.write(p, [], [], [])
    c.verify(p)
    assert int(c.ctx.kernel_run_counter[0]) == 2 and int(c.ctx.slot_run_counter[0]) == 0
    # Zero-capacity plans, bs 0.
    p = run_plan(impl, rpi=[], prefix=[], ext=[], r2t=r2t, write_req_capacity=0, verify_capacity=0)
    c.write(p, [], [], [])
    c.verify(p)
    # Live requests that write nothing: counters only.
    r2t[1] = [3, 5, 6, 7]
    p = run_plan(impl, rpi=[1], prefix=[0], ext=[0], r2t=r2t, write_req_capacity=1)
    c.write(p, [], [], [])
    assert int(c.ctx.kernel_run_counter[0]) == 5 and int(c.ctx.slot_run_counter[0]) == 0
    assert c.record(3) == [1, 2, 3, 4] and c.ring_rows() == []


def test_many_requests_and_shared_prefix(impl):
    """Batches large enough that every grid-stride loop takes several programs / blocks."""
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 256, (256, 16), dtype=torch.uint8, generator=g).to(impl.device)
    src = RealKvSource(tensor=t, page_size=1, num_bytes_per_token=16, read_bytes=16)
    num_slots, nreq = 256, 70
    r2t = r2t_table(nreq + 1, 4)
    slots = perm_slots(3 * nreq, num_slots, seed=4)
    for r in range(nreq):
        r2t[r + 1][:3] = slots[3 * r : 3 * r + 3]
    c = Canary(impl, num_slots, sources=(src,), mode=RealKvHashMode.ALL, ring_capacity=8)
    rpi = list(range(1, nreq + 1))
    p = run_plan(
        impl,
        rpi=rpi,
        prefix=[0] * nreq,
        ext=[2] * nreq,
        r2t=r2t,
        write_req_capacity=nreq,
        verify_capacity=256,
    )
    ids = [1000 + k for k in range(2 * nreq)]
    c.write(p, ids, [0, 1] * nreq, [r2t[r][k] for r in rpi for k in range(2)])
    p = run_plan(
        impl,
        rpi=rpi,
        prefix=[2] * nreq,
        ext=[1] * nreq,
        r2t=r2t,
        write_req_capacity=nreq,
        verify_capacity=256,
    )
    assert c.verify(p) == []
    c.write(p, list(range(nreq)), [2] * nreq, [r2t[r][2] for r in rpi])
    p = run_plan(
        impl,
        rpi=rpi,
        prefix=[3] * nreq,
        ext=[1] * nreq,
        r2t=r2t,
        write_req_capacity=nreq,
        verify_capacity=256,
    )
    assert c.verify(p) == []
    assert int(c.ctx.slot_run_counter[0]) == 140 + 140 + 70 + 210


def test_shared_prefix_reported_per_request(impl):
    num_slots, plen = 256, 200
    r2t = r2t_table(4, plen + 2)
    prefix_slots = perm_slots(plen + 3, num_slots, seed=6)
    for rp in (1, 2, 3):
        r2t[rp][:plen] = prefix_slots[:plen]
        r2t[rp][plen] = prefix_slots[plen + rp - 1]
    c = Canary(impl, num_slots, kind=CanaryLaunchTag.SWEEP_K_FULL, ring_capacity=16)
    p = run_plan(
        impl, rpi=[1], prefix=[0], ext=[plen], r2t=r2t, write_req_capacity=3, verify_capacity=640
    )
    c.write(p, [(7 * k) % 997 for k in range(plen)], range(plen), prefix_slots[:plen])
    p = run_plan(
        impl,
        rpi=[1, 2, 3],
        prefix=[plen] * 3,
        ext=[1] * 3,
        r2t=r2t,
        write_req_capacity=3,
        verify_capacity=640,
    )
    assert p.exp.num_valid == 3 * plen
    assert c.verify(p) == []
    c.write(p, [1, 2, 3], [plen] * 3, prefix_slots[plen : plen + 3])
    assert len({c.record(s)[2] for s in prefix_slots[plen : plen + 3]}) == 1
    victim = prefix_slots[150]
    c.set_field(victim, 1, 12345)
    rows = c.verify(p)
    # every request reads the shared slot: three identical rows each for it and its successor
    assert collections.Counter((r[1], r[7]) for r in rows) == {
        (victim, BIT_POS): 3,
        (prefix_slots[151], BIT_CHAIN): 3,
    }


def test_large_batch_crosses_plan_blocks(impl):
    """bs = 1300 (> the 1024-row block of the offsets stage) in one plan launch: running sums
    carry across blocks; every 10th row is live, the others are padding with non-zero lengths."""
    bs, num_slots = 1300, 256
    r2t = r2t_table(bs + 1, 4)
    live = [r for r in range(bs) if r % 10 == 3 or r in (1022, 1023, 1024, 1025)]
    own = {r: 3 + k for k, r in enumerate(live)}  # a distinct decode slot per live request
    assert max(own.values()) < num_slots
    for r in live:
        r2t[r + 1][:3] = [1, 2, own[r]]  # all share the two-slot prefix (radix sharing)
    rpi = [r + 1 if r in own else 0 for r in range(bs)]
    c = Canary(impl, num_slots, ring_capacity=8)
    c.set_record(1, [500, 0, to_int64(HEAD), 0])
    c.set_record(2, [501, 1, to_int64(rec_hash(c.oracle.recs[1])), 0])
    p = run_plan(
        impl,
        rpi=rpi,
        prefix=[2] * bs,
        ext=[1] * bs,
        r2t=r2t,
        write_req_capacity=bs + 5,
        verify_capacity=3 * len(live),
    )
    assert p.exp.num_valid == 2 * len(live)
    assert p.exp.write_offsets[bs] == len(live)
    assert c.verify(p) == []
    assert c.write(p, [600 + r for r in live], [2] * len(live), [own[r] for r in live]) == []
    p = run_plan(
        impl,
        rpi=rpi,
        prefix=[3] * bs,
        ext=[1] * bs,
        r2t=r2t,
        write_req_capacity=bs + 5,
        verify_capacity=3 * len(live),
    )
    assert c.verify(p) == []
    c.set_field(2, 1, 7)  # the shared position-1 record: every live request reports it
    rows = c.verify(p)
    assert sorted(collections.Counter((r[1], r[7]) for r in rows).items()) == sorted(
        {(2, BIT_POS): len(live), **{(own[r], BIT_CHAIN): 1 for r in live}}.items()
    )


def test_verify_out_of_range_entries(impl):
    """Hand plan entries pointing outside the buffer are skipped / not chain-checked."""
    c = Canary(impl, 16)
    c.set_record(4, [40, 0, to_int64(HEAD), 0])
    c.set_record(5, [50, 3, 0x1234, 0])
    rows = c.verify(
        hand_verify_plan(
            impl,
            [
                (16, -1, 0, -1),  # slot == num_slots: skipped
                (-3, -1, 0, -1),  # negative slot: skipped
                (5, -1, 3, 16),  # prev out of range: chain not checked
                (5, -1, 3, -2),  # prev < -1: chain not checked
                (5, -1, 3, 4),  # checked: 0x1234 != H(record 4)
            ],
        )
    )
    assert [(r[1], r[7]) for r in rows] == [(5, BIT_CHAIN)]
    assert rows[0][6] == to_int64(rec_hash(c.oracle.recs[4]))
    assert int(c.ctx.slot_run_counter[0]) == 5


# =============================================================================================
# Token-id scatter
# =============================================================================================


def oracle_scatter(pool, flat, offsets, rpi, starts=None):
    pool = [list(r) for r in pool]
    cols = len(pool[0])
    for r, rp in enumerate(rpi):
        first = starts[r] if starts is not None else 0
        if not 0 <= rp < len(pool) or first < 0:
            continue  # rows outside the pool / negative starts are skipped (launcher docstring)
        for t in range(offsets[r], offsets[r + 1]):
            pos = first + t - offsets[r]
            if pos < cols:
                v = flat[t] & 0xFFFFFFFF
                pool[rp][pos] = v - (1 << 32) if v >= (1 << 31) else v
    return pool


def _run_scatter(impl, pool, flat, lengths, rpi, starts=None):
    dev = impl.device
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    out = torch.tensor(pool, dtype=torch.int32, device=dev)
    extra = {} if starts is None else dict(dst_starts=tensor_of(starts, torch.int64, dev))
    impl.scatter(
        flat_in=tensor_of(flat, torch.int64, dev),
        offsets=tensor_of(offsets, torch.int64, dev),
        req_pool_indices=tensor_of(rpi, torch.int64, dev),
        pool_out=out,
        **extra,
    )
    want = oracle_scatter(pool, flat, offsets, rpi, starts)
    assert out.cpu().tolist() == want
    return want


def test_scatter_truncation_and_untouched_rows(impl):
    pool = [[-7] * 4 for _ in range(6)]
    flat = [10, 11, 12, 13, 14, 15, 20, 21, 30, 31, 32, 33, 34, 40, (1 << 32) + 41, 50, 60]
    got = _run_scatter(impl, pool, flat, [6, 2, 5, 2, 1, 1], [4, 1, 2, 0, 6, -1])
    assert got[4] == [10, 11, 12, 13]  # truncated at pool_out.shape[1]
    assert got[1] == [20, 21, -7, -7]
    assert got[2] == [30, 31, 32, 33]
    assert got[0] == [40, 41, -7, -7]  # row 0 is a row like any other
    for r in (3, 5):
        assert got[r] == [-7] * 4  # rows not named (or out of the pool) are untouched


def test_scatter_dst_starts_append_after_what_a_row_holds(impl):
    pool = [[-7] * 5 for _ in range(5)]
    flat = [10, 11, 20, 30, 31, 32, 40, 50]
    # row 4: 2 tokens from column 3 (1 dropped past the end); row 1: 1 token at column 0;
    # row 2: 3 tokens from column 5 (all past the end); row 0: a negative start (skipped);
    # row 3: 1 token from column 4; row 9: outside the pool
    got = _run_scatter(
        impl, pool, flat, [2, 1, 3, 1, 1, 0], [4, 1, 2, 0, 3, 9], starts=[3, 0, 5, -1, 4, 0]
    )
    assert got[4] == [-7, -7, -7, 10, 11]
    assert got[1] == [20, -7, -7, -7, -7]
    assert got[2] == [-7] * 5 and got[0] == [-7] * 5
    assert got[3] == [-7, -7, -7, -7, 50]


def test_scatter_empty_is_noop(impl):
    pool = [[3, 4, 5]] * 3
    assert _run_scatter(impl, pool, [], [], []) == pool
    assert _run_scatter(impl, pool, [], [0, 0], [1, 2]) == pool


def test_scatter_bs4096_one_launch(impl):
    bs = 4096
    rng = random.Random(11)
    lengths = [rng.randrange(0, 4) for _ in range(bs)]
    rpi = list(range(1, bs + 1))
    rng.shuffle(rpi)
    flat = [rng.randrange(0, 150000) for _ in range(sum(lengths))]
    pool = [[-1, -1] for _ in range(bs + 2)]
    got = _run_scatter(impl, pool, flat, lengths, rpi)
    assert got[0] == [-1, -1] and got[bs + 1] == [-1, -1]
    r = lengths.index(3)
    assert got[rpi[r]] == flat[sum(lengths[:r]) : sum(lengths[:r]) + 2]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
