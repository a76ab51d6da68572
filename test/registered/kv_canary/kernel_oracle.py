"""The scalar oracle and harness of the KV-canary kernels' hand cases
(``test_kernels_hand.py``: plan, verify, real-KV fingerprints, chain checks;
``test_kernels_hand_writes.py``: writes, the violation ring, records, slot 0, batches, the
token-id scatter).

The oracle is plain Python (python ints, one entry at a time) written from
docs/architecture.md ("Record format" through "Token-id scatter") and the launchers'
docstrings; it only borrows the hash primitives of ``consts`` (themselves checked against the
documented formula in ``test_hash_primitives_match_spec``). Real-KV fingerprints are computed
from the source tensors' raw bytes (``tensor.view(torch.uint8)``). The ``impl`` fixture runs
every kernel case twice: ``triton`` (the public launchers, Triton's interpreter on CPU, the
reference path patched to raise) and ``torch_ref`` (the ``*_torch_reference`` functions).
"""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Callable, List, Sequence

import torch

from canary_testlib import make_context

from sglang.jit_kernel.kv_canary import (
    CanaryLaunchTag,
    PlanLanes,
    RealKvHashMode,
    RealKvSource,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
    launch_scatter_req_token_ids_kernel,
    scatter_req_token_ids_torch_reference,
)
from sglang.jit_kernel.kv_canary import _launch
from sglang.jit_kernel.kv_canary import plan_ref as _plan_ref_mod
from sglang.jit_kernel.kv_canary import scatter_req_token_ids as _scatter_mod
from sglang.jit_kernel.kv_canary import verify_ref as _verify_ref_mod
from sglang.jit_kernel.kv_canary import write_ref as _write_ref_mod
from sglang.jit_kernel.kv_canary.consts import (
    NO_KV_LAYER,
    canary_chain_head_hash,
    splitmix64,
    canary_chain_step,
    to_int64,
)

MASK64 = (1 << 64) - 1
HEAD = canary_chain_head_hash()  # H(none), u64

BIT_CHAIN = 1
BIT_POS = 2
BIT_REAL_KV = 4
BIT_WRITE_TOKEN = 8
BIT_WRITE_POS = 16
BIT_TOKEN = 32

SENTINEL = 777_777  # pre-filled into plan tensors to detect "untouched"


# =============================================================================================
# Implementations under test
# =============================================================================================


@dataclasses.dataclass
class Impl:
    name: str
    device: torch.device
    plan: Callable
    write: Callable
    verify: Callable
    scatter: Callable


def _no_fallback(name):
    def boom(**kwargs):
        raise AssertionError(f"public launcher fell back to {name} instead of running Triton")

    return boom


IMPLS = ("triton", "torch_ref")


def make_impl(name: str, device, monkeypatch) -> Impl:
    """The implementation ``name`` (one of :data:`IMPLS`) of the ``impl`` fixture
    (``conftest.py``: ``@pytest.fixture(params=IMPLS)``, returning this)."""
    if name == "triton":
        if device.type == "cpu":
            assert _launch.TRITON_INTERPRET, (
                "TRITON_INTERPRET must be on so that CPU launches run the Triton kernels"
            )
        # A launcher that dispatched to its torch reference would not be testing Triton. The
        # launchers validate, then call the unvalidated ``run_*`` reference (looked up on its
        # module at call time) on their CPU path: patch those.
        monkeypatch.setattr(
            _plan_ref_mod, "run_canary_plan_reference", _no_fallback("plan reference")
        )
        monkeypatch.setattr(
            _write_ref_mod, "run_canary_write_reference", _no_fallback("write reference")
        )
        monkeypatch.setattr(
            _verify_ref_mod, "run_canary_verify_reference", _no_fallback("verify reference")
        )
        monkeypatch.setattr(
            _scatter_mod, "run_scatter_req_token_ids_reference", _no_fallback("scatter reference")
        )
        return Impl(
            "triton",
            device,
            launch_canary_plan_kernels,
            launch_canary_write_kernel,
            launch_canary_verify_kernel,
            launch_scatter_req_token_ids_kernel,
        )
    return Impl(
        "torch_ref",
        torch.device("cpu"),
        launch_canary_plan_kernels_torch_reference,
        launch_canary_write_kernel_torch_reference,
        launch_canary_verify_kernel_torch_reference,
        scatter_req_token_ids_torch_reference,
    )


