"""Host-side types of the KV-canary kernels: launch tags, real-KV sources, the launch context
and the verify / write plans (docs/architecture.md, "Record format";
docs/architecture.md, "Plans").

No Triton here (torch only): the runtime, the validators and the torch references take their
types from this module; the kernel modules (``verify``, ``write``) re-export them for the
documented import paths.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Tuple

import torch

from sglang.jit_kernel.kv_canary._checks import check_int, check_tensor, same_device
from sglang.jit_kernel.kv_canary.consts import (
    CANARY_FIELD_BYTES,
    CANARY_NUM_FIELDS,
    REAL_KV_MAX_SOURCES,
    REAL_KV_PARTIAL_BYTES,
    REAL_KV_WORD_BYTES,
    VIOLATION_NUM_FIELDS,
    RealKvHashMode,
)

# Bytes of one canary record row (``uint8[CANARY_SLOT_BYTES]`` per KV slot): four int64 fields.
CANARY_SLOT_BYTES = CANARY_NUM_FIELDS * CANARY_FIELD_BYTES


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
    """Identifies a launch in violation rows and per-tag counters (values fixed,
    docs/architecture.md, "Record format")."""

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
    - ``violation_ring``: int64 ``[ring_capacity, VIOLATION_NUM_FIELDS]``; ``violation_write_index``: int32 ``[1]``.
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
        buf = check_tensor(
            "canary_buf", self.canary_buf, dtypes=(torch.uint8,), shape=(None, CANARY_SLOT_BYTES)
        )
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
        check_tensor(
            "violation_ring",
            self.violation_ring,
            dtypes=(torch.int64,),
            shape=(None, VIOLATION_NUM_FIELDS),
        )
        check_tensor(
            "violation_write_index", self.violation_write_index, dtypes=(torch.int32,), shape=(1,)
        )
        check_tensor("slot_run_counter", self.slot_run_counter, dtypes=(torch.int64,), shape=(1,))
        check_tensor(
            "kernel_run_counter", self.kernel_run_counter, dtypes=(torch.int64,), shape=(1,)
        )
        if self.enable_chain_position_assert is None:
            object.__setattr__(
                self,
                "enable_chain_position_assert",
                torch.zeros(1, dtype=torch.int32, device=buf.device),
            )
        check_tensor(
            "enable_chain_position_assert",
            self.enable_chain_position_assert,
            dtypes=(torch.int32,),
            shape=(1,),
        )
        sources = tuple(self.real_kv_sources)
        object.__setattr__(self, "real_kv_sources", sources)
        if len(sources) > REAL_KV_MAX_SOURCES:
            raise ValueError(
                f"real_kv_sources holds at most {REAL_KV_MAX_SOURCES} sources, got {len(sources)}"
            )
        for i, source in enumerate(sources):
            if not isinstance(source, RealKvSource):
                raise TypeError(
                    f"real_kv_sources[{i}] must be a RealKvSource, got {type(source).__name__}"
                )
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
        same_device(
            {
                "canary_buf": buf,
                "violation_ring": self.violation_ring,
                "violation_write_index": self.violation_write_index,
                "slot_run_counter": self.slot_run_counter,
                "kernel_run_counter": self.kernel_run_counter,
                "enable_chain_position_assert": self.enable_chain_position_assert,
                **{f"real_kv_sources[{i}].tensor": s.tensor for i, s in enumerate(sources)},
            }
        )
        words = buf.view(torch.int64)
        object.__setattr__(self, "canary_words", words)
        args = []
        for i in range(REAL_KV_MAX_SOURCES):
            if i < len(sources):
                s = sources[i]
                args += [
                    s.words_view,
                    s.row_stride_words,
                    s.page_size,
                    s.num_words_per_token,
                    s.words_to_fold(mode),
                ]
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
    ``verify_expected_positions`` (the position attention reads the slot for),
    ``verify_prev_slot_indices`` (-1 = chain head, 0 = predecessor unreachable),
    ``verify_req_to_token_rows`` (the ``req_to_token`` row the slot was read from, -1 =
    ``NO_REQ_TO_TOKEN_ROW`` for an entry not read through a request, e.g. the sweep; it only
    locates a violation in the report); int32 ``[1]``: ``verify_num_valid``, ``enable`` (0 after
    an overflow).
    """

    verify_slot_indices: torch.Tensor
    verify_expected_tokens: torch.Tensor
    verify_expected_positions: torch.Tensor
    verify_prev_slot_indices: torch.Tensor
    verify_req_to_token_rows: torch.Tensor
    verify_num_valid: torch.Tensor
    enable: torch.Tensor

    def __post_init__(self):
        cap = (
            self.verify_slot_indices.shape[0]
            if isinstance(self.verify_slot_indices, torch.Tensor)
            and self.verify_slot_indices.dim() == 1
            else None
        )
        for name in (
            "verify_slot_indices",
            "verify_expected_tokens",
            "verify_expected_positions",
            "verify_prev_slot_indices",
            "verify_req_to_token_rows",
        ):
            check_tensor(
                f"VerifyPlan.{name}", getattr(self, name), dtypes=(torch.int64,), shape=(cap,)
            )
        for name in ("verify_num_valid", "enable"):
            check_tensor(
                f"VerifyPlan.{name}", getattr(self, name), dtypes=(torch.int32,), shape=(1,)
            )
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
            verify_req_to_token_rows=i64(),
            verify_num_valid=torch.zeros(1, dtype=torch.int32, device=device),
            enable=torch.zeros(1, dtype=torch.int32, device=device),
        )


