"""Canary verify kernel, its launch context and plan, launch tags and real-KV sources (SPEC §2, §3, §6).

``launch_canary_verify_kernel`` re-checks the canary records of every slot a forward's attention
is about to read. It is read-only on the records; violations go to the context's ring.
Graph-safe: no allocation, no host sync, no branching on device values on the launch path.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary import _hash_triton as H
from sglang.jit_kernel.kv_canary._launch import (
    check_int,
    check_tensor,
    grid_size,
    same_device,
    use_triton,
)
from sglang.jit_kernel.kv_canary.consts import (
    REAL_KV_MAX_SOURCES,
    REAL_KV_PARTIAL_BYTES,
    REAL_KV_WORD_BYTES,
    VIOLATION_NUM_FIELDS,
    RealKvHashMode,
)

CANARY_SLOT_BYTES = 32


# ---------------------------------------------------------------------------------------------
# Launch tags: the one place that knows what (phase, half, pool kind) a tag stands for.
# ---------------------------------------------------------------------------------------------


class CanaryPhase(enum.Enum):
    HEAD = "head"  # before the model forward: no real-KV fingerprint
    TAIL = "tail"  # after the model forward: with the fingerprint
    SWEEP = "sweep"  # radix-cache sweep over the TAIL buffers


class KvHalf(enum.Enum):
    K = "k"
    V = "v"


class PoolKind(enum.Enum):
    """Which slot address space a buffer group guards."""

    FULL = "full"
    SWA = "swa"


_PHASE_ORDER = (CanaryPhase.HEAD, CanaryPhase.TAIL, CanaryPhase.SWEEP)
_HALF_ORDER = (KvHalf.K, KvHalf.V)
_KIND_ORDER = (PoolKind.FULL, PoolKind.SWA)


class CanaryLaunchTag(enum.IntEnum):
    """Identifies a launch in violation rows and per-tag counters (values fixed, SPEC §3)."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11

    @property
    def pool_kind(self) -> PoolKind:
        return _KIND_ORDER[self.value // 6]

    @property
    def phase(self) -> CanaryPhase:
        return _PHASE_ORDER[(self.value % 6) // 2]

    @property
    def half(self) -> KvHalf:
        return _HALF_ORDER[self.value % 2]

    @classmethod
    def of(cls, phase: CanaryPhase, half: KvHalf, pool_kind: PoolKind) -> "CanaryLaunchTag":
        return cls(
            _KIND_ORDER.index(pool_kind) * 6
            + _PHASE_ORDER.index(phase) * 2
            + _HALF_ORDER.index(half)
        )


NUM_CANARY_LAUNCH_TAGS = len(CanaryLaunchTag)


# ---------------------------------------------------------------------------------------------
# Real-KV sources
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class RealKvSource:
    """A tensor whose bytes for slot ``s`` are fingerprinted into the record's ``real_kv_hash``.

    The bytes of slot ``s`` are ``tensor_u8[s // page_size, (s % page_size) * num_bytes_per_token
    : ... + read_bytes]``, where ``tensor_u8`` views each row ``tensor[i]`` (dims 1.. contiguous)
    as raw bytes. ``num_bytes_per_token``, ``read_bytes`` and the row stride in bytes must be
    positive multiples of 8 (the fold reads little-endian u64 words); the tensor's data must be
    8-byte aligned. Validated on construction; ``words_view`` is an int64 alias (no copy) of the
    bytes the fingerprint may read, shaped ``[num_pages, page_size * num_bytes_per_token / 8]``.
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    words_view: torch.Tensor = dataclasses.field(init=False, repr=False)
    row_stride_words: int = dataclasses.field(init=False)

    def __post_init__(self):
        t = self.tensor
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"RealKvSource.tensor must be a torch.Tensor, got {type(t).__name__}")
        check_int("RealKvSource.page_size", self.page_size, minimum=1)
        for name in ("num_bytes_per_token", "read_bytes"):
            value = check_int(f"RealKvSource.{name}", getattr(self, name), minimum=1)
            if value % REAL_KV_WORD_BYTES:
                raise ValueError(
                    f"RealKvSource.{name} must be a positive multiple of 8, got {value}"
                )
        if self.read_bytes > self.num_bytes_per_token:
            raise ValueError(
                f"RealKvSource.read_bytes ({self.read_bytes}) must not exceed "
                f"num_bytes_per_token ({self.num_bytes_per_token})"
            )
        if t.dim() < 2:
            raise ValueError(
                f"RealKvSource.tensor must be at least 2-D (rows of pages), got shape {tuple(t.shape)}"
            )
        esize = t.element_size()
        expected = 1
        for dim in range(t.dim() - 1, 0, -1):
            if t.shape[dim] != 1 and t.stride(dim) != expected:
                raise ValueError(
                    "RealKvSource.tensor must have contiguous rows (dims 1.. contiguous), got "
                    f"shape {tuple(t.shape)} strides {t.stride()}"
                )
            expected *= t.shape[dim]
        row_bytes = expected * esize
        row_stride_bytes = t.stride(0) * esize if t.shape[0] > 1 else row_bytes
        if row_stride_bytes <= 0 or row_stride_bytes % REAL_KV_WORD_BYTES:
            raise ValueError(
                f"RealKvSource.tensor row stride must be a positive multiple of 8 bytes, got "
                f"{row_stride_bytes}"
            )
        page_bytes = self.page_size * self.num_bytes_per_token
        if page_bytes > row_bytes:
            raise ValueError(
                f"RealKvSource: page_size * num_bytes_per_token = {page_bytes} bytes exceeds "
                f"the tensor's row of {row_bytes} bytes"
            )
        byte_offset = t.storage_offset() * esize
        if byte_offset % REAL_KV_WORD_BYTES or t.untyped_storage().data_ptr() % REAL_KV_WORD_BYTES:
            raise ValueError("RealKvSource.tensor data must be 8-byte aligned")
        if t.shape[0] == 0:
            raise ValueError("RealKvSource.tensor has no rows")
        words = torch.empty(0, dtype=torch.int64, device=t.device)
        words.set_(
            t.untyped_storage(),
            byte_offset // REAL_KV_WORD_BYTES,
            (t.shape[0], page_bytes // REAL_KV_WORD_BYTES),
            (row_stride_bytes // REAL_KV_WORD_BYTES, 1),
        )
        object.__setattr__(self, "words_view", words)
        object.__setattr__(self, "row_stride_words", row_stride_bytes // REAL_KV_WORD_BYTES)

    @property
    def num_words_per_token(self) -> int:
        return self.num_bytes_per_token // REAL_KV_WORD_BYTES

    @property
    def num_slots(self) -> int:
        """Slots this source has bytes for."""
        return self.tensor.shape[0] * self.page_size

    def words_to_fold(self, mode: RealKvHashMode) -> int:
        """8-byte words of each slot that a fingerprint in ``mode`` folds."""
        if mode == RealKvHashMode.NONE:
            return 0
        if mode == RealKvHashMode.PARTIAL:
            return min(REAL_KV_PARTIAL_BYTES, self.read_bytes) // REAL_KV_WORD_BYTES
        return self.read_bytes // REAL_KV_WORD_BYTES


# ---------------------------------------------------------------------------------------------
# Launch context
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class VerifyOrWriteContext:
    """Everything a verify or write launch needs besides its plan (built once per endpoint).

    - ``canary_buf``: uint8 ``[num_slots, 32]`` contiguous, the records.
    - ``kernel_kind``: the :class:`CanaryLaunchTag` written into violation rows.
    - ``violation_ring``: int64 ``[ring_capacity, 8]``; ``violation_write_index``: int32 ``[1]``.
    - ``slot_run_counter`` / ``kernel_run_counter``: int64 ``[1]`` (views into per-tag arrays).
    - ``real_kv_sources``: up to 4 :class:`RealKvSource` covering every slot of ``canary_buf``.
    - ``real_kv_hash_mode``: :class:`RealKvHashMode` (NONE for HEAD launches).
    - ``enable_chain_position_assert``: int32 ``[1]`` device flag read by the write kernel.
    """

    canary_buf: torch.Tensor
    kernel_kind: CanaryLaunchTag
    violation_ring: torch.Tensor
    violation_write_index: torch.Tensor
    slot_run_counter: torch.Tensor
    kernel_run_counter: torch.Tensor
    real_kv_sources: Tuple[RealKvSource, ...] = ()
    real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE
    enable_chain_position_assert: Optional[torch.Tensor] = None
    canary_words: torch.Tensor = dataclasses.field(init=False, repr=False)
    source_launch_args: tuple = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        buf = check_tensor("canary_buf", self.canary_buf, dtypes=(torch.uint8,),
                           shape=(None, CANARY_SLOT_BYTES))
        if buf.shape[0] < 1:
            raise ValueError("canary_buf must have at least one row (slot 0 is the padding slot)")
        if not isinstance(self.kernel_kind, CanaryLaunchTag):
            try:
                object.__setattr__(self, "kernel_kind", CanaryLaunchTag(self.kernel_kind))
            except ValueError:
                raise ValueError(
                    f"kernel_kind must be a CanaryLaunchTag (0..{NUM_CANARY_LAUNCH_TAGS - 1}), "
                    f"got {self.kernel_kind!r}"
                ) from None
        check_tensor("violation_ring", self.violation_ring, dtypes=(torch.int64,),
                     shape=(None, VIOLATION_NUM_FIELDS))
        check_tensor("violation_write_index", self.violation_write_index,
                     dtypes=(torch.int32,), shape=(1,))
        check_tensor("slot_run_counter", self.slot_run_counter, dtypes=(torch.int64,), shape=(1,))
        check_tensor("kernel_run_counter", self.kernel_run_counter, dtypes=(torch.int64,),
                     shape=(1,))
        if self.enable_chain_position_assert is None:
            object.__setattr__(self, "enable_chain_position_assert",
                               torch.zeros(1, dtype=torch.int32, device=buf.device))
        check_tensor("enable_chain_position_assert", self.enable_chain_position_assert,
                     dtypes=(torch.int32,), shape=(1,))
        sources = tuple(self.real_kv_sources)
        object.__setattr__(self, "real_kv_sources", sources)
        if len(sources) > REAL_KV_MAX_SOURCES:
            raise ValueError(
                f"real_kv_sources holds at most {REAL_KV_MAX_SOURCES} sources, got {len(sources)}"
            )
        for i, source in enumerate(sources):
            if not isinstance(source, RealKvSource):
                raise TypeError(f"real_kv_sources[{i}] must be a RealKvSource, got "
                                f"{type(source).__name__}")
            if source.num_slots < buf.shape[0]:
                raise ValueError(
                    f"real_kv_sources[{i}] covers {source.num_slots} slots but canary_buf has "
                    f"{buf.shape[0]}"
                )
        try:
            mode = RealKvHashMode(self.real_kv_hash_mode)
        except ValueError:
            raise ValueError(
                f"real_kv_hash_mode must be one of {[m.name for m in RealKvHashMode]}, got "
                f"{self.real_kv_hash_mode!r}"
            ) from None
        object.__setattr__(self, "real_kv_hash_mode", mode)
        if mode != RealKvHashMode.NONE and not sources:
            raise ValueError(f"real_kv_hash_mode={mode.name} needs at least one real_kv_source")
        same_device({
            "canary_buf": buf,
            "violation_ring": self.violation_ring,
            "violation_write_index": self.violation_write_index,
            "slot_run_counter": self.slot_run_counter,
            "kernel_run_counter": self.kernel_run_counter,
            "enable_chain_position_assert": self.enable_chain_position_assert,
            **{f"real_kv_sources[{i}].tensor": s.tensor for i, s in enumerate(sources)},
        })
        words = buf.view(torch.int64)
        object.__setattr__(self, "canary_words", words)
        args = []
        for i in range(REAL_KV_MAX_SOURCES):
            if i < len(sources):
                s = sources[i]
                args += [s.words_view, s.row_stride_words, s.page_size, s.num_words_per_token,
                         s.words_to_fold(mode)]
            else:  # never dereferenced: NUM_SOURCES is a constexpr
                args += [words, 0, 1, 0, 0]
        object.__setattr__(self, "source_launch_args", tuple(args))

    @property
    def num_slots(self) -> int:
        return self.canary_buf.shape[0]

    @property
    def device(self) -> torch.device:
        return self.canary_buf.device

    @property
    def ring_capacity(self) -> int:
        return self.violation_ring.shape[0]

    @property
    def fingerprint_mode(self) -> RealKvHashMode:
        """The mode the fingerprint actually runs in (NONE when there is nothing to fold)."""
        return self.real_kv_hash_mode if self.real_kv_sources else RealKvHashMode.NONE


# ---------------------------------------------------------------------------------------------
# Verify plan
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class VerifyPlan:
    """The per-forward verify work list (device, fixed capacity; filled by the plan kernels).

    int64 ``[capacity]``: ``verify_slot_indices``, ``verify_expected_tokens`` (-1 = unknown),
    ``verify_expected_positions``, ``verify_prev_slot_indices`` (-1 = chain head, 0 = predecessor
    unreachable); int32 ``[1]``: ``verify_num_valid``, ``enable`` (0 after an overflow).
    """

    verify_slot_indices: torch.Tensor
    verify_expected_tokens: torch.Tensor
    verify_expected_positions: torch.Tensor
    verify_prev_slot_indices: torch.Tensor
    verify_num_valid: torch.Tensor
    enable: torch.Tensor

    def __post_init__(self):
        cap = self.verify_slot_indices.shape[0] if isinstance(
            self.verify_slot_indices, torch.Tensor) and self.verify_slot_indices.dim() == 1 else None
        for name in ("verify_slot_indices", "verify_expected_tokens",
                     "verify_expected_positions", "verify_prev_slot_indices"):
            check_tensor(f"VerifyPlan.{name}", getattr(self, name), dtypes=(torch.int64,),
                         shape=(cap,))
        for name in ("verify_num_valid", "enable"):
            check_tensor(f"VerifyPlan.{name}", getattr(self, name), dtypes=(torch.int32,),
                         shape=(1,))
        same_device({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def capacity(self) -> int:
        return self.verify_slot_indices.shape[0]

    @property
    def device(self) -> torch.device:
        return self.verify_slot_indices.device

    @classmethod
    def allocate(cls, *, verify_capacity: int, device) -> "VerifyPlan":
        check_int("verify_capacity", verify_capacity, minimum=0)
        device = torch.device(device)

        def i64():
            return torch.zeros(verify_capacity, dtype=torch.int64, device=device)

        return cls(
            verify_slot_indices=i64(),
            verify_expected_tokens=i64(),
            verify_expected_positions=i64(),
            verify_prev_slot_indices=i64(),
            verify_num_valid=torch.zeros(1, dtype=torch.int32, device=device),
            enable=torch.zeros(1, dtype=torch.int32, device=device),
        )


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def append_violations(
    ring_ptr, ring_index_ptr, ring_capacity, viol,
    kernel_kind, slot, position, stored_token, expected_token, chain_hash, aux, bits,
):
    """Append one ring row per lane where ``viol``; rows past the capacity are counted, not kept."""
    zero = tl.zeros(viol.shape, dtype=tl.int32)
    idx = tl.atomic_add(ring_index_ptr + zero, 1, mask=viol).to(tl.int64)
    keep = viol & (idx < ring_capacity)
    row = ring_ptr + idx * 8
    tl.store(row + 0, zero.to(tl.int64) + kernel_kind, mask=keep)
    tl.store(row + 1, slot, mask=keep)
    tl.store(row + 2, position, mask=keep)
    tl.store(row + 3, stored_token, mask=keep)
    tl.store(row + 4, expected_token, mask=keep)
    tl.store(row + 5, chain_hash, mask=keep)
    tl.store(row + 6, aux, mask=keep)
    tl.store(row + 7, bits, mask=keep)


@triton.jit
def _canary_verify_kernel(
    canary_ptr, num_slots,
    slot_idx_ptr, exp_tok_ptr, exp_pos_ptr, prev_idx_ptr, num_valid_ptr, enable_ptr, capacity,
    ring_ptr, ring_index_ptr, ring_capacity, slot_counter_ptr, kernel_counter_ptr, kernel_kind,
    s0_ptr, s0_stride, s0_page, s0_wpt, s0_nwords,
    s1_ptr, s1_stride, s1_page, s1_wpt, s1_nwords,
    s2_ptr, s2_stride, s2_page, s2_wpt, s2_nwords,
    s3_ptr, s3_stride, s3_page, s3_wpt, s3_nwords,
    CHECK_TOKEN: tl.constexpr,
    NUM_SOURCES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    enabled = tl.load(enable_ptr) == 1
    n = tl.minimum(tl.maximum(tl.load(num_valid_ptr).to(tl.int64), 0), capacity)
    n = tl.where(enabled, n, 0)
    if pid == 0:
        tl.atomic_add(kernel_counter_ptr, 1)
        tl.atomic_add(slot_counter_ptr, n)
    head = H.chain_head_hash()
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_plan = offs < n
        slot = tl.load(slot_idx_ptr + offs, mask=in_plan, other=0)
        live = in_plan & (slot > 0) & (slot < num_slots)
        rec = canary_ptr + slot * 4
        st_tok = tl.load(rec + 0, mask=live, other=0)
        st_pos = tl.load(rec + 1, mask=live, other=0)
        st_prev = tl.load(rec + 2, mask=live, other=0)
        prev = tl.load(prev_idx_ptr + offs, mask=live, other=0)
        has_prev_rec = live & (prev > 0) & (prev < num_slots)
        check_chain = has_prev_rec | (live & (prev == -1))
        expected_chain = tl.where(prev == -1, head, H.record_hash(canary_ptr, prev, has_prev_rec))
        expected_chain = H.as_i64(expected_chain)
        exp_pos = tl.load(exp_pos_ptr + offs, mask=live, other=0)
        bits = tl.where(check_chain & (st_prev != expected_chain), 1, 0)
        bits |= tl.where(live & (st_pos != exp_pos), 2, 0)
        if CHECK_TOKEN:
            exp_tok = tl.load(exp_tok_ptr + offs, mask=live, other=-1)
            bits |= tl.where(live & (exp_tok != -1) & (st_tok != exp_tok), 32, 0)
        else:
            exp_tok = tl.full(offs.shape, -1, tl.int64)
        if NUM_SOURCES > 0:
            st_kv = tl.load(rec + 3, mask=live, other=0)
            fp = H.real_kv_fingerprint(
                slot, live, NUM_SOURCES,
                s0_ptr, s0_stride, s0_page, s0_wpt, s0_nwords,
                s1_ptr, s1_stride, s1_page, s1_wpt, s1_nwords,
                s2_ptr, s2_stride, s2_page, s2_wpt, s2_nwords,
                s3_ptr, s3_stride, s3_page, s3_wpt, s3_nwords,
            )
            bits |= tl.where(live & (st_kv != H.as_i64(fp)), 4, 0)
        aux = tl.where(check_chain, expected_chain, st_prev)
        append_violations(
            ring_ptr, ring_index_ptr, ring_capacity, live & (bits != 0),
            kernel_kind, slot, st_pos, st_tok, exp_tok, st_prev, aux, bits.to(tl.int64),
        )


VERIFY_BLOCK = 256


def validate_verify_args(context, plan, check_verify_expected_token) -> None:
    """Host-side checks shared by the launcher and the torch reference (metadata only)."""
    if not isinstance(context, VerifyOrWriteContext):
        raise TypeError(f"context must be a VerifyOrWriteContext, got {type(context).__name__}")
    if not isinstance(plan, VerifyPlan):
        raise TypeError(f"plan must be a VerifyPlan, got {type(plan).__name__}")
    if not isinstance(check_verify_expected_token, bool):
        raise TypeError("check_verify_expected_token must be a bool, got "
                        f"{type(check_verify_expected_token).__name__}")
    if plan.device != context.device:
        raise ValueError(f"plan is on {plan.device} but context.canary_buf is on {context.device}")


def launch_canary_verify_kernel(
    *, context: VerifyOrWriteContext, plan: VerifyPlan, check_verify_expected_token: bool
) -> None:
    """Verify the first ``plan.verify_num_valid`` entries of ``plan`` if ``plan.enable == 1``.

    Checks per entry (slot 0 skipped): chain hash vs ``H(record[prev])`` (``prev == -1`` → chain
    head, ``prev == 0`` → predecessor unreachable, not checked), stored position, stored token
    (when ``check_verify_expected_token`` and the expected token is not -1), real-KV
    fingerprint (when the context's mode is not NONE). Appends violation rows, bumps the kernel
    counter by 1 and the slot counter by ``min(num_valid, capacity)`` when enabled.
    Graph-safe on CUDA.
    """
    validate_verify_args(context, plan, check_verify_expected_token)
    if not use_triton(context.device):
        from sglang.jit_kernel.kv_canary.verify_ref import (
            launch_canary_verify_kernel_torch_reference,
        )

        return launch_canary_verify_kernel_torch_reference(
            context=context, plan=plan, check_verify_expected_token=check_verify_expected_token
        )
    grid = (grid_size(context.device, plan.capacity, VERIFY_BLOCK),)
    _canary_verify_kernel[grid](
        context.canary_words, context.num_slots,
        plan.verify_slot_indices, plan.verify_expected_tokens, plan.verify_expected_positions,
        plan.verify_prev_slot_indices, plan.verify_num_valid, plan.enable, plan.capacity,
        context.violation_ring, context.violation_write_index, context.ring_capacity,
        context.slot_run_counter, context.kernel_run_counter, int(context.kernel_kind),
        *context.source_launch_args,
        CHECK_TOKEN=check_verify_expected_token,
        NUM_SOURCES=len(context.real_kv_sources) if context.fingerprint_mode else 0,
        BLOCK=VERIFY_BLOCK,
    )