# =============================================================================================
# The scalar oracle
# =============================================================================================


def rec_hash(rec) -> int:
    """H(record) = prev_hash * CANARY_CHAIN_MUL + e(token, position) mod 2**64."""
    return canary_chain_step(rec[2] & MASK64, rec[0] & MASK64, rec[1] & MASK64)


def slot_bytes(src: RealKvSource, slot: int, nbytes: int) -> bytes:
    """``tensor_u8[slot // page_size, (slot % page_size) * nbpt : ... + nbytes]``
    (docs/architecture.md, "Record format")."""
    page = slot // src.page_size
    row_u8 = src.tensor[page].detach().cpu().contiguous().view(torch.uint8).reshape(-1)
    off = (slot % src.page_size) * src.num_bytes_per_token
    return bytes(row_u8[off : off + nbytes].tolist())


def fold_le_words(data: bytes) -> int:
    assert len(data) % 8 == 0
    acc = 0
    for i in range(0, len(data), 8):
        acc = splitmix64(acc ^ int.from_bytes(data[i : i + 8], "little"))
    return acc


def oracle_fingerprint(sources: Sequence[RealKvSource], mode: RealKvHashMode, slot: int) -> int:
    if mode == RealKvHashMode.NONE or not sources:
        return 0
    acc = 0
    for s in sources:
        nbytes = min(16, s.read_bytes) if mode == RealKvHashMode.PARTIAL else s.read_bytes
        acc = splitmix64(acc ^ fold_le_words(slot_bytes(s, slot, nbytes)))
    return acc


@dataclasses.dataclass
class ExpectedPlan:
    """Oracle view of a VerifyPlan + WritePlan pair (full-capacity lists)."""

    slots: List[int]
    toks: List[int]
    poss: List[int]
    prevs: List[int]
    num_valid: int
    enable: int
    write_offsets: List[int]
    seeds: List[int]
    nreq: int
    # req_to_token row per verify entry / per write request (-1: none), full-capacity lists
    req_rows: List[int] = dataclasses.field(default_factory=list)
    write_rows: List[int] = dataclasses.field(default_factory=list)

    @property
    def entries(self):
        n = self.num_valid if self.enable == 1 else 0
        return list(zip(self.slots[:n], self.toks[:n], self.poss[:n], self.prevs[:n]))


def oracle_plan(
    *,
    rpi,
    prefix,
    ext,
    r2t,
    window,
    lut,
    verify_capacity,
    write_req_capacity,
    exp_pool=None,
    valid_lens=None,
    offset=0,
    lanes=None,
) -> ExpectedPlan:
    """``lanes``: ``(verify_from, branch_split, branch_shift)`` lists (``PlanLanes``) or None."""
    rows = len(r2t)
    cols = len(r2t[0]) if rows else 0

    def T(x):
        if lut is None or x < 0:
            return x
        return lut[x] if x < len(lut) else 0  # out of the table: treated as evicted

    entries = []
    woff = [0]
    seeds = []
    write_rows = []
    for r, rp in enumerate(rpi):
        live = 0 < rp < rows
        pl = min(max(prefix[r], 0), cols)

        def col(q):
            if lanes is None:
                return q
            return min(max(q + (lanes[2][r] if q >= lanes[1][r] else 0), 0), cols - 1)

        if live:
            ws = max(0, pl - window) if window > 0 else 0
            if lanes is not None:
                ws = max(ws, min(max(lanes[0][r], 0), pl))
            for p in range(ws, pl):
                slot = T(r2t[rp][col(p)])
                prev = T(r2t[rp][col(p - 1)]) if p > 0 else -1
                tok = -1
                if exp_pool is not None:
                    idx = p + offset
                    if 0 <= idx < valid_lens[r] and idx < len(exp_pool[0]) and rp < len(exp_pool):
                        tok = exp_pool[rp][idx]
                entries.append((slot, tok, p, prev, rp))
        woff.append(woff[-1] + (ext[r] if live and ext[r] > 0 else 0))
        seeds.append(T(r2t[rp][col(pl - 1)]) if live and pl > 0 else -1)
        write_rows.append(rp if live else -1)
    bs = len(rpi)
    woff += [0] * (write_req_capacity - bs)
    seeds += [-1] * (write_req_capacity - bs)
    write_rows += [-1] * (write_req_capacity - bs)
    total = len(entries)
    cols5 = [[SENTINEL] * verify_capacity for _ in range(5)]
    if total <= verify_capacity:
        enable, num_valid = 1, total
        for e, entry in enumerate(entries):
            for k in range(5):
                cols5[k][e] = entry[k]
    else:
        enable, num_valid = 0, verify_capacity
    return ExpectedPlan(
        *cols5[:4],
        num_valid=num_valid,
        enable=enable,
        write_offsets=woff,
        seeds=seeds,
        nreq=bs,
        req_rows=cols5[4],
        write_rows=write_rows,
    )


