"""A chain a parallel scan computes, against this tree's chain write, paired and interleaved on
one GPU: the measurement that decides docs/chain_scan_design.md (on a tree with the serial
walk; on one with the design built, the same run compares the prototype with the kernel).

    python benchmark/kv_canary/bench_chain_scan.py [--tokens 512,4096,16384]
        [--decode-bs 32,256] [--rounds 30] [--out F.jsonl]

This tree's chain write (A, and A' its A/A control) is its ``launch_canary_chain_writes`` on
``bench_chain_walk.Case``'s inputs: two buffers (HEAD K and TAIL K of one group), a prefill of
N new tokens at batch size 1 and a decode step (one token per request, each seeded by its
prefix's last slot). The scan (B) is a prototype, not the canary: ``_chain_scan_kernel`` writes
the same records (token, position, prev_hash, real_kv_hash 0) of the same slots in both buffers,
with the chain of the design document, ``H(r) = r.prev_hash * CANARY_CHAIN_MUL + e(r.token,
r.position) mod 2**64``, ``e(t, p) = splitmix64(splitmix64(t) ^ p)``; a request's prev_hash
values are an affine recurrence, so one program per request computes them a block of ``BLOCK``
steps at a time with ``tl.associative_scan`` and carries the last state into the next block. It
checks each step's position against its predecessor's plus one (from the seed record's on; the
kernel does so only from a real seed) and appends a failed step's ring row (a clean run appends
none). Before timing, the scan's records must equal :func:`reference_records` (a
serial Python loop over the same definition) byte for byte, and this tree's write must report
nothing. Each round times A, A' and B in an order shuffled per round, each the median of 5
launches between CUDA events; printed per shape: the medians and B/A, A'/A with a 95 %
bootstrap interval. ``--smoke-cpu`` runs the equality checks on the CPU (Triton's interpreter)
with tiny shapes (a 37-step prefill in blocks of 16: the carry between blocks) and times
nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

if "--smoke-cpu" in sys.argv:  # the kernels read it once, at import: before them
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chain_walk import Case, Shape, bootstrap_ci, time_us  # noqa: E402
from common import append_jsonl, cuda_event_ms, now_utc, parse_ints  # noqa: E402

from sglang.jit_kernel.kv_canary import _hash_triton as H  # noqa: E402
from sglang.jit_kernel.kv_canary._kernel_consts import (  # noqa: E402
    FAIL_WRITE_POSITION,
    NO_KV_LAYER,
)
from sglang.jit_kernel.kv_canary._ring_triton import append_violations  # noqa: E402
from sglang.jit_kernel.kv_canary import write as this_write  # noqa: E402
from sglang.jit_kernel.kv_canary.consts import (  # noqa: E402
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    CANARY_CHAIN_MUL,
    CANARY_CHAIN_MUL_INV,
    CANARY_NUM_FIELDS,
    VIOLATION_FIELD_POSITION,
    canary_chain_head_hash,
    canary_chain_step,
    to_int64,
)

# The scan chain is the canary's own since it landed (docs/chain_scan_design.md): the host
# reference below steps it with ``consts.canary_chain_step``, the prototype with its multiplier.
_MUL = tl.constexpr(CANARY_CHAIN_MUL)
_MUL_INV = tl.constexpr(CANARY_CHAIN_MUL_INV)
_WORDS = tl.constexpr(CANARY_NUM_FIELDS)
_F_TOKEN = tl.constexpr(CANARY_FIELD_TOKEN)
_F_POSITION = tl.constexpr(CANARY_FIELD_POSITION)
_F_PREV = tl.constexpr(CANARY_FIELD_PREV_HASH)
_F_REAL_KV = tl.constexpr(CANARY_FIELD_REAL_KV_HASH)


def record_hash(record) -> int:
    """``H(record)``, a u64 int from an int64 ``[4]`` record."""
    return canary_chain_step(
        int(record[CANARY_FIELD_PREV_HASH]),
        int(record[CANARY_FIELD_TOKEN]),
        int(record[CANARY_FIELD_POSITION]),
    )


def reference_records(case: Case) -> torch.Tensor:
    """Every record the scan writes into one buffer, serially in Python: int64 ``[slots, 4]``
    (the seed records as ``Case`` left them, each new slot's record in place)."""
    records = case.seed_records.clone()
    ids, pos = case.input_ids.cpu().tolist(), case.positions.cpu().tolist()
    locs = case.out_cache_loc.cpu().tolist()
    offsets = case.plan.write_offsets.cpu().tolist()
    seeds = case.plan.write_seed_slot_indices.cpu().tolist()
    for r in range(case.shape.bs):
        seed = seeds[r]
        running = record_hash(records[seed]) if seed >= 0 else canary_chain_head_hash()
        for i in range(offsets[r], offsets[r + 1]):
            records[locs[i]] = torch.tensor([ids[i], pos[i], to_int64(running), 0])
            running = canary_chain_step(running, ids[i], pos[i])
    return records


@triton.jit
def _affine(a1, b1, a2, b2):
    """Two steps ``x -> x * a + b`` composed, the first one first."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _key(tok, pos):
    return H.chain_key(H.as_u64(tok), H.as_u64(pos))


@triton.jit
def _seed_state(canary_ptr, seed):
    """The chain state a request's first new step continues from: ``H(seed record)``, or the
    chain head without a seed (u64 scalar)."""
    has_seed = seed >= 0
    rec = canary_ptr + tl.maximum(seed, 0) * _WORDS
    prev = tl.load(rec + _F_PREV).to(tl.uint64, bitcast=True)
    key = _key(tl.load(rec + _F_TOKEN), tl.load(rec + _F_POSITION))
    return tl.where(has_seed, prev * _MUL + key, H.chain_head_hash())


@triton.jit
def _store_records(canary_ptr, slot, tok, pos, prev, store):
    rec = canary_ptr + slot * _WORDS
    tl.store(rec + _F_TOKEN, tok, mask=store)
    tl.store(rec + _F_POSITION, pos, mask=store)
    tl.store(rec + _F_PREV, H.as_i64(prev), mask=store)
    tl.store(rec + _F_REAL_KV, tl.zeros_like(tok), mask=store)


@triton.jit
def _chain_scan_kernel(
    head_ptr,
    tail_ptr,
    input_ids_ptr,
    positions_ptr,
    loc_ptr,
    offsets_ptr,
    seeds_ptr,
    num_slots,
    ring_ptr,
    ring_index_ptr,
    ring_capacity,
    kernel_kind,
    BLOCK: tl.constexpr,
):
    """One program per request: its new steps, ``BLOCK`` at a time, into both buffers."""
    r = tl.program_id(0)
    start = tl.load(offsets_ptr + r)
    end = tl.load(offsets_ptr + r + 1)
    seed = tl.load(seeds_ptr + r)
    state_h = _seed_state(head_ptr, seed)
    state_t = _seed_state(tail_ptr, seed)
    seed_pos = tl.load(head_ptr + tl.maximum(seed, 0) * _WORDS + _F_POSITION)
    idx = tl.arange(0, BLOCK)
    for b in range(start, end, BLOCK):
        i = b + idx
        act = i < end
        tok = tl.load(input_ids_ptr + i, mask=act, other=0).to(tl.int64)
        pos = tl.load(positions_ptr + i, mask=act, other=0).to(tl.int64)
        slot = tl.load(loc_ptr + i, mask=act, other=-1).to(tl.int64)
        before = tl.load(positions_ptr + i - 1, mask=act & (i > start), other=0).to(tl.int64)
        check = act & ((i > start) | (seed >= 0))
        before = tl.where(i > start, before, seed_pos)
        bad = check & (pos != before + 1)
        key = _key(tok, pos)
        mul = tl.where(act, tl.full([BLOCK], _MUL, tl.uint64), tl.full([BLOCK], 1, tl.uint64))
        add = tl.where(act, key, tl.zeros([BLOCK], tl.uint64))
        a, s = tl.associative_scan((mul, add), 0, _affine)
        after_h = state_h * a + s  # the state after each step (past the end: the last one)
        after_t = state_t * a + s
        prev_h = (after_h - add) * _MUL_INV  # the state before it: the step's prev_hash
        prev_t = (after_t - add) * _MUL_INV
        store = act & (slot >= 0) & (slot < num_slots)
        _store_records(head_ptr, slot, tok, pos, prev_h, store)
        _store_records(tail_ptr, slot, tok, pos, prev_t, store)
        append_violations(
            ring_ptr,
            ring_index_ptr,
            ring_capacity,
            bad & store,
            kernel_kind,
            slot,
            pos,
            tok,
            tok,
            H.as_i64(prev_h),
            before + 1,
            tl.where(bad, FAIL_WRITE_POSITION, 0).to(tl.int64),
            pos,
            r.to(tl.int64),
            NO_KV_LAYER,
        )
        last = idx == BLOCK - 1
        state_h = tl.sum(tl.where(last, after_h, 0), axis=0)
        state_t = tl.sum(tl.where(last, after_t, 0), axis=0)


def block_for(shape: Shape, max_block: int = 1024) -> int:
    """The scan's block: the request's new steps rounded up to a power of two, 16 to
    ``max_block``."""
    return max(16, min(max_block, triton.next_power_of_2(shape.new_per_req)))


def launch_scan(case: Case, contexts, block: int) -> None:
    head, tail = contexts
    _chain_scan_kernel[(case.shape.bs,)](
        head.canary_words,
        tail.canary_words,
        case.input_ids,
        case.positions,
        case.out_cache_loc,
        case.plan.write_offsets,
        case.plan.write_seed_slot_indices,
        case.num_slots,
        head.violation_ring,
        head.violation_write_index,
        head.ring_capacity,
        int(head.kernel_kind),
        BLOCK=block,
        num_warps=4,
    )


def check_scan(case: Case, block: int) -> None:
    """The scan's records equal the serial reference's in both buffers, nothing counted as
    failed; this tree's chain write reports nothing on the same inputs."""
    expected = reference_records(case)
    contexts = case.contexts()
    launch_scan(case, contexts, block)
    for c in contexts:
        if not torch.equal(c.canary_words.cpu(), expected):
            raise SystemExit(f"{case.shape.name}: the scan's records differ from the reference")
    if int(contexts[0].violation_write_index[0]) != 0:
        raise SystemExit(f"{case.shape.name}: the scan counted a failed step on a clean chain")
    walk = case.contexts()
    case.launch(this_write, walk)
    if int(walk[0].violation_write_index[0]) != 0:
        raise SystemExit(f"{case.shape.name}: this tree's chain write reported violations")


def check_scan_catches_a_position_gap(case: Case, block: int) -> None:
    """A step whose position is not its predecessor's plus one is counted once."""
    positions = case.positions.clone()
    case.positions[-1] += 1
    contexts = case.contexts()
    launch_scan(case, contexts, block)
    case.positions.copy_(positions)
    ring = contexts[0].violation_ring[0].tolist()  # the one row: its position field
    if (
        int(contexts[0].violation_write_index[0]) != 1
        or ring[VIOLATION_FIELD_POSITION] != int(case.positions[-1]) + 1
    ):
        raise SystemExit(f"{case.shape.name}: the scan missed a position gap")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,4096,16384")
    ap.add_argument("--decode-bs", default="32,256")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=None, help="JSON lines file (appended)")
    ap.add_argument("--smoke-cpu", action="store_true")
    a = ap.parse_args()
    tokens, decode_bs = parse_ints(a.tokens, "--tokens"), parse_ints(a.decode_bs, "--decode-bs")
    if a.rounds < 2:
        raise SystemExit(f"--rounds: at least 2 for an interval, got {a.rounds}")
    if a.smoke_cpu:
        device = torch.device("cpu")
        shapes = [Shape("prefill 1 x 37", 1, 37, 0), Shape("decode 3 x 1", 3, 1, 5)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_chain_scan.py times CUDA launches: no GPU (try --smoke-cpu)")
        device = torch.device("cuda")
        shapes = [Shape(f"prefill 1 x {n}", 1, n, 0) for n in tokens]
        shapes += [Shape(f"decode {bs} x 1", bs, 1, 511) for bs in decode_bs]
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"chain: this tree's write (A, A') vs the scan prototype (B); {gpu}; {now_utc()}")
    for shape in shapes:
        case = Case(shape, device)
        block = block_for(shape, max_block=16 if a.smoke_cpu else 1024)
        check_scan(case, block)
        check_scan_catches_a_position_gap(case, block)
        if device.type != "cuda":
            print(f"{shape.name}: the scan's records equal the reference's (CPU: not timed)")
            continue
        ctx = {"A": case.contexts(), "A'": case.contexts(), "B": case.contexts()}

        def timed(k) -> float:
            if k == "B":
                times = cuda_event_ms(lambda: launch_scan(case, ctx[k], block), 5)
                return statistics.median([ms * 1000.0 for ms in times])
            return time_us(case, this_write, ctx[k])

        for k in ctx:  # compile and warm up
            for _ in range(3):
                timed(k)
        torch.cuda.synchronize()
        t = {k: [] for k in ctx}
        order = list(ctx)
        rng = random.Random(1)
        for _ in range(a.rounds):
            rng.shuffle(order)
            for k in order:
                t[k].append(timed(k))
        row = {"shape": shape.name, "gpu": gpu, "date": now_utc(), "block": block}
        for k in ctx:
            row[f"{k}_us"] = statistics.median(t[k])
        for k in ("B", "A'"):
            ratios = [x / y for x, y in zip(t[k], t["A"])]
            lo, hi = bootstrap_ci(ratios)
            row[f"{k}/A"] = [statistics.median(ratios), lo, hi]
        ctl, b, us_ctl = row["A'/A"], row["B/A"], row["A'_us"]
        print(
            f"{shape.name:>18}: A {row['A_us']:8.1f} us  A' {us_ctl:8.1f} us  "
            f"B {row['B_us']:8.1f} us  B/A {b[0]:.3f} [{b[1]:.3f}, {b[2]:.3f}]  "
            f"A'/A {ctl[0]:.3f} [{ctl[1]:.3f}, {ctl[2]:.3f}]"
        )
        append_jsonl(a.out, row)


if __name__ == "__main__":
    main()
