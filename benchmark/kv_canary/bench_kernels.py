#!/usr/bin/env python3
"""KV-canary kernel benchmark: per-kernel time and bandwidth as a fraction of device copy bandwidth.

How to run
----------
On a GPU machine (from the repository root, after ``. .device/a/setup.sh``)::

    python benchmark/kv_canary/bench_kernels.py [--out benchmark/results/kernels_h100.md]

Smoke check without a GPU (tiny shapes, CPU tensors, the torch references, one call per
kernel, no timing claims)::

    python benchmark/kv_canary/bench_kernels.py --smoke

What it measures
----------------
The four public launchers of ``sglang.jit_kernel.kv_canary`` on a realistic state:

- a Qwen3-0.6B-like layer-0 K buffer (8 KV heads x head_dim 128, bf16 = 2048 bytes per token,
  random values) as the only ``RealKvSource`` (page_size 1, num_bytes_per_token = read_bytes =
  2048), a canary buffer ``uint8 [num_slots, 32]``, ``req_to_token int32 [bs + 1, ctx]`` whose
  rows hold a random permutation of the pool's slots (like an allocator after churn), random
  token ids, and requests placed on shuffled ``req_to_token`` rows;
- canary records made consistent before anything is timed: the write kernel fills every
  request's history (prefix) in the real-KV mode under test, so verify walks real,
  violation-free records (never zeros).

Scenarios: decode (bs in 1/32/256/1024 x context 512/4096/32768; 1 new token per request, its
chain seeded by the prefix's last slot) and prefill (1 x 32768 and 32 x 2048 new tokens,
prefix 0). Combinations whose verify entries exceed 64M or whose pool (layer-0 K buffer +
canary buffer) would exceed 20 GB are skipped and listed as skipped. Real-KV modes: none /
partial / all (``RealKvHashMode``).

Per shape: ``plan`` (``launch_canary_plan_kernels``; timed once, it has no real-KV mode),
``scatter`` (``launch_scatter_req_token_ids_kernel`` of each request's full token history
into an int32 expected-token pool; timed once), and per mode ``write`` (TAIL write: decode =
1 token per request with a seed, prefill = the new tokens) and ``verify`` (TAIL verify over
the planned entries).

Timing: ``triton.testing.do_bench`` (warm-up included, L2 flushed before every call, median).
Two numbers per kernel: ``us eager`` times the Python launcher call (host-side validation +
launch; for tiny kernels some host time can leak into it), ``us graph`` times the replay of a
CUDA graph holding that one launch (device time, as in sglang's CUDA-graph decode). Effective
GB/s and the fraction of copy bandwidth use the graph time.

Copy bandwidth: ``dst.copy_(src)`` of 1 GiB bf16, counted as 2 GiB moved (read + write).

Correctness before timing: every verify / write run on the GPU must leave the violation ring
empty (``violation_write_index == 0``), also after timing, and the fill must store every
history slot. Each launch is also re-run with its ``*_torch_reference`` on a copy of the state
and compared byte for byte (plans, records, ring, counters, expected-token pool): on CPU copies
for the shapes small enough for the CPU (<= 140k slots), on GPU copies (the references are plain
torch) for the big ones. The write reference loops over chain steps, so writes of more than
4096 tokens per request (prefill 1 x 32768) are checked for zero violations only.

Byte floors (what each kernel must move; int64 = 8 bytes; E = verify entries = bs * prefix,
N = tokens written = bs * extend, T = tokens scattered, B = bs, F = fingerprint bytes per slot
= 0 / 16 / 2048 for none / partial / all):

- plan:    E * (4 + 32) + B * 52
           per entry: the req_to_token slot (4 B; its predecessor is in the same cache line,
           not counted again) and the four int64 plan entries written (32 B); per request:
           req_pool_indices / prefix_lens / extend_seq_lens read (3 * 8 B), the seed's
           req_to_token entry (4 B), write_offsets / verify_req_offsets / seed written (3 * 8 B).
- verify:  E * (32 + 32 + 24 + F)
           per entry: the four int64 plan entries (32 B), the slot's record (32 B), the fields
           token/position/prev_hash of the predecessor's record (24 B), the slot's real KV bytes.
- write:   N * (3 * 8 + 32 + F) + B * 16 + B_seeded * 24
           per token: input_ids / positions / out_cache_loc (int64) read, the record written
           (32 B), the slot's real KV bytes; per request: write_offsets and the seed index
           (2 * 8 B), and for seeded requests (prefix > 0) the seed record's
           token/position/prev_hash (24 B).
- scatter: T * (8 + 4) + B * 16
           per token: flat int64 token read, int32 pool entry written; per request: offsets and
           req_pool_indices (2 * 8 B).

Effective GB/s = floor bytes / median time; "% copy" = effective GB/s / copy GB/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import pathlib
import sys
import time
from typing import Callable, List, Optional

import torch
import triton

from sglang.jit_kernel.kv_canary import (
    CANARY_SLOT_BYTES,
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
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
from sglang.jit_kernel.kv_canary.consts import VIOLATION_NUM_FIELDS

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import use_test_support  # noqa: E402  (a sibling module)

use_test_support()
from canary_testlib import clone_dataclass_tensors  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Model / pool shape (Qwen3-0.6B-ish layer 0)
# ---------------------------------------------------------------------------------------------

NUM_KV_HEADS = 8
HEAD_DIM = 128
KV_DTYPE = torch.bfloat16
BYTES_PER_TOKEN = NUM_KV_HEADS * HEAD_DIM * 2  # 2048
VOCAB_SIZE = 151936
TAG = CanaryLaunchTag.TAIL_K_FULL
RING_CAPACITY = 64

MODES = (
    ("none", RealKvHashMode.NONE),
    ("partial", RealKvHashMode.PARTIAL),
    ("all", RealKvHashMode.ALL),
)
FINGERPRINT_BYTES = {
    RealKvHashMode.NONE: 0,
    RealKvHashMode.PARTIAL: min(16, BYTES_PER_TOKEN),
    RealKvHashMode.ALL: BYTES_PER_TOKEN,
}

# Limits of the GPU run.
MAX_VERIFY_ENTRIES = 64 * 2**20
MAX_POOL_BYTES = 20 * 10**9
# Shapes whose torch-reference check runs on CPU copies (bigger ones: on GPU copies), and the
# longest per-request write chain the (step-looping) write reference is asked to replay.
CHECK_MAX_SLOTS = 140_000
CHECK_MAX_CHAIN = 4096

COPY_BYTES = 2**30  # 1 GiB source buffer

GPU_DECODE_BS = (1, 32, 256, 1024)
GPU_DECODE_CTX = (512, 4096, 32768)
GPU_PREFILL = ((1, 32768), (32, 2048))

SMOKE_DECODE_BS = (1, 3)
SMOKE_DECODE_CTX = (5, 17)
SMOKE_PREFILL = ((1, 40), (3, 9))
SMOKE_DECODE_EXTRA = ((64, 1024),)  # exercises the skip path (over SMOKE_MAX_POOL_BYTES)
SMOKE_MAX_POOL_BYTES = 10**8

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Shapes and byte floors
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str  # "decode" | "prefill"
    bs: int
    prefix: int  # tokens already cached per request (verified)
    extend: int  # new tokens per request (written)

    @property
    def name(self) -> str:
        if self.kind == "decode":
            return f"decode bs={self.bs} ctx={self.prefix}"
        return f"prefill {self.bs}x{self.extend} (prefix {self.prefix})"

    @property
    def hist_len(self) -> int:
        return self.prefix + self.extend

    @property
    def num_slots(self) -> int:
        return self.bs * self.hist_len + 1  # + slot 0, the padding slot

    @property
    def verify_entries(self) -> int:
        return self.bs * self.prefix

    @property
    def write_tokens(self) -> int:
        return self.bs * self.extend

    @property
    def scatter_tokens(self) -> int:
        return self.bs * self.hist_len

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * (BYTES_PER_TOKEN + CANARY_SLOT_BYTES)

    def skip_reason(self, max_pool_bytes: int = MAX_POOL_BYTES) -> Optional[str]:
        if self.verify_entries > MAX_VERIFY_ENTRIES:
            return (
                f"skipped: {self.verify_entries / 2**20:.0f}M verify entries > "
                f"{MAX_VERIFY_ENTRIES / 2**20:.0f}M"
            )
        if self.pool_bytes > max_pool_bytes:
            return f"skipped: pool {self.pool_bytes / 1e9:.2f} GB > {max_pool_bytes / 1e9:g} GB"
        return None

    @property
    def check_on_cpu(self) -> bool:
        return self.num_slots <= CHECK_MAX_SLOTS


def plan_bytes(s: Shape) -> int:
    return s.verify_entries * (4 + 32) + s.bs * 52


def verify_bytes(s: Shape, mode: RealKvHashMode) -> int:
    return s.verify_entries * (32 + 32 + 24 + FINGERPRINT_BYTES[mode])


def write_bytes(s: Shape, mode: RealKvHashMode) -> int:
    seeded = s.bs if s.prefix > 0 else 0
    return s.write_tokens * (3 * 8 + 32 + FINGERPRINT_BYTES[mode]) + s.bs * 16 + seeded * 24


def scatter_bytes(s: Shape) -> int:
    return s.scatter_tokens * (8 + 4) + s.bs * 16


# ---------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------


def _clone(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)
    if isinstance(obj, (VerifyPlan, WritePlan)):
        return clone_dataclass_tensors(obj, device)
    return obj


class State:
    """Every tensor one shape needs; ``clone(device)`` copies them (for the reference check)."""

    def __init__(self, **tensors):
        self.__dict__.update(tensors)

    @classmethod
    def build(cls, shape: Shape, device: torch.device, seed: int = 0) -> "State":
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        bs, L = shape.bs, shape.hist_len
        rows = bs + 1  # row 0 of req_to_token is SGLang's padding row
        # Layer-0 K buffer of an MHA pool: [num_slots, kv_heads, head_dim] bf16, random values.
        k_buffer = torch.empty(
            shape.num_slots, NUM_KV_HEADS, HEAD_DIM, dtype=KV_DTYPE, device=device
        )
        k_buffer.normal_(generator=g)
        # Requests sit on shuffled rows; their slots are a random permutation of the pool.
        rpi = torch.randperm(bs, generator=g, device=device) + 1
        slots = torch.randperm(bs * L, generator=g, device=device) + 1
        req_to_token = torch.zeros(rows, L, dtype=torch.int32, device=device)
        req_to_token[rpi] = slots.view(bs, L).to(torch.int32)
        del slots
        tokens = torch.randint(
            0, VOCAB_SIZE, (rows, L), generator=g, device=device, dtype=torch.int64
        )
        i64 = dict(dtype=torch.int64, device=device)
        p = shape.prefix
        st = cls(
            shape=shape,
            k_buffer=k_buffer,
            canary_buf=torch.zeros(
                shape.num_slots, CANARY_SLOT_BYTES, dtype=torch.uint8, device=device
            ),
            # one ring / index / per-tag counters, shared by the contexts of all modes
            violation_ring=torch.zeros(RING_CAPACITY, VIOLATION_NUM_FIELDS, **i64),
            violation_write_index=torch.zeros(1, dtype=torch.int32, device=device),
            slot_counters=torch.zeros(len(CanaryLaunchTag), **i64),
            kernel_counters=torch.zeros(len(CanaryLaunchTag), **i64),
            chain_assert=torch.ones(1, dtype=torch.int32, device=device),
            req_to_token=req_to_token,
            req_pool_indices=rpi,
            prefix_lens=torch.full((bs,), p, **i64),
            extend_seq_lens=torch.full((bs,), shape.extend, **i64),
            verify_plan=VerifyPlan.allocate(
                verify_capacity=max(1, shape.verify_entries), device=device
            ),
            write_plan=WritePlan.allocate(write_req_capacity=bs, device=device),
            # this forward's new tokens, in batch order
            input_ids=tokens[rpi, p:].reshape(-1).contiguous(),
            positions=torch.arange(p, L, **i64).repeat(bs),
            out_cache_loc=req_to_token[rpi, p:].reshape(-1).to(torch.int64),
            # scatter: each request's full token history into an int32 expected-token pool
            scatter_flat=tokens[rpi].reshape(-1).contiguous(),
            scatter_offsets=torch.arange(bs + 1, **i64) * L,
            scatter_pool=torch.zeros(rows, L, dtype=torch.int32, device=device),
        )
        if p > 0:  # history written by earlier forwards (filled before timing)
            st.fill_input_ids = tokens[rpi, :p].reshape(-1).contiguous()
            st.fill_positions = torch.arange(p, **i64).repeat(bs)
            st.fill_out_cache_loc = req_to_token[rpi, :p].reshape(-1).to(torch.int64)
            st.fill_verify_plan = VerifyPlan.allocate(verify_capacity=1, device=device)
            st.fill_write_plan = WritePlan.allocate(write_req_capacity=bs, device=device)
        return st

    def clone(self, device, share_k_buffer: Optional[torch.Tensor] = None) -> "State":
        out = {}
        for k, v in self.__dict__.items():
            if k == "k_buffer" and share_k_buffer is not None:
                out[k] = share_k_buffer
            else:
                out[k] = _clone(v, device)
        return State(**out)

    def context(self, mode: RealKvHashMode) -> VerifyOrWriteContext:
        source = RealKvSource(
            tensor=self.k_buffer,
            page_size=1,
            num_bytes_per_token=BYTES_PER_TOKEN,
            read_bytes=BYTES_PER_TOKEN,
        )
        t = int(TAG)
        return VerifyOrWriteContext(
            canary_buf=self.canary_buf,
            kernel_kind=TAG,
            violation_ring=self.violation_ring,
            violation_write_index=self.violation_write_index,
            slot_run_counter=self.slot_counters[t : t + 1],
            kernel_run_counter=self.kernel_counters[t : t + 1],
            real_kv_sources=(source,),
            real_kv_hash_mode=mode,
            enable_chain_position_assert=self.chain_assert,
        )


# ---------------------------------------------------------------------------------------------
# Launches (``ref=True`` calls the torch reference directly)
# ---------------------------------------------------------------------------------------------


def run_plan(st: State, *, ref: bool = False, fill: bool = False) -> None:
    fn = launch_canary_plan_kernels_torch_reference if ref else launch_canary_plan_kernels
    vp = st.fill_verify_plan if fill else st.verify_plan
    fn(
        verify_plan_out=vp,
        write_plan_out=st.fill_write_plan if fill else st.write_plan,
        req_pool_indices=st.req_pool_indices,
        prefix_lens=torch.zeros_like(st.prefix_lens) if fill else st.prefix_lens,
        extend_seq_lens=st.prefix_lens if fill else st.extend_seq_lens,
        req_to_token=st.req_to_token,
        swa_window_size=0,
        full_to_swa_index_mapping=None,
        verify_capacity=vp.capacity,
        req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None,
        kv_token_id_vs_position_offset=0,
    )


def run_write(
    st: State, ctx: VerifyOrWriteContext, *, ref: bool = False, fill: bool = False
) -> None:
    fn = launch_canary_write_kernel_torch_reference if ref else launch_canary_write_kernel
    fn(
        context=ctx,
        plan=st.fill_write_plan if fill else st.write_plan,
        input_ids=st.fill_input_ids if fill else st.input_ids,
        positions=st.fill_positions if fill else st.positions,
        out_cache_loc=st.fill_out_cache_loc if fill else st.out_cache_loc,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )


def run_verify(st: State, ctx: VerifyOrWriteContext, *, ref: bool = False) -> None:
    fn = launch_canary_verify_kernel_torch_reference if ref else launch_canary_verify_kernel
    fn(context=ctx, plan=st.verify_plan, check_verify_expected_token=False)


def run_scatter(st: State, *, ref: bool = False) -> None:
    fn = scatter_req_token_ids_torch_reference if ref else launch_scatter_req_token_ids_kernel
    fn(
        flat_in=st.scatter_flat,
        offsets=st.scatter_offsets,
        req_pool_indices=st.req_pool_indices,
        pool_out=st.scatter_pool,
    )


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def _equal(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.cpu(), b.cpu()
    if (
        a.dtype != b.dtype
        or a.shape != b.shape
        or not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    ):
        diff = (a != b).nonzero()[:5].tolist() if a.shape == b.shape else "shape"
        raise AssertionError(
            f"{name}: device result differs from the torch reference "
            f"(first differing indices: {diff})"
        )


def assert_plans_equal(dev: State, ref: State) -> None:
    for attr in ("verify_plan", "write_plan"):
        a, b = getattr(dev, attr), getattr(ref, attr)
        for f in dataclasses.fields(a):
            if f.init:
                _equal(f"{attr}.{f.name}", getattr(a, f.name), getattr(b, f.name))


def assert_records_equal(dev: State, ref: State) -> None:
    _equal("canary_buf", dev.canary_buf, ref.canary_buf)
    _equal("violation_write_index", dev.violation_write_index, ref.violation_write_index)
    _equal("violation_ring", dev.violation_ring, ref.violation_ring)
    _equal("slot_run_counter", dev.slot_counters, ref.slot_counters)
    _equal("kernel_run_counter", dev.kernel_counters, ref.kernel_counters)


def assert_no_violations(st: State, what: str) -> None:
    n = int(st.violation_write_index[0].item())
    if n:
        rows = st.violation_ring[: min(n, 3)].tolist()
        raise AssertionError(f"{what}: {n} violation(s) on a clean state, first rows: {rows}")


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    eager_us: float
    graph_us: Optional[float]

    @property
    def device_us(self) -> float:
        return self.graph_us if self.graph_us is not None else self.eager_us


def time_cuda(fn: Callable[[], None]) -> Timing:
    fn()  # compiled and warm already; make sure nothing is pending
    torch.cuda.synchronize()
    eager_ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    graph_ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    del graph
    return Timing(eager_ms * 1e3, graph_ms * 1e3)


def time_cpu_once(fn: Callable[[], None]) -> Timing:
    t = time.perf_counter()
    fn()
    return Timing((time.perf_counter() - t) * 1e6, None)


def _copy_ms(device: torch.device) -> float:
    """Median ms of ``dst.copy_(src)`` on 1 GiB bf16 (both freed when this returns)."""
    src = torch.randn(COPY_BYTES // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")


def measure_copy_bandwidth(device: torch.device) -> float:
    """GB/s of ``dst.copy_(src)`` on 1 GiB bf16, counting read + write bytes."""
    ms = _copy_ms(device)
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------------
# Benchmark driver
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    kernel: str
    scenario: str
    mode: str
    entries: str
    timing: Optional[Timing] = None
    nbytes: int = 0
    checked: str = ""
    note: str = ""


class Bench:
    def __init__(self, device: torch.device, smoke: bool):
        self.device = device
        self.smoke = smoke
        self.rows: List[Row] = []
        self.copy_gbps: Optional[float] = None

    def time(self, fn: Callable[[], None]) -> Timing:
        return time_cpu_once(fn) if self.smoke else time_cuda(fn)

    def shapes(self) -> List[Shape]:
        if self.smoke:
            dbs, dctx, pre = SMOKE_DECODE_BS, SMOKE_DECODE_CTX, SMOKE_PREFILL
        else:
            dbs, dctx, pre = GPU_DECODE_BS, GPU_DECODE_CTX, GPU_PREFILL
        out = [Shape("decode", bs, ctx, 1) for bs in dbs for ctx in dctx]
        if self.smoke:
            out += [Shape("decode", bs, ctx, 1) for bs, ctx in SMOKE_DECODE_EXTRA]
        out += [Shape("prefill", bs, 0, n) for bs, n in pre]
        return out

    def run(self) -> None:
        if not self.smoke:
            log("measuring copy bandwidth (1 GiB bf16 dst.copy_(src))")
            self.copy_gbps = measure_copy_bandwidth(self.device)
            log(f"copy bandwidth: {self.copy_gbps:.0f} GB/s")
        for shape in self.shapes():
            reason = shape.skip_reason(SMOKE_MAX_POOL_BYTES if self.smoke else MAX_POOL_BYTES)
            if reason:
                log(f"{shape.name}: {reason}")
                self.rows.append(
                    Row("all", shape.name, "-", f"{shape.verify_entries}", note=reason)
                )
                continue
            self.run_shape(shape)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def run_shape(self, shape: Shape) -> None:
        log(
            f"{shape.name}: building state ({shape.num_slots} slots, pool "
            f"{shape.pool_bytes / 1e9:.2f} GB, {shape.verify_entries} verify entries)"
        )
        st = State.build(shape, self.device)
        # The torch references run on CPU copies for small shapes, on GPU copies otherwise
        # (they are plain torch code); the K buffer is shared (no launch writes it).
        ref_device = torch.device("cpu") if shape.check_on_cpu else self.device
        ref_k = st.k_buffer if ref_device == self.device else st.k_buffer.to(ref_device)
        ref_label = f"ref({'cpu' if ref_device.type == 'cpu' else 'gpu'})"
        check_write = shape.extend <= CHECK_MAX_CHAIN

        def ref_copy() -> State:
            return st.clone(ref_device, share_k_buffer=ref_k)

        # ---- plan (no real-KV mode) ----
        log(f"{shape.name}: plan")
        ref = ref_copy()
        run_plan(st)
        run_plan(ref, ref=True)
        assert_plans_equal(st, ref)
        assert int(st.verify_plan.enable[0]) == 1
        assert int(st.verify_plan.verify_num_valid[0]) == shape.verify_entries
        self.rows.append(
            Row(
                "plan",
                shape.name,
                "n/a",
                str(shape.verify_entries),
                self.time(lambda: run_plan(st)),
                plan_bytes(shape),
                ref_label,
            )
        )

        # ---- scatter (no real-KV mode) ----
        log(f"{shape.name}: scatter")
        ref = ref_copy()
        run_scatter(st)
        run_scatter(ref, ref=True)
        _equal("scatter pool_out", st.scatter_pool, ref.scatter_pool)
        self.rows.append(
            Row(
                "scatter",
                shape.name,
                "n/a",
                str(shape.scatter_tokens),
                self.time(lambda: run_scatter(st)),
                scatter_bytes(shape),
                ref_label,
            )
        )

        for mode_name, mode in MODES:
            ctx = st.context(mode)
            # ---- fill the history in this mode (records consistent with the KV bytes) ----
            if shape.prefix > 0:
                t = int(TAG)
                before = int(st.slot_counters[t])
                run_plan(st, fill=True)
                run_write(st, ctx, fill=True)
                filled = int(st.slot_counters[t]) - before
                assert filled == shape.verify_entries, (filled, shape.verify_entries)
                assert_no_violations(st, f"{shape.name} fill ({mode_name})")
                words = st.canary_buf.view(torch.int64)
                hist = st.fill_out_cache_loc
                assert bool((words[hist, 2] != 0).all()), "fill left zero prev_hash fields"
                if mode != RealKvHashMode.NONE:
                    assert bool((words[hist, 3] != 0).any()), "fill left no real_kv_hash"

            # ---- verify: reference re-verifies the device-filled records byte for byte ----
            log(f"{shape.name}: verify ({mode_name})")
            ref = ref_copy()
            run_verify(st, ctx)
            run_verify(ref, ref.context(mode), ref=True)
            assert_records_equal(st, ref)
            assert_no_violations(st, f"{shape.name} verify ({mode_name})")
            del ref
            timing = self.time(lambda: run_verify(st, ctx))
            assert_no_violations(st, f"{shape.name} verify ({mode_name}, timed)")
            self.rows.append(
                Row(
                    "verify",
                    shape.name,
                    mode_name,
                    str(shape.verify_entries),
                    timing,
                    verify_bytes(shape, mode),
                    ref_label + "+clean",
                )
            )

            # ---- write ----
            log(f"{shape.name}: write ({mode_name})")
            ref = ref_copy() if check_write else None
            run_write(st, ctx)
            if check_write:
                run_write(ref, ref.context(mode), ref=True)
                assert_records_equal(st, ref)
            assert_no_violations(st, f"{shape.name} write ({mode_name})")
            del ref
            timing = self.time(lambda: run_write(st, ctx))
            assert_no_violations(st, f"{shape.name} write ({mode_name}, timed)")
            self.rows.append(
                Row(
                    "write",
                    shape.name,
                    mode_name,
                    str(shape.write_tokens),
                    timing,
                    write_bytes(shape, mode),
                    ref_label + "+clean" if check_write else "clean",
                )
            )
        # st and ref_k are freed at return; run() then empties the CUDA cache

    # ---- output ----

    def header(self) -> str:
        now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        if self.smoke:
            dev = "CPU (smoke: torch references, 1 call per kernel, NO timing claims)"
            bw = "n/a"
        else:
            dev = torch.cuda.get_device_name(self.device)
            bw = f"{self.copy_gbps:.0f} GB/s (1 GiB bf16 copy, read+write)"
        return (
            f"KV-canary kernels — {dev} — {now} — torch {torch.__version__}, "
            f"triton {triton.__version__} — copy bandwidth {bw}"
        )

    def table(self) -> str:
        lines = [
            "| kernel | scenario | mode | entries | µs eager (median) | µs graph (median) "
            "| floor bytes | effective GB/s | % of copy BW | checked |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in self.rows:
            if r.timing is None:
                lines.append(
                    f"| {r.kernel} | {r.scenario} | {r.mode} | {r.entries} | {r.note} | | | | | |"
                )
                continue
            graph = f"{r.timing.graph_us:.1f}" if r.timing.graph_us is not None else "-"
            if self.smoke or r.nbytes == 0:
                gbps = frac = "-"
            else:
                g = r.nbytes / (r.timing.device_us * 1e-6) / 1e9
                gbps = f"{g:.1f}"
                frac = f"{100 * g / self.copy_gbps:.1f} %"
            lines.append(
                f"| {r.kernel} | {r.scenario} | {r.mode} | {r.entries} | "
                f"{r.timing.eager_us:.1f} | {graph} | {_fmt_bytes(r.nbytes)} | "
                f"{gbps} | {frac} | {r.checked} |"
            )
        return "\n".join(lines)

    def legend(self) -> str:
        return (
            "entries: verify entries (plan, verify), tokens written (write), tokens scattered "
            "(scatter). µs eager: `do_bench` of the Python launcher call; µs graph: `do_bench` "
            "of a CUDA-graph replay of that one launch (L2 flushed before each call in both); "
            "GB/s and % use the graph time and the byte floors in the script's docstring. "
            "checked: ref(cpu) / ref(gpu) = byte-equal (plans, records, ring, counters, "
            "expected-token pool) to the torch reference run on CPU / GPU copies of the state; "
            "clean = zero violations on the device run (and on the timed runs)."
        )


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on CPU tensors (torch references), 1 call per kernel, no timing claims",
    )
    ap.add_argument("--out", default=None, help="also write the markdown table to this path")
    args = ap.parse_args(argv)

    if args.smoke:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device; use --smoke for the CPU smoke check")
        device = torch.device("cuda", torch.cuda.current_device())

    bench = Bench(device, smoke=args.smoke)
    bench.run()
    text = "\n".join([bench.header(), "", bench.table(), "", bench.legend(), ""])
    log("done")
    print()
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        log(f"table written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