class Oracle:
    """Records, ring and counters of one canary buffer, advanced one entry at a time."""

    def __init__(self, num_slots, *, kind, ring_capacity, sources, mode, chain_assert):
        self.recs = [[0, 0, 0, 0] for _ in range(num_slots)]  # int64 bit patterns
        self.kind = int(kind)
        self.ring_capacity = ring_capacity
        self.sources = tuple(sources)
        self.mode = RealKvHashMode(mode)
        self.chain_assert = chain_assert
        self.launch_rows: List[List[tuple]] = []
        self.slot_counter = 0
        self.kernel_counter = 0

    @property
    def num_slots(self):
        return len(self.recs)

    @property
    def count(self):
        return sum(len(r) for r in self.launch_rows)

    def _row(self, *cols):
        # the record's own checks: no per-layer fingerprint column (kv_layer = NO_KV_LAYER)
        return tuple(to_int64(c) for c in (self.kind,) + cols + (NO_KV_LAYER,))

    def write(
        self, plan: ExpectedPlan, input_ids, positions, loc, *, input_assert, exp_tok, exp_pos
    ):
        self.kernel_counter += 1
        nreq = min(max(plan.nreq, 0), len(plan.seeds))
        n = len(input_ids)
        starts = []
        for r in range(nreq):  # every chain start is read before anything is written
            seed = plan.seeds[r]
            if 0 <= seed < self.num_slots:
                # slot 0 (evicted SWA predecessor) has no real position to follow
                starts.append((rec_hash(self.recs[seed]), self.recs[seed][1], seed > 0))
            else:
                starts.append((HEAD, 0, False))
        rows = []
        stored = []
        for r in range(nreq):
            running, prev_pos, has_seed = starts[r]
            for i in range(plan.write_offsets[r], plan.write_offsets[r + 1]):
                if not 0 <= i < n:
                    continue
                tok, pos, slot = input_ids[i], positions[i], loc[i]
                bits = 0
                etok, epos = tok, pos
                if input_assert:
                    etok, epos = exp_tok[i], exp_pos[i]
                    if tok != etok:
                        bits |= BIT_WRITE_TOKEN
                    if pos != epos:
                        bits |= BIT_WRITE_POS
                if has_seed and self.chain_assert == 1 and pos != prev_pos + 1:
                    bits |= BIT_WRITE_POS
                    epos = prev_pos + 1
                if 0 <= slot < self.num_slots:
                    self.recs[slot] = [tok, pos, to_int64(running), 0]
                    stored.append(slot)
                    if bits:
                        rows.append(
                            self._row(
                                slot, pos, tok, etok, running, epos, bits, pos, plan.write_rows[r]
                            )
                        )
                running = canary_chain_step(running, tok, pos)
                prev_pos = pos
        for slot in stored:
            self.recs[slot][3] = to_int64(oracle_fingerprint(self.sources, self.mode, slot))
        self.slot_counter += len(stored)
        self.launch_rows.append(rows)
        return rows

    def verify(self, plan: ExpectedPlan, capacity: int, check_token: bool):
        self.kernel_counter += 1
        rows = []
        if plan.enable != 1:
            self.launch_rows.append(rows)
            return rows
        n = min(max(plan.num_valid, 0), capacity)
        self.slot_counter += n
        for e in range(n):
            slot, etok, epos, prev = plan.slots[e], plan.toks[e], plan.poss[e], plan.prevs[e]
            req_row = plan.req_rows[e]
            if not 0 < slot < self.num_slots:
                continue
            tok, pos, prev_hash, kv = self.recs[slot]
            if prev == -1:
                check, exp_chain = True, HEAD
            elif 0 < prev < self.num_slots:
                check, exp_chain = True, rec_hash(self.recs[prev])
            else:
                check, exp_chain = False, None
            bits = 0
            if check and prev_hash != to_int64(exp_chain):
                bits |= BIT_CHAIN
            if pos != epos:
                bits |= BIT_POS
            if check_token and etok != -1 and tok != etok:
                bits |= BIT_TOKEN
            if self.mode != RealKvHashMode.NONE and self.sources:
                if kv != to_int64(oracle_fingerprint(self.sources, self.mode, slot)):
                    bits |= BIT_REAL_KV
            if bits:
                aux = exp_chain if check else prev_hash
                rows.append(
                    self._row(
                        slot,
                        pos,
                        tok,
                        etok if check_token else -1,
                        prev_hash,
                        aux,
                        bits,
                        epos,
                        req_row,
                    )
                )
        self.launch_rows.append(rows)
        return rows