# ---------------------------------------------------------------------------------------------
# Write parts and plan
# ---------------------------------------------------------------------------------------------


class WriteParts(enum.Enum):
    """Which part of the write a launch does. ``CHAIN`` then ``FINGERPRINT`` (in stream order)
    leaves exactly the bytes, violations and counters of one ``ALL`` launch; split, the serial
    chain (which needs no KV bytes) can run before / beside the model forward and only the
    parallel fingerprint after it.

    - ``ALL``: records with chain and fingerprint (one launch).
    - ``CHAIN``: token, position, chain hash, checks, counters; ``real_kv_hash`` stored as 0.
    - ``FINGERPRINT``: only ``real_kv_hash`` of every written slot; no checks, no counters; a
      no-op without real-data fingerprints.
    """

    ALL = "all"
    CHAIN = "chain"
    FINGERPRINT = "fingerprint"


@dataclasses.dataclass(frozen=True, eq=False)
class WritePlan:
    """Per-forward write layout (device, fixed request capacity; filled by the plan kernels).

    - ``write_offsets`` int64 ``[req_capacity + 1]``: request r writes the entries
      ``[write_offsets[r], write_offsets[r + 1])`` of ``input_ids`` / ``positions`` /
      ``out_cache_loc``; zero beyond the batch.
    - ``write_seed_slot_indices`` int64 ``[req_capacity]``: slot holding position
      ``prefix_len - 1`` (the chain seed), -1 for a chain head or a padding row.
    - ``write_req_to_token_rows`` int64 ``[req_capacity]``: request r's ``req_to_token`` row
      (-1 for a padding row and beyond the batch; it only locates a violation in the report).
    - ``write_num_valid_reqs`` int32 ``[1]``: the batch size.
    - ``verify_req_offsets`` int64 ``[req_capacity + 1]``: plan-internal scratch (per-request
      exclusive prefix sum of verify entries), read by the plan's entries stage only.
    """

    write_offsets: torch.Tensor
    write_seed_slot_indices: torch.Tensor
    write_req_to_token_rows: torch.Tensor
    write_num_valid_reqs: torch.Tensor
    verify_req_offsets: torch.Tensor

    def __post_init__(self):
        seeds = check_tensor(
            "WritePlan.write_seed_slot_indices",
            self.write_seed_slot_indices,
            dtypes=(torch.int64,),
            ndim=1,
        )
        cap = seeds.shape[0]
        check_tensor(
            "WritePlan.write_offsets", self.write_offsets, dtypes=(torch.int64,), shape=(cap + 1,)
        )
        check_tensor(
            "WritePlan.write_req_to_token_rows",
            self.write_req_to_token_rows,
            dtypes=(torch.int64,),
            shape=(cap,),
        )
        check_tensor(
            "WritePlan.verify_req_offsets",
            self.verify_req_offsets,
            dtypes=(torch.int64,),
            shape=(cap + 1,),
        )
        check_tensor(
            "WritePlan.write_num_valid_reqs",
            self.write_num_valid_reqs,
            dtypes=(torch.int32,),
            shape=(1,),
        )
        same_device({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def req_capacity(self) -> int:
        return self.write_seed_slot_indices.shape[0]

    @property
    def device(self) -> torch.device:
        return self.write_seed_slot_indices.device

    @classmethod
    def allocate(cls, *, write_req_capacity: int, device) -> "WritePlan":
        check_int("write_req_capacity", write_req_capacity, minimum=0)
        device = torch.device(device)
        return cls(
            write_offsets=torch.zeros(write_req_capacity + 1, dtype=torch.int64, device=device),
            write_seed_slot_indices=torch.full(
                (write_req_capacity,), -1, dtype=torch.int64, device=device
            ),
            write_req_to_token_rows=torch.full(
                (write_req_capacity,), -1, dtype=torch.int64, device=device
            ),
            write_num_valid_reqs=torch.zeros(1, dtype=torch.int32, device=device),
            verify_req_offsets=torch.zeros(
                write_req_capacity + 1, dtype=torch.int64, device=device
            ),
        )


# ---------------------------------------------------------------------------------------------
# Packed token-id uploads
# ---------------------------------------------------------------------------------------------

# A packed token-id upload (docs/architecture.md, "Token-id scatter"): one int64 buffer
# ``[PACKED_TOKENS_HEADER + PACKED_TOKENS_ROW_FIELDS * n + total]``. Word PACKED_TOKENS_NUM_REQS
# holds n; then one row of PACKED_TOKENS_ROW_FIELDS words per request: its whole history length
# (the plan's valid length), the first position sent and the offset of its segment in the
# flat part; then the flat part (the tokens sent, request after request).
PACKED_TOKENS_NUM_REQS = 0
PACKED_TOKENS_HEADER = 1
PACKED_TOKENS_ROW_LEN = 0
PACKED_TOKENS_ROW_START = 1
PACKED_TOKENS_ROW_OFFSET = 2
PACKED_TOKENS_ROW_FIELDS = 3


def packed_tokens_numel(num_reqs: int, num_tokens: int) -> int:
    """Words of a packed token-id upload of ``num_reqs`` requests and ``num_tokens`` tokens."""
    return PACKED_TOKENS_HEADER + PACKED_TOKENS_ROW_FIELDS * num_reqs + num_tokens


# ---------------------------------------------------------------------------------------------
# Per-layer (deep) fingerprints
# ---------------------------------------------------------------------------------------------

# One column descriptor in ``DeepFingerprintTable.descriptors`` (int64 words): the address of
# the column source's ``words_view``, its row stride in words, page size, words per token, the
# words a fingerprint in the table's mode folds, the column's sglang layer id and its half
# (DEEP_HALF_K / DEEP_HALF_V).
DEEP_DESC_PTR = 0
DEEP_DESC_ROW_STRIDE = 1
DEEP_DESC_PAGE_SIZE = 2
DEEP_DESC_WORDS_PER_TOKEN = 3
DEEP_DESC_NUM_WORDS = 4
DEEP_DESC_LAYER = 5
DEEP_DESC_HALF = 6
DEEP_DESC_WORDS = 7
DEEP_HALF_K = 0
DEEP_HALF_V = 1


@dataclasses.dataclass(frozen=True)
class DeepColumn:
    """One column of a :class:`DeepFingerprintTable`: the KV row of sglang layer ``layer_id``,
    half ``half``, of every slot (``source``, in the group's slot space)."""

    layer_id: int
    half: KvHalf
    source: RealKvSource


@dataclasses.dataclass(frozen=True, eq=False)
class DeepFingerprintTable:
    """Per-slot, per-(layer, half) real-KV fingerprints of one buffer group
    (``--kv-canary-real-data-layers all``; docs/architecture.md, "Per-layer fingerprints").

    - ``table``: int64 ``[num_slots, num_columns]``; ``table[s, c]`` is the fingerprint of slot
      ``s`` over ``columns[c].source`` alone (the record format's fingerprint with one source),
      taken when the slot was written.
    - ``columns``: the :class:`DeepColumn` of each column, layer-major (layer 0's K, layer 0's
      V, layer 1's K, ...); every source covers ``num_slots`` slots.
    - ``mode``: PARTIAL or ALL (as ``--kv-canary-real-data``).
    - ``columns_per_forward``: how many columns a forward's rotating check covers, a multiple
      of the halves per layer (whole layers), at most ``num_columns``.
    - ``descriptors``: int64 ``[num_columns, DEEP_DESC_WORDS]`` (device) built here;
      ``cursor``: int64 ``[1]`` (device), the first column of the next forward's window,
      counting up without wrapping (the kernels take it modulo ``num_columns``).
    """

    table: torch.Tensor
    columns: Tuple[DeepColumn, ...]
    mode: RealKvHashMode
    columns_per_forward: int
    descriptors: torch.Tensor = dataclasses.field(init=False, repr=False)
    cursor: torch.Tensor = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        columns = tuple(self.columns)
        object.__setattr__(self, "columns", columns)
        if not columns:
            raise ValueError("DeepFingerprintTable needs at least one column")
        for i, col in enumerate(columns):
            if not isinstance(col, DeepColumn):
                raise TypeError(
                    f"DeepFingerprintTable.columns[{i}] must be a DeepColumn, got "
                    f"{type(col).__name__}"
                )
        try:
            mode = RealKvHashMode(self.mode)
        except ValueError:
            raise ValueError(
                f"DeepFingerprintTable.mode must be PARTIAL or ALL, got {self.mode!r}"
            ) from None
        if mode == RealKvHashMode.NONE:
            raise ValueError("DeepFingerprintTable.mode must be PARTIAL or ALL, got NONE")
        object.__setattr__(self, "mode", mode)
        table = check_tensor(
            "DeepFingerprintTable.table",
            self.table,
            dtypes=(torch.int64,),
            shape=(None, len(columns)),
        )
        if not table.is_contiguous():
            raise ValueError("DeepFingerprintTable.table must be contiguous")
        for i, col in enumerate(columns):
            if col.source.num_slots < table.shape[0]:
                raise ValueError(
                    f"DeepFingerprintTable.columns[{i}] (layer {col.layer_id} "
                    f"{col.half.value}) covers {col.source.num_slots} slots but "
                    f"the table has {table.shape[0]}"
                )
        halves = self.halves_per_layer
        first_halves = [c.half for c in columns[:halves]]
        for i, col in enumerate(columns):
            if (
                col.half != first_halves[i % halves]
                or col.layer_id != columns[i - i % halves].layer_id
                or (i % halves == 0 and i and col.layer_id == columns[i - 1].layer_id)
            ):
                raise ValueError(
                    "DeepFingerprintTable.columns must be layer-major with the same halves, in "
                    f"the same order, for every layer; column {i} is layer {col.layer_id} "
                    f"{col.half.value}"
                )
        check_int("DeepFingerprintTable.columns_per_forward", self.columns_per_forward, minimum=1)
        if self.columns_per_forward % halves or self.columns_per_forward > len(columns):
            raise ValueError(
                f"DeepFingerprintTable.columns_per_forward must be a multiple of {halves} (whole "
                f"layers) and at most {len(columns)}, got {self.columns_per_forward}"
            )
        same_device(
            {
                "table": table,
                **{f"columns[{i}].source": c.source.tensor for i, c in enumerate(columns)},
            }
        )
        desc = [[0] * DEEP_DESC_WORDS for _ in columns]
        for row, c in zip(desc, columns):
            row[DEEP_DESC_PTR] = c.source.words_view.data_ptr()
            row[DEEP_DESC_ROW_STRIDE] = c.source.row_stride_words
            row[DEEP_DESC_PAGE_SIZE] = c.source.page_size
            row[DEEP_DESC_WORDS_PER_TOKEN] = c.source.num_words_per_token
            row[DEEP_DESC_NUM_WORDS] = c.source.words_to_fold(mode)
            row[DEEP_DESC_LAYER] = c.layer_id
            row[DEEP_DESC_HALF] = DEEP_HALF_K if c.half == KvHalf.K else DEEP_HALF_V
        object.__setattr__(
            self, "descriptors", torch.tensor(desc, dtype=torch.int64).to(table.device)
        )
        object.__setattr__(self, "cursor", torch.zeros(1, dtype=torch.int64, device=table.device))

    @property
    def num_slots(self) -> int:
        return self.table.shape[0]

    @property
    def num_columns(self) -> int:
        return len(self.columns)

    @property
    def halves_per_layer(self) -> int:
        """Columns per layer (2 with V rows, 1 for K-only pools such as MLA)."""
        first = self.columns[0].layer_id
        return sum(1 for c in self.columns if c.layer_id == first)

    @property
    def layers(self) -> Tuple[int, ...]:
        return tuple(dict.fromkeys(c.layer_id for c in self.columns))

    @property
    def forwards_per_rotation(self) -> int:
        """Forwards after which a slot read by each of them has had every column checked."""
        return -(-self.num_columns // self.columns_per_forward)

    @property
    def device(self) -> torch.device:
        return self.table.device

    @classmethod
    def allocate(
        cls, *, num_slots: int, columns, mode: RealKvHashMode, layers_per_forward: int, device
    ) -> "DeepFingerprintTable":
        """A zeroed table for ``columns``; ``layers_per_forward`` whole layers per forward
        (clamped to the layer count)."""
        columns = tuple(columns)
        check_int("layers_per_forward", layers_per_forward, minimum=1)
        if not columns:
            raise ValueError("DeepFingerprintTable needs at least one column")
        first = columns[0].layer_id
        halves = sum(1 for c in columns if c.layer_id == first)
        num_layers = len(columns) // halves
        return cls(
            table=torch.zeros(
                num_slots, len(columns), dtype=torch.int64, device=torch.device(device)
            ),
            columns=columns,
            mode=mode,
            columns_per_forward=min(layers_per_forward, num_layers) * halves,
        )
