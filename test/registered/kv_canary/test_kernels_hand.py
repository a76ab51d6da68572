"""Hand cases for the KV-canary kernels, checked against an independent scalar oracle.

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

import collections
import dataclasses
import random
import sys
from typing import Callable, List, Sequence

import pytest
import torch

from canary_testlib import make_context

from sglang.jit_kernel.kv_canary import (
    CANARY_CHAIN_ANCHOR,
    CanaryLaunchTag,
    CanaryPhase,
    FailReason,
    KvHalf,
    PoolKind,
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
    splitmix64_mix3,
    to_int64,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

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


@pytest.fixture(params=["triton", "torch_ref"])
def impl(request, device, monkeypatch):
    if request.param == "triton":
        if device.type == "cpu":
            assert _launch.TRITON_INTERPRET, (
                "TRITON_INTERPRET must be on so that CPU launches run the Triton kernels")
        # A launcher that dispatched to its torch reference would not be testing Triton. The
        # launchers validate, then call the unvalidated ``run_*`` reference (looked up on its
        # module at call time) on their CPU path: patch those.
        monkeypatch.setattr(_plan_ref_mod, "run_canary_plan_reference",
                            _no_fallback("plan reference"))
        monkeypatch.setattr(_write_ref_mod, "run_canary_write_reference",
                            _no_fallback("write reference"))
        monkeypatch.setattr(_verify_ref_mod, "run_canary_verify_reference",
                            _no_fallback("verify reference"))
        monkeypatch.setattr(_scatter_mod, "run_scatter_req_token_ids_reference",
                            _no_fallback("scatter reference"))
        return Impl("triton", device, launch_canary_plan_kernels, launch_canary_write_kernel,
                    launch_canary_verify_kernel, launch_scatter_req_token_ids_kernel)
    return Impl("torch_ref", torch.device("cpu"), launch_canary_plan_kernels_torch_reference,
                launch_canary_write_kernel_torch_reference,
                launch_canary_verify_kernel_torch_reference,
                scatter_req_token_ids_torch_reference)


# =============================================================================================
# The scalar oracle
# =============================================================================================


def rec_hash(rec) -> int:
    """H(record) = mix3(prev_hash, token, position), u64."""
    return splitmix64_mix3(rec[2] & MASK64, rec[0] & MASK64, rec[1] & MASK64)


def slot_bytes(src: RealKvSource, slot: int, nbytes: int) -> bytes:
    """``tensor_u8[slot // page_size, (slot % page_size) * nbpt : ... + nbytes]``
    (docs/architecture.md, "Record format")."""
    page = slot // src.page_size
    row_u8 = src.tensor[page].detach().cpu().contiguous().view(torch.uint8).reshape(-1)
    off = (slot % src.page_size) * src.num_bytes_per_token
    return bytes(row_u8[off:off + nbytes].tolist())


def fold_le_words(data: bytes) -> int:
    assert len(data) % 8 == 0
    acc = 0
    for i in range(0, len(data), 8):
        acc = splitmix64(acc ^ int.from_bytes(data[i:i + 8], "little"))
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


def oracle_plan(*, rpi, prefix, ext, r2t, window, lut, verify_capacity, write_req_capacity,
                exp_pool=None, valid_lens=None, offset=0) -> ExpectedPlan:
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
        if live:
            ws = max(0, pl - window) if window > 0 else 0
            for p in range(ws, pl):
                slot = T(r2t[rp][p])
                prev = T(r2t[rp][p - 1]) if p > 0 else -1
                tok = -1
                if exp_pool is not None:
                    idx = p + offset
                    if 0 <= idx < valid_lens[r] and idx < len(exp_pool[0]) and rp < len(exp_pool):
                        tok = exp_pool[rp][idx]
                entries.append((slot, tok, p, prev, rp))
        woff.append(woff[-1] + (ext[r] if live and ext[r] > 0 else 0))
        seeds.append(T(r2t[rp][pl - 1]) if live and pl > 0 else -1)
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
    return ExpectedPlan(*cols5[:4], num_valid=num_valid, enable=enable, write_offsets=woff,
                        seeds=seeds, nreq=bs, req_rows=cols5[4], write_rows=write_rows)


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

    def write(self, plan: ExpectedPlan, input_ids, positions, loc, *, input_assert,
              exp_tok, exp_pos):
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
                        rows.append(self._row(slot, pos, tok, etok, running, epos, bits, pos,
                                              plan.write_rows[r]))
                running = splitmix64_mix3(running, tok, pos)
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
                rows.append(self._row(slot, pos, tok, etok if check_token else -1, prev_hash,
                                      aux, bits, epos, req_row))
        self.launch_rows.append(rows)
        return rows


# =============================================================================================
# Harness: run the implementation and the oracle side by side
# =============================================================================================


def _tensor(values, dtype, device):
    return torch.tensor(list(values), dtype=dtype, device=device)


def _assert_plan_tensors(vp: VerifyPlan, wp: WritePlan, exp: ExpectedPlan, where=""):
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


def run_plan(impl: Impl, *, rpi, prefix, ext, r2t, window=0, lut=None, verify_capacity=64,
             write_req_capacity=8, exp_pool=None, valid_lens=None, offset=0,
             dtype=torch.int64, r2t_dtype=torch.int32) -> Plans:
    """Run the plan launcher on ``impl`` (sentinel-filled plans), check against the oracle."""
    dev = impl.device
    vp = VerifyPlan.allocate(verify_capacity=verify_capacity, device=dev)
    wp = WritePlan.allocate(write_req_capacity=write_req_capacity, device=dev)
    for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
              vp.verify_prev_slot_indices, vp.verify_req_to_token_rows):
        t.fill_(SENTINEL)
    vp.verify_num_valid.fill_(-5)
    vp.enable.fill_(-5)
    wp.write_offsets.fill_(SENTINEL)
    wp.write_seed_slot_indices.fill_(SENTINEL)
    wp.write_req_to_token_rows.fill_(SENTINEL)
    wp.write_num_valid_reqs.fill_(-5)
    impl.plan(
        verify_plan_out=vp, write_plan_out=wp,
        req_pool_indices=_tensor(rpi, dtype, dev),
        prefix_lens=_tensor(prefix, dtype, dev),
        extend_seq_lens=_tensor(ext, dtype, dev),
        req_to_token=torch.tensor(r2t, dtype=r2t_dtype, device=dev),
        swa_window_size=window,
        full_to_swa_index_mapping=None if lut is None else _tensor(lut, torch.int64, dev),
        verify_capacity=verify_capacity,
        req_to_verify_expected_tokens=None if exp_pool is None else torch.tensor(
            exp_pool, dtype=torch.int32, device=dev),
        req_to_verify_expected_tokens_valid_lens=None if valid_lens is None else _tensor(
            valid_lens, dtype, dev),
        kv_token_id_vs_position_offset=offset,
    )
    exp = oracle_plan(rpi=rpi, prefix=prefix, ext=ext, r2t=r2t, window=window, lut=lut,
                      verify_capacity=verify_capacity, write_req_capacity=write_req_capacity,
                      exp_pool=exp_pool, valid_lens=valid_lens, offset=offset)
    _assert_plan_tensors(vp, wp, exp, where=f"[{impl.name} plan] ")
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
        verify_slot_indices=_tensor(cols[0], torch.int64, dev),
        verify_expected_tokens=_tensor(cols[1], torch.int64, dev),
        verify_expected_positions=_tensor(cols[2], torch.int64, dev),
        verify_prev_slot_indices=_tensor(cols[3], torch.int64, dev),
        verify_req_to_token_rows=_tensor(cols[4], torch.int64, dev),
        verify_num_valid=_tensor([num_valid], torch.int32, dev),
        enable=_tensor([enable], torch.int32, dev),
    )
    exp = ExpectedPlan(*cols[:4], num_valid=num_valid, enable=enable, write_offsets=[0], seeds=[],
                       nreq=0, req_rows=cols[4])
    return Plans(vp, None, exp)


def hand_write_plan(impl: Impl, lengths, seeds, rows=None) -> Plans:
    dev = impl.device
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    rows = [-1] * len(seeds) if rows is None else list(rows)
    wp = WritePlan(
        write_offsets=_tensor(offs, torch.int64, dev),
        write_seed_slot_indices=_tensor(seeds, torch.int64, dev),
        write_req_to_token_rows=_tensor(rows, torch.int64, dev),
        write_num_valid_reqs=_tensor([len(seeds)], torch.int32, dev),
        verify_req_offsets=torch.zeros(len(seeds) + 1, dtype=torch.int64, device=dev),
    )
    exp = ExpectedPlan([], [], [], [], 0, 1, write_offsets=offs, seeds=list(seeds),
                       nreq=len(seeds), write_rows=rows)
    return Plans(None, wp, exp)


class Canary:
    """One canary buffer on ``impl`` plus its oracle twin; every launch is checked exactly."""

    def __init__(self, impl: Impl, num_slots: int, *, kind=CanaryLaunchTag.TAIL_K_FULL,
                 sources=(), mode=RealKvHashMode.NONE, ring_capacity=64, chain_assert=1,
                 garbage_slot0=True):
        self.impl = impl
        dev = impl.device
        self.ctx = make_context(num_slots, device=dev, kind=kind, sources=sources, mode=mode,
                                ring_capacity=ring_capacity, chain_assert=chain_assert)
        self.oracle = Oracle(num_slots, kind=kind, ring_capacity=ring_capacity,
                             sources=sources, mode=mode, chain_assert=chain_assert)
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
    def write(self, plans: Plans, input_ids, positions, loc, *, input_assert=False,
              exp_tok=None, exp_pos=None, dtype=torch.int64):
        dev = self.impl.device
        self.impl.write(
            context=self.ctx, plan=plans.wp,
            input_ids=_tensor(input_ids, dtype, dev),
            positions=_tensor(positions, dtype, dev),
            out_cache_loc=_tensor(loc, torch.int64, dev),
            enable_write_input_assert=input_assert,
            expected_input_tokens=None if exp_tok is None else _tensor(exp_tok, dtype, dev),
            expected_input_positions=None if exp_pos is None else _tensor(exp_pos, dtype, dev),
        )
        rows = self.oracle.write(plans.exp, list(input_ids), list(positions), list(loc),
                                 input_assert=input_assert, exp_tok=exp_tok, exp_pos=exp_pos)
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
            f"{where}violation_write_index {int(ctx.violation_write_index[0])} != {orc.count}")
        assert int(ctx.slot_run_counter[0]) == orc.slot_counter, (
            f"{where}slot_run_counter {int(ctx.slot_run_counter[0])} != {orc.slot_counter}")
        assert int(ctx.kernel_run_counter[0]) == orc.kernel_counter, (
            f"{where}kernel_run_counter {int(ctx.kernel_run_counter[0])} != "
            f"{orc.kernel_counter}")
        cap = ctx.ring_capacity
        ring = ctx.violation_ring.cpu().tolist()
        kept = min(orc.count, cap)
        assert all(v == 0 for row in ring[kept:] for v in row), (
            f"{where}ring rows past the kept ones were written")
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
                f"{sorted(expected_full.elements())}")
        else:
            missing = expected_full - actual
            assert not missing, f"{where}ring lost rows of earlier launches: {missing}"
            rest = actual - expected_full
            pool, n_kept = partial
            assert sum(rest.values()) == n_kept, f"{where}crossing launch kept {rest}"
            assert not (rest - pool), (
                f"{where}ring holds rows the oracle never produced: {rest - pool}")


def _perm_slots(n_needed, num_slots, seed):
    """Distinct non-zero slots in a scrambled order."""
    rng = random.Random(seed)
    slots = list(range(1, num_slots))
    rng.shuffle(slots)
    return slots[:n_needed]


def _r2t(rows, cols, fill=0):
    return [[fill] * cols for _ in range(rows)]


# =============================================================================================
# Contract values (no kernels)
# =============================================================================================


def _sm64_spec(x):
    m = MASK64
    x &= m
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    x ^= x >> 31
    return x


def test_hash_primitives_match_spec():
    for x in (0, 1, 2, 0xDEADBEEF, MASK64, 1 << 63, CANARY_CHAIN_ANCHOR, -1, -12345):
        assert splitmix64(x) == _sm64_spec(x)
    for a, b, c in ((0, 0, 0), (1, 2, 3), (MASK64, -1, 7), (HEAD, 12345, -9)):
        assert splitmix64_mix3(a, b, c) == _sm64_spec(
            _sm64_spec(_sm64_spec(a) ^ (b & MASK64)) ^ (c & MASK64))
    assert CANARY_CHAIN_ANCHOR == 0xC0FFEE1234567890
    assert canary_chain_head_hash() == _sm64_spec(0xC0FFEE1234567890)
    assert to_int64(MASK64) == -1 and to_int64(5) == 5 and to_int64(1 << 63) == -(1 << 63)


SPEC_TAGS = {
    "HEAD_K_FULL": 0, "HEAD_V_FULL": 1, "TAIL_K_FULL": 2, "TAIL_V_FULL": 3,
    "SWEEP_K_FULL": 4, "SWEEP_V_FULL": 5, "HEAD_K_SWA": 6, "HEAD_V_SWA": 7,
    "TAIL_K_SWA": 8, "TAIL_V_SWA": 9, "SWEEP_K_SWA": 10, "SWEEP_V_SWA": 11,
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
        "VERIFY_CHAIN_HASH_MISMATCH": 1, "VERIFY_POSITION_MISMATCH": 2,
        "VERIFY_REAL_KV_HASH_MISMATCH": 4, "WRITE_TOKEN_MISMATCH": 8,
        "WRITE_POSITION_MISMATCH": 16, "VERIFY_TOKEN_MISMATCH": 32,
    }
    assert FailReason.describe(5) == "verify_chain_hash+verify_real_kv_hash"
    assert FailReason.describe(4) == "verify_real_kv_hash"
    assert FailReason.describe(8 | 16) == "write_token+write_position"
    assert FailReason.describe(2 | 32) == "verify_position+verify_token"
    assert FailReason.describe(63) == ("verify_chain_hash+verify_position+verify_real_kv_hash+"
                                       "write_token+write_position+verify_token")
    assert RealKvHashMode.NONE == 0 and RealKvHashMode.PARTIAL == 1 and RealKvHashMode.ALL == 2


# =============================================================================================
# Plan + write + verify flows
# =============================================================================================


def test_single_request_extend_then_decode(impl):
    num_slots, rows, cols = 64, 6, 16
    slots = [5, 9, 2, 17, 30, 11, 40, 3]
    toks = [101, 7, 55, 1000, 3, 42, 8, 77]
    r2t = _r2t(rows, cols)
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
    assert c.record(9)[2] == to_int64(splitmix64_mix3(HEAD, 101, 0))

    # Decode on top: seed = slot of position prefix-1, whole prefix verified.
    p = run_plan(impl, rpi=[3], prefix=[6], ext=[1], r2t=r2t, write_req_capacity=4)
    assert p.exp.seeds == [11, -1, -1, -1]
    assert p.exp.entries == [(5, -1, 0, -1), (9, -1, 1, 5), (2, -1, 2, 9), (17, -1, 3, 2),
                             (30, -1, 4, 17), (11, -1, 5, 30)]
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


def test_mixed_batch_with_padding_rows(impl):
    num_slots, rows, cols = 64, 8, 8
    rng = random.Random(1)
    perm = _perm_slots(63, num_slots, seed=2)
    r2t = _r2t(rows, cols)
    for rp in range(1, rows):
        r2t[rp] = perm[(rp - 1) * cols:rp * cols]
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
    p = run_plan(impl, rpi=rpi, prefix=prefix, ext=ext, r2t=r2t, write_req_capacity=8,
                 dtype=torch.int32)
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
    r2t = _r2t(rows, cols)
    r2t[1] = [3, 4, 5, 6, 7, 8]
    r2t[2] = [9, 10, 70, 11, 12, 13]  # 70 is outside the 64-entry SWA table
    r2t[3] = [14, 15, 16, 17, 18, 19]
    lut = list(range(64))
    lut[16] = 0
    # rp 4 (== rows) and -1 are padding; prefix 9 > cols clamps to cols; prefix -2 → 0;
    # negative extend writes nothing.
    p = run_plan(impl, rpi=[4, 1, -1, 2, 3], prefix=[2, 9, 2, 4, -2], ext=[1, -3, 1, 2, 2],
                 r2t=r2t, window=100, lut=lut, write_req_capacity=6)
    assert p.exp.write_offsets == [0, 0, 0, 0, 2, 4, 0]
    assert p.exp.seeds == [-1, 8, -1, 11, -1, -1]
    assert p.exp.entries[:6] == [(3, -1, 0, -1), (4, -1, 1, 3), (5, -1, 2, 4), (6, -1, 3, 5),
                                 (7, -1, 4, 6), (8, -1, 5, 7)]
    assert p.exp.entries[6:] == [(9, -1, 0, -1), (10, -1, 1, 9), (0, -1, 2, 10), (11, -1, 3, 0)]
    # Without a table, rp == rows is still padding and the rest is the identity.
    p = run_plan(impl, rpi=[3, 4], prefix=[3, 3], ext=[1, 1], r2t=r2t, write_req_capacity=2)
    assert p.exp.entries == [(14, -1, 0, -1), (15, -1, 1, 14), (16, -1, 2, 15)]
    assert p.exp.seeds == [16, -1]


def test_swa_window_with_evicted_slots(impl):
    full_slots, swa_slots, rows, cols = 64, 32, 5, 10
    r2t = _r2t(rows, cols)
    r2t[1][:8] = [3, 8, 12, 5, 20, 9, 33, 40]
    r2t[3][:3] = [14, 15, 16]
    r2t[4][:2] = [50, 51]
    lut_live = [0] * full_slots  # the table while every position was resident
    for f, s in {3: 1, 8: 2, 12: 6, 5: 19, 20: 7, 9: 21, 33: 4, 40: 11, 14: 25, 15: 26,
                 16: 27, 50: 28, 51: 29}.items():
        lut_live[f] = s
    window = 3
    c = Canary(impl, swa_slots, kind=CanaryLaunchTag.HEAD_K_SWA)
    toks1 = [11, 12, 13, 14, 15, 16, 17, 18]

    # Prefill (prefix 0): seeds -1, no verify entries; the caller translates out_cache_loc.
    p = run_plan(impl, rpi=[1, 3], prefix=[0, 0], ext=[7, 2], r2t=r2t, window=window,
                 lut=lut_live, write_req_capacity=4)
    assert p.exp.seeds == [-1] * 4 and p.exp.num_valid == 0
    loc = [lut_live[f] for f in r2t[1][:7]] + [lut_live[f] for f in r2t[3][:2]]
    c.write(p, toks1[:7] + [31, 32], list(range(7)) + [0, 1], loc)

    # Positions 3 and 5 of request 1 leave the SWA pool: their table entries become 0.
    lut = list(lut_live)
    lut[5] = 0
    lut[9] = 0
    p = run_plan(impl, rpi=[1, 3, 4], prefix=[7, 2, 0], ext=[1, 1, 2], r2t=r2t, window=window,
                 lut=lut, write_req_capacity=4)
    # Request 1: only [4, 7), translated; p=4's predecessor and p=5 itself are evicted → 0.
    assert p.exp.entries == [
        (7, -1, 4, 0), (0, -1, 5, 7), (4, -1, 6, 0),
        (25, -1, 0, -1), (26, -1, 1, 25),
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
    assert c.ring_rows() == [(int(CanaryLaunchTag.HEAD_K_SWA), 7, 99, 15, -1, 0x0BADC0DE,
                              0x0BADC0DE, BIT_POS, 4, 1, NO_KV_LAYER)]
    assert rows == c.ring_rows()
    c.set_field(7, 1, 4)

    # Decode on top of the window: seed T(slot of position 6) = 4.
    c.set_field(4, 2, to_int64(splitmix64_mix3(
        splitmix64_mix3(splitmix64_mix3(splitmix64_mix3(splitmix64_mix3(splitmix64_mix3(
            HEAD, 11, 0), 12, 1), 13, 2), 14, 3), 15, 4), 16, 5)))
    rows = c.write(p, [18, 33, 41, 42], [7, 2, 0, 1],
                   [lut[40], lut[r2t[3][2]], lut[50], lut[51]])
    assert rows == []
    assert c.record(11)[2] == to_int64(rec_hash(c.oracle.recs[4]))
    p = run_plan(impl, rpi=[1, 3, 4], prefix=[8, 3, 2], ext=[1, 1, 1], r2t=r2t, window=window,
                 lut=lut, write_req_capacity=4)
    assert [e[2] for e in p.exp.entries] == [5, 6, 7, 0, 1, 2, 0, 1]
    assert c.verify(p) == []


def test_verify_overflow_disables_plan(impl):
    num_slots, rows, cols = 32, 4, 8
    r2t = _r2t(rows, cols)
    r2t[1][:4] = [1, 2, 3, 4]
    r2t[2][:5] = [5, 6, 7, 8, 9]
    c = Canary(impl, num_slots)
    for s in range(1, num_slots):  # garbage everywhere: any verified entry would report
        c.set_record(s, [s, 1000 + s, 3 * s, 0])
    # 3 + 4 = 7 > 5: disabled, entries untouched (sentinels), num_valid == capacity.
    p = run_plan(impl, rpi=[1, 2], prefix=[3, 4], ext=[1, 1], r2t=r2t, verify_capacity=5,
                 write_req_capacity=2)
    assert p.exp.enable == 0 and p.exp.num_valid == 5
    assert p.exp.slots == [SENTINEL] * 5
    assert p.exp.write_offsets == [0, 1, 2] and p.exp.seeds == [3, 8]
    assert c.verify(p) == []
    assert int(c.ctx.kernel_run_counter[0]) == 1 and int(c.ctx.slot_run_counter[0]) == 0
    assert c.verify(p) == []
    assert int(c.ctx.kernel_run_counter[0]) == 2 and int(c.ctx.slot_run_counter[0]) == 0
    # Exactly at capacity: enabled (and every garbage record reports).
    p = run_plan(impl, rpi=[1, 2], prefix=[2, 3], ext=[1, 1], r2t=r2t, verify_capacity=5,
                 write_req_capacity=2)
    assert p.exp.enable == 1 and p.exp.num_valid == 5
    assert len(c.verify(p)) == 5
    assert int(c.ctx.slot_run_counter[0]) == 5
    # The SWA window counts too: windows of 2 fit in the capacity again.
    p = run_plan(impl, rpi=[1, 2], prefix=[3, 4], ext=[1, 1], r2t=r2t, window=2,
                 lut=list(range(num_slots)), verify_capacity=5, write_req_capacity=2)
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
    r2t = _r2t(rows, cols)
    r2t[1][:5] = [2, 4, 6, 8, 10]
    r2t[2][:4] = [3, 5, 7, 9]
    r2t[3][:3] = [11, 12, 13]
    history = {1: [500, 501, 502, 503, 504, 505], 2: [600, 601, 602, 603, 604],
               3: [700, 701, 702, 703]}
    exp_pool = [[-9] * 6 for _ in range(rows)]  # 6 columns: narrower than req_to_token
    for rp, h in history.items():
        exp_pool[rp][:len(h[:6])] = h[:6]
    exp_pool[0] = [1] * 6
    # valid lens: short (2) for request 1, 4 for request 2, beyond the pool width for 3.
    valid_lens = [2, 4, 9]
    p = run_plan(impl, rpi=[1, 2, 3], prefix=[5, 4, 3], ext=[1, 1, 1], r2t=r2t,
                 exp_pool=exp_pool, valid_lens=valid_lens, offset=offset)

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
            running = splitmix64_mix3(running, t, pp)
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
        4: (-1, BIT_CHAIN), 5: (-1, BIT_POS), 7: (-1, BIT_CHAIN)}


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


@pytest.mark.parametrize("mode", [RealKvHashMode.NONE, RealKvHashMode.PARTIAL,
                                  RealKvHashMode.ALL], ids=lambda m: m.name)
def test_real_kv_two_sources_page_size_2(impl, mode):
    src_a, src_b = _make_two_sources(impl.device)
    num_slots, rows, cols = 16, 3, 8
    r2t = _r2t(rows, cols)
    r2t[1][:7] = [3, 5, 6, 9, 12, 15, 8]
    c = Canary(impl, num_slots, kind=CanaryLaunchTag.TAIL_K_FULL, sources=(src_a, src_b),
               mode=mode)
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
    for name, src, byte in (("A3", src_a, 3), ("A20", src_a, 20), ("B2", src_b, 2),
                            ("B10", src_b, 10)):
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
        assert row == (int(CanaryLaunchTag.TAIL_K_FULL), 5, 1, 8, -1, c.oracle.recs[5][2],
                       c.oracle.recs[5][2], BIT_REAL_KV, 1, 1, NO_KV_LAYER)
    # The decode write on top fingerprints its slot too; a stale record is reported.
    c.write(p, [toks[6]], [6], [8])
    p = run_plan(impl, rpi=[1], prefix=[7], ext=[1], r2t=r2t)
    assert c.verify(p) == []
    _flip_byte(src_b, 8, 0)
    rows = c.verify(p)
    assert [r[1] for r in rows] == ([] if mode == RealKvHashMode.NONE else [8])


@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL],
                         ids=lambda m: m.name)
def test_real_kv_24_byte_rows_fold(impl, mode):
    """num_bytes_per_token = read_bytes = 24: PARTIAL folds 16 bytes, ALL folds all 24."""
    g = torch.Generator().manual_seed(5)
    t = torch.randint(0, 256, (4, 2 * 24), dtype=torch.uint8, generator=g).to(impl.device)
    src = RealKvSource(tensor=t, page_size=2, num_bytes_per_token=24, read_bytes=24)
    c = Canary(impl, 8, sources=(src,), mode=mode)
    p = hand_write_plan(impl, [2], [-1])
    c.write(p, [10, 11], [0, 1], [5, 6])
    raw = t.cpu()[2].tolist()  # slot 5 = page 2, token 1 → bytes 24..47 of the row
    words = [int.from_bytes(bytes(raw[24 + 8 * k:32 + 8 * k]), "little") for k in range(3)]
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
    r2t = _r2t(rows, cols)
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
        assert c.ring_rows() == sorted([
            (int(CanaryLaunchTag.HEAD_V_FULL), 7, 5, 31, 31, running7, 3, BIT_WRITE_POS, 5, 1,
             NO_KV_LAYER),
            (int(CanaryLaunchTag.HEAD_V_FULL), 15, 8, 52, 52, running15, 7, BIT_WRITE_POS, 8,
             3, NO_KV_LAYER),
        ])
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
    h = splitmix64_mix3(splitmix64_mix3(rec_hash([5, 3, 0x77, 0]), 10, 4), 11, 5)
    assert c.record(3) == [12, 6, to_int64(h), 0]
    assert c.record(5)[2] == to_int64(splitmix64_mix3(HEAD, 20, 0))


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
    rows = c.write(p, ids, [0, 1, 2, 0, 1, 2], [1, 2, 3, 4, 5, 6], input_assert=True,
                   exp_tok=[9, 9, 9, 9, 9, 9], exp_pos=[0, 1, 2, 0, 1, 2])
    assert len(rows) == 6 and int(c.ctx.violation_write_index[0]) == 6
    assert len(c.ring_rows()) == ring_capacity
    c.write(p, ids, [0, 1, 2, 0, 1, 2], [1, 2, 3, 4, 5, 6], input_assert=True,
            exp_tok=[1, 2, 3, 4, 5, 9], exp_pos=[0, 1, 2, 0, 1, 2])
    assert int(c.ctx.violation_write_index[0]) == 7


# =============================================================================================
# Corruption, slot 0, empty inputs, grid-stride sizes
# =============================================================================================


@pytest.mark.parametrize("field", [0, 1, 2, 3], ids=["token", "position", "prev_hash",
                                                     "real_kv_hash"])
def test_corrupted_record_field_detected(impl, field):
    g = torch.Generator().manual_seed(9)
    t = torch.randint(0, 256, (16, 32), dtype=torch.uint8, generator=g).to(impl.device)
    src = RealKvSource(tensor=t, page_size=1, num_bytes_per_token=32, read_bytes=32)
    num_slots, rows, cols = 16, 3, 8
    r2t = _r2t(rows, cols)
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
    r2t = _r2t(rows, cols)
    r2t[1][:5] = [4, 5, 0, 6, 7]  # a hole (slot 0) in the middle of the prefix
    c = Canary(impl, num_slots)
    running = HEAD
    for pp, s in enumerate(r2t[1][:5]):
        if s:
            c.set_record(s, [50 + pp, pp, to_int64(running), 0])
        running = splitmix64_mix3(running, 50 + pp, pp)
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
    r2t = _r2t(2, 4)
    # bs 0 plan: offsets all 0, seeds all -1, nothing to verify.
    p = run_plan(impl, rpi=[], prefix=[], ext=[], r2t=r2t, write_req_capacity=3,
                 verify_capacity=4)
    assert p.exp.write_offsets == [0, 0, 0, 0] and p.exp.seeds == [-1, -1, -1]
    assert p.exp.enable == 1 and p.exp.num_valid == 0 and p.exp.nreq == 0
    c.write(p, [], [], [])
    c.verify(p)
    assert int(c.ctx.kernel_run_counter[0]) == 2 and int(c.ctx.slot_run_counter[0]) == 0
    # Zero-capacity plans, bs 0.
    p = run_plan(impl, rpi=[], prefix=[], ext=[], r2t=r2t, write_req_capacity=0,
                 verify_capacity=0)
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
    r2t = _r2t(nreq + 1, 4)
    slots = _perm_slots(3 * nreq, num_slots, seed=4)
    for r in range(nreq):
        r2t[r + 1][:3] = slots[3 * r:3 * r + 3]
    c = Canary(impl, num_slots, sources=(src,), mode=RealKvHashMode.ALL, ring_capacity=8)
    rpi = list(range(1, nreq + 1))
    p = run_plan(impl, rpi=rpi, prefix=[0] * nreq, ext=[2] * nreq, r2t=r2t,
                 write_req_capacity=nreq, verify_capacity=256)
    ids = [1000 + k for k in range(2 * nreq)]
    c.write(p, ids, [0, 1] * nreq, [r2t[r][k] for r in rpi for k in range(2)])
    p = run_plan(impl, rpi=rpi, prefix=[2] * nreq, ext=[1] * nreq, r2t=r2t,
                 write_req_capacity=nreq, verify_capacity=256)
    assert c.verify(p) == []
    c.write(p, list(range(nreq)), [2] * nreq, [r2t[r][2] for r in rpi])
    p = run_plan(impl, rpi=rpi, prefix=[3] * nreq, ext=[1] * nreq, r2t=r2t,
                 write_req_capacity=nreq, verify_capacity=256)
    assert c.verify(p) == []
    assert int(c.ctx.slot_run_counter[0]) == 140 + 140 + 70 + 210


def test_shared_prefix_reported_per_request(impl):
    num_slots, plen = 256, 200
    r2t = _r2t(4, plen + 2)
    prefix_slots = _perm_slots(plen + 3, num_slots, seed=6)
    for rp in (1, 2, 3):
        r2t[rp][:plen] = prefix_slots[:plen]
        r2t[rp][plen] = prefix_slots[plen + rp - 1]
    c = Canary(impl, num_slots, kind=CanaryLaunchTag.SWEEP_K_FULL, ring_capacity=16)
    p = run_plan(impl, rpi=[1], prefix=[0], ext=[plen], r2t=r2t, write_req_capacity=3,
                 verify_capacity=640)
    c.write(p, [(7 * k) % 997 for k in range(plen)], range(plen), prefix_slots[:plen])
    p = run_plan(impl, rpi=[1, 2, 3], prefix=[plen] * 3, ext=[1] * 3, r2t=r2t,
                 write_req_capacity=3, verify_capacity=640)
    assert p.exp.num_valid == 3 * plen
    assert c.verify(p) == []
    c.write(p, [1, 2, 3], [plen] * 3, prefix_slots[plen:plen + 3])
    assert len({c.record(s)[2] for s in prefix_slots[plen:plen + 3]}) == 1
    victim = prefix_slots[150]
    c.set_field(victim, 1, 12345)
    rows = c.verify(p)
    # every request reads the shared slot: three identical rows each for it and its successor
    assert collections.Counter((r[1], r[7]) for r in rows) == {
        (victim, BIT_POS): 3, (prefix_slots[151], BIT_CHAIN): 3}


def test_large_batch_crosses_plan_blocks(impl):
    """bs = 1300 (> the 1024-row block of the offsets stage) in one plan launch: running sums
    carry across blocks; every 10th row is live, the others are padding with non-zero lengths."""
    bs, num_slots = 1300, 256
    r2t = _r2t(bs + 1, 4)
    live = [r for r in range(bs) if r % 10 == 3 or r in (1022, 1023, 1024, 1025)]
    own = {r: 3 + k for k, r in enumerate(live)}  # a distinct decode slot per live request
    assert max(own.values()) < num_slots
    for r in live:
        r2t[r + 1][:3] = [1, 2, own[r]]  # all share the two-slot prefix (radix sharing)
    rpi = [r + 1 if r in own else 0 for r in range(bs)]
    c = Canary(impl, num_slots, ring_capacity=8)
    c.set_record(1, [500, 0, to_int64(HEAD), 0])
    c.set_record(2, [501, 1, to_int64(rec_hash(c.oracle.recs[1])), 0])
    p = run_plan(impl, rpi=rpi, prefix=[2] * bs, ext=[1] * bs, r2t=r2t,
                 write_req_capacity=bs + 5, verify_capacity=3 * len(live))
    assert p.exp.num_valid == 2 * len(live)
    assert p.exp.write_offsets[bs] == len(live)
    assert c.verify(p) == []
    assert c.write(p, [600 + r for r in live], [2] * len(live), [own[r] for r in live]) == []
    p = run_plan(impl, rpi=rpi, prefix=[3] * bs, ext=[1] * bs, r2t=r2t,
                 write_req_capacity=bs + 5, verify_capacity=3 * len(live))
    assert c.verify(p) == []
    c.set_field(2, 1, 7)  # the shared position-1 record: every live request reports it
    rows = c.verify(p)
    assert sorted(collections.Counter((r[1], r[7]) for r in rows).items()) == sorted({
        (2, BIT_POS): len(live), **{(own[r], BIT_CHAIN): 1 for r in live}}.items())


def test_verify_out_of_range_entries(impl):
    """Hand plan entries pointing outside the buffer are skipped / not chain-checked."""
    c = Canary(impl, 16)
    c.set_record(4, [40, 0, to_int64(HEAD), 0])
    c.set_record(5, [50, 3, 0x1234, 0])
    rows = c.verify(hand_verify_plan(impl, [
        (16, -1, 0, -1),  # slot == num_slots: skipped
        (-3, -1, 0, -1),  # negative slot: skipped
        (5, -1, 3, 16),  # prev out of range: chain not checked
        (5, -1, 3, -2),  # prev < -1: chain not checked
        (5, -1, 3, 4),  # checked: 0x1234 != H(record 4)
    ]))
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
    extra = {} if starts is None else dict(dst_starts=_tensor(starts, torch.int64, dev))
    impl.scatter(flat_in=_tensor(flat, torch.int64, dev),
                 offsets=_tensor(offsets, torch.int64, dev),
                 req_pool_indices=_tensor(rpi, torch.int64, dev), pool_out=out, **extra)
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
    got = _run_scatter(impl, pool, flat, [2, 1, 3, 1, 1, 0], [4, 1, 2, 0, 3, 9],
                       starts=[3, 0, 5, -1, 4, 0])
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
    assert got[rpi[r]] == flat[sum(lengths[:r]):sum(lengths[:r]) + 2]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