# =============================================================================================
# Harness: run the implementation and the oracle side by side
# =============================================================================================


def tensor_of(values, dtype, device):
    return torch.tensor(list(values), dtype=dtype, device=device)


def assert_plan_tensors(vp: VerifyPlan, wp: WritePlan, exp: ExpectedPlan, where=""):
    got = {
        "verify_slot_indices": vp.verify_slot_indices.cpu().tolist(),
        "verify_expected_tokens": vp.verify_expected_tokens.cpu().tolist(),
        "verify_expected_positions": vp.verify_expected_positions.cpu().tolist(),
        "verify_prev_slot_indices": vp.verify_prev_slot_indices.cpu().tolist(),
        "verify_req_to_token_rows": vp.verify_req_to_token_rows.cpu().tolist(),
        "verify_num_valid": int(vp.verify_num_valid[0]),
        "enable": int(vp.enable[0]),
        "write_offsets": wp.write_offsets.cpu().tolist(),
        "write_seed_slot_indices": wp.write_seed_slot_indices.cpu().tolist(),
        "write_req_to_token_rows": wp.write_req_to_token_rows.cpu().tolist(),
        "write_num_valid_reqs": int(wp.write_num_valid_reqs[0]),
    }
    want = {
        "verify_slot_indices": exp.slots,
        "verify_expected_tokens": exp.toks,
        "verify_expected_positions": exp.poss,
        "verify_prev_slot_indices": exp.prevs,
        "verify_req_to_token_rows": exp.req_rows,
        "verify_num_valid": exp.num_valid,
        "enable": exp.enable,
        "write_offsets": exp.write_offsets,
        "write_seed_slot_indices": exp.seeds,
        "write_req_to_token_rows": exp.write_rows,
        "write_num_valid_reqs": exp.nreq,
    }
    for k in want:
        assert got[k] == want[k], f"{where}{k}: got {got[k]}, expected {want[k]}"


@dataclasses.dataclass
class Plans:
    vp: VerifyPlan
    wp: WritePlan
    exp: ExpectedPlan


