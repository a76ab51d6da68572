"""The kernels' launch context and real-KV sources (docs/architecture.md, "Record format").
No Triton."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from sglang.jit_kernel.kv_canary._checks import check_int, check_tensor, same_device
from sglang.jit_kernel.kv_canary.consts import (
    REAL_KV_DESC_NUM_WORDS,
    REAL_KV_DESC_PAGE_SIZE,
    REAL_KV_DESC_PTR,
    REAL_KV_DESC_ROW_STRIDE,
    REAL_KV_DESC_WORDS,
    REAL_KV_DESC_WORDS_PER_TOKEN,
    REAL_KV_MAX_SOURCES,
    REAL_KV_PARTIAL_BYTES,
    REAL_KV_WORD_BYTES,
    VIOLATION_NUM_FIELDS,
    RealKvHashMode,
)
from sglang.jit_kernel.kv_canary.types.tags import (
    NUM_CANARY_LAUNCH_TAGS,
    CANARY_SLOT_BYTES,
    CanaryLaunchTag,
)


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

    def descriptor(self, mode: RealKvHashMode) -> List[int]:
        """This source's ``REAL_KV_DESC_WORDS`` descriptor words for a fingerprint in
        ``mode`` (the kernels read the source through them)."""
        desc = [0] * REAL_KV_DESC_WORDS
        desc[REAL_KV_DESC_PTR] = self.words_view.data_ptr()
        desc[REAL_KV_DESC_ROW_STRIDE] = self.row_stride_words
        desc[REAL_KV_DESC_PAGE_SIZE] = self.page_size
        desc[REAL_KV_DESC_WORDS_PER_TOKEN] = self.num_words_per_token
        desc[REAL_KV_DESC_NUM_WORDS] = self.words_to_fold(mode)
        return desc


def _unused_source_descriptor() -> List[int]:
    """A descriptor row past a context's sources: never read (the kernels' source count is a
    constexpr); page size 1, nothing to fold."""
    desc = [0] * REAL_KV_DESC_WORDS
    desc[REAL_KV_DESC_PAGE_SIZE] = 1
    return desc


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

    Built here, once: ``canary_words`` (an int64 view of ``canary_buf``) and
    ``source_descriptors``, int64 ``[REAL_KV_MAX_SOURCES, REAL_KV_DESC_WORDS]`` on the
    context's device, row ``i`` the descriptor of ``real_kv_sources[i]`` in
    ``real_kv_hash_mode`` (``consts.REAL_KV_DESC_*``); the kernels read the sources through it.
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
    source_descriptors: torch.Tensor = dataclasses.field(init=False, repr=False)

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
        desc = [s.descriptor(mode) for s in sources]
        desc += [_unused_source_descriptor() for _ in range(REAL_KV_MAX_SOURCES - len(sources))]
        object.__setattr__(
            self, "source_descriptors", torch.tensor(desc, dtype=torch.int64).to(buf.device)
        )

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