def run_plan(
    impl: Impl,
    *,
    rpi,
    prefix,
    ext,
    r2t,
    window=0,
    lut=None,
    verify_capacity=64,
    write_req_capacity=8,
    exp_pool=None,
    valid_lens=None,
    offset=0,
    dtype=torch.int64,
    r2t_dtype=torch.int32,
    lanes=None,
) -> Plans:
    """Run the plan launcher on ``impl`` (sentinel-filled plans), check against the oracle."""
    dev = impl.device
    vp = VerifyPlan.allocate(verify_capacity=verify_capacity, device=dev)
    wp = WritePlan.allocate(write_req_capacity=write_req_capacity, device=dev)
    for t in (
        vp.verify_slot_indices,
        vp.verify_expected_tokens,
        vp.verify_expected_positions,
        vp.verify_prev_slot_indices,
        vp.verify_req_to_token_rows,
    ):
        t.fill_(SENTINEL)
    vp.verify_num_valid.fill_(-5)
    vp.enable.fill_(-5)
    wp.write_offsets.fill_(SENTINEL)
    wp.write_seed_slot_indices.fill_(SENTINEL)
    wp.write_req_to_token_rows.fill_(SENTINEL)
    wp.write_num_valid_reqs.fill_(-5)
    impl.plan(
        verify_plan_out=vp,
        write_plan_out=wp,
        req_pool_indices=tensor_of(rpi, dtype, dev),
        prefix_lens=tensor_of(prefix, dtype, dev),
        extend_seq_lens=tensor_of(ext, dtype, dev),
        req_to_token=torch.tensor(r2t, dtype=r2t_dtype, device=dev),
        swa_window_size=window,
        full_to_swa_index_mapping=None if lut is None else tensor_of(lut, torch.int64, dev),
        verify_capacity=verify_capacity,
        req_to_verify_expected_tokens=None
        if exp_pool is None
        else torch.tensor(exp_pool, dtype=torch.int32, device=dev),
        req_to_verify_expected_tokens_valid_lens=None
        if valid_lens is None
        else tensor_of(valid_lens, dtype, dev),
        kv_token_id_vs_position_offset=offset,
        **(
            {}
            if lanes is None
            else {"lanes": PlanLanes(*(tensor_of(list(v), torch.int64, dev) for v in lanes))}
        ),
    )
    exp = oracle_plan(
        rpi=rpi,
        prefix=prefix,
        ext=ext,
        r2t=r2t,
        window=window,
        lut=lut,
        verify_capacity=verify_capacity,
        write_req_capacity=write_req_capacity,
        exp_pool=exp_pool,
        valid_lens=valid_lens,
        offset=offset,
        lanes=lanes,
    )
    assert_plan_tensors(vp, wp, exp, where=f"[{impl.name} plan] ")
    return Plans(vp, wp, exp)


def hand_verify_plan(impl: Impl, entries, *, capacity=None, num_valid=None, enable=1) -> Plans:
    """A VerifyPlan built by hand from ``(slot, expected_token, expected_position, prev[,
    req_to_token_row])`` (the row defaults to -1)."""
    dev = impl.device
    capacity = len(entries) if capacity is None else capacity
    num_valid = len(entries) if num_valid is None else num_valid
    cols = [[SENTINEL] * capacity for _ in range(5)]
    for e, entry in enumerate(entries):
        entry = tuple(entry) + (-1,) * (5 - len(entry))
        for k in range(5):
            cols[k][e] = entry[k]
    vp = VerifyPlan(
        verify_slot_indices=tensor_of(cols[0], torch.int64, dev),
        verify_expected_tokens=tensor_of(cols[1], torch.int64, dev),
        verify_expected_positions=tensor_of(cols[2], torch.int64, dev),
        verify_prev_slot_indices=tensor_of(cols[3], torch.int64, dev),
        verify_req_to_token_rows=tensor_of(cols[4], torch.int64, dev),
        verify_num_valid=tensor_of([num_valid], torch.int32, dev),
        enable=tensor_of([enable], torch.int32, dev),
    )
    exp = ExpectedPlan(
        *cols[:4],
        num_valid=num_valid,
        enable=enable,
        write_offsets=[0],
        seeds=[],
        nreq=0,
        req_rows=cols[4],
    )
    return Plans(vp, None, exp)


def hand_write_plan(impl: Impl, lengths, seeds, rows=None) -> Plans:
    dev = impl.device
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    rows = [-1] * len(seeds) if rows is None else list(rows)
    wp = WritePlan(
        write_offsets=tensor_of(offs, torch.int64, dev),
        write_seed_slot_indices=tensor_of(seeds, torch.int64, dev),
        write_req_to_token_rows=tensor_of(rows, torch.int64, dev),
        write_num_valid_reqs=tensor_of([len(seeds)], torch.int32, dev),
        verify_req_offsets=torch.zeros(len(seeds) + 1, dtype=torch.int64, device=dev),
    )
    exp = ExpectedPlan(
        [],
        [],
        [],
        [],
        0,
        1,
        write_offsets=offs,
        seeds=list(seeds),
        nreq=len(seeds),
        write_rows=rows,
    )
    return Plans(None, wp, exp)


class Canary:
    """One canary buffer on ``impl`` plus its oracle twin; every launch is checked exactly."""

    def __init__(
        self,
        impl: Impl,
        num_slots: int,
        *,
        kind=CanaryLaunchTag.TAIL_K_FULL,
        sources=(),
        mode=RealKvHashMode.NONE,
        ring_capacity=64,
        chain_assert=1,
        garbage_slot0=True,
    ):
        self.impl = impl
        dev = impl.device
        self.ctx = make_context(
            num_slots,
            device=dev,
            kind=kind,
            sources=sources,
            mode=mode,
            ring_capacity=ring_capacity,
            chain_assert=chain_assert,
        )
        self.oracle = Oracle(
            num_slots,
            kind=kind,
            ring_capacity=ring_capacity,
            sources=sources,
            mode=mode,
            chain_assert=chain_assert,
        )
        if garbage_slot0:
            # Slot 0 is the padding slot: never verified, so garbage there must never show up.
            self.set_record(0, [-3, 99999, 0x1234, 0x5678])

    # ---- direct record access (both sides) ----
    def set_record(self, slot, values):
        values = [to_int64(v) for v in values]
        self.ctx.canary_words[slot] = torch.tensor(values, dtype=torch.int64)
        self.oracle.recs[slot] = list(values)

    def set_field(self, slot, field, value):
        rec = list(self.oracle.recs[slot])
        rec[field] = value
        self.set_record(slot, rec)

    def record(self, slot):
        return self.ctx.canary_words[slot].cpu().tolist()

    # ---- launches ----
    def write(
        self,
        plans: Plans,
        input_ids,
        positions,
        loc,
        *,
        input_assert=False,
        exp_tok=None,
        exp_pos=None,
        dtype=torch.int64,
    ):
        dev = self.impl.device
        self.impl.write(
            context=self.ctx,
            plan=plans.wp,
            input_ids=tensor_of(input_ids, dtype, dev),
            positions=tensor_of(positions, dtype, dev),
            out_cache_loc=tensor_of(loc, torch.int64, dev),
            enable_write_input_assert=input_assert,
            expected_input_tokens=None if exp_tok is None else tensor_of(exp_tok, dtype, dev),
            expected_input_positions=None if exp_pos is None else tensor_of(exp_pos, dtype, dev),
        )
        rows = self.oracle.write(
            plans.exp,
            list(input_ids),
            list(positions),
            list(loc),
            input_assert=input_assert,
            exp_tok=exp_tok,
            exp_pos=exp_pos,
        )
        self.check(f"[{self.impl.name} write] ")
        return rows

    def verify(self, plans: Plans, *, check_token=False):
        self.impl.verify(context=self.ctx, plan=plans.vp, check_verify_expected_token=check_token)
        rows = self.oracle.verify(plans.exp, plans.vp.capacity, check_token)
        self.check(f"[{self.impl.name} verify] ")
        return rows

    # ---- comparisons ----
    def ring_rows(self):
        """Kept ring rows of the implementation (sorted tuples)."""
        n = min(int(self.ctx.violation_write_index[0]), self.ctx.ring_capacity)
        return sorted(tuple(r) for r in self.ctx.violation_ring[:n].cpu().tolist())

    def check(self, where=""):
        ctx, orc = self.ctx, self.oracle
        got_recs = ctx.canary_words.cpu().tolist()
        for s, (g, w) in enumerate(zip(got_recs, orc.recs)):
            assert g == w, f"{where}record of slot {s}: got {g}, expected {w}"
        assert int(ctx.violation_write_index[0]) == orc.count, (
            f"{where}violation_write_index {int(ctx.violation_write_index[0])} != {orc.count}"
        )
        assert int(ctx.slot_run_counter[0]) == orc.slot_counter, (
            f"{where}slot_run_counter {int(ctx.slot_run_counter[0])} != {orc.slot_counter}"
        )
        assert int(ctx.kernel_run_counter[0]) == orc.kernel_counter, (
            f"{where}kernel_run_counter {int(ctx.kernel_run_counter[0])} != {orc.kernel_counter}"
        )
        cap = ctx.ring_capacity
        ring = ctx.violation_ring.cpu().tolist()
        kept = min(orc.count, cap)
        assert all(v == 0 for row in ring[kept:] for v in row), (
            f"{where}ring rows past the kept ones were written"
        )
        actual = collections.Counter(tuple(r) for r in ring[:kept])
        # Fill-once ring: whole launches are kept in launch order; the launch that crosses the
        # capacity keeps some of its rows (which ones depends on lane order).
        room = cap
        expected_full = collections.Counter()
        partial = None
        for rows in orc.launch_rows:
            if room <= 0:
                break
            if len(rows) <= room:
                expected_full.update(rows)
                room -= len(rows)
            else:
                partial = (collections.Counter(rows), room)
                room = 0
        if partial is None:
            assert actual == expected_full, (
                f"{where}ring rows differ:\n got  {sorted(actual.elements())}\n want "
                f"{sorted(expected_full.elements())}"
            )
        else:
            missing = expected_full - actual
            assert not missing, f"{where}ring lost rows of earlier launches: {missing}"
            rest = actual - expected_full
            pool, n_kept = partial
            assert sum(rest.values()) == n_kept, f"{where}crossing launch kept {rest}"
            assert not (rest - pool), (
                f"{where}ring holds rows the oracle never produced: {rest - pool}"
            )


def perm_slots(n_needed, num_slots, seed):
    """Distinct non-zero slots in a scrambled order."""
    rng = random.Random(seed)
    slots = list(range(1, num_slots))
    rng.shuffle(slots)
    return slots[:n_needed]


def r2t_table(rows, cols, fill=0):
    return [[fill] * cols for _ in range(rows)]


def sglang_tree_lists(parent_rows):
    """sglang's linked lists of draft trees (``EagleVerifyInput.retrieve_next_token`` /
    ``retrieve_next_sibling``, as sgl-kernel's ``build_tree_efficient`` links them): per tree
    (a row of ``parent_rows``: each node's parent index, -1 the root, -2 an orphan no list
    names) a node's first child, then each child's next sibling, in index order. int64
    ``[trees, nodes]`` each, -1 for none."""
    n = len(parent_rows[0])
    first = torch.full((len(parent_rows), n), -1, dtype=torch.int64)
    sibling = torch.full((len(parent_rows), n), -1, dtype=torch.int64)
    for b, parents in enumerate(parent_rows):
        last_child = {}
        for c, p in enumerate(parents):
            if p < 0:
                continue
            if p in last_child:
                sibling[b, last_child[p]] = c
            else:
                first[b, p] = c
            last_child[p] = c
    return first, sibling


# =============================================================================================
# Contract values (no kernels)
# =============================================================================================


def sm64_spec(x):
    m = MASK64
    x &= m
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    x ^= x >> 31
    return x
