"""Device-side canary state shared by every launch of one model runner (docs/architecture.md,
"Record format")."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from sglang.jit_kernel.kv_canary.consts import VIOLATION_NUM_FIELDS
from sglang.jit_kernel.kv_canary.types import NUM_CANARY_LAUNCH_TAGS, CanaryLaunchTag


@dataclasses.dataclass(frozen=True, eq=False)
class ViolationLog:
    """Ring of violation rows: int64 ``[ring_capacity, VIOLATION_NUM_FIELDS]`` + int32 ``[1]``
    write index.

    Kernels append with an atomic increment of the index; rows past the capacity are dropped
    but still counted. The runner empties it (index back to 0, in stream order) after staging
    each forward's read-back, so it fills once per forward window: row 0 is the window's first
    violation, and a window that overflows never blinds a later one.
    """

    violation_ring: torch.Tensor
    violation_write_index: torch.Tensor

    @classmethod
    def allocate(cls, *, ring_capacity: int, device) -> "ViolationLog":
        if ring_capacity < 1:
            raise ValueError(f"ring_capacity must be >= 1, got {ring_capacity}")
        return cls(
            violation_ring=torch.zeros(
                ring_capacity, VIOLATION_NUM_FIELDS, dtype=torch.int64, device=device
            ),
            violation_write_index=torch.zeros(1, dtype=torch.int32, device=device),
        )

    @property
    def ring_capacity(self) -> int:
        return self.violation_ring.shape[0]


@dataclasses.dataclass(frozen=True, eq=False)
class CanaryDeviceState:
    """The violation log, per-tag counters, the chain-position flag and the expected-token pool.

    - ``kernel_run_counters`` / ``slot_run_counters``: int64 ``[12]``, indexed by
      :class:`CanaryLaunchTag`; launches get ``[1]`` views (:meth:`counters_for`).
    - ``enable_chain_position_assert``: int32 ``[1]``; 0 during warm-up and graph capture (dummy
      batches carry arbitrary positions), 1 after :meth:`mark_init_finished`.
    - ``req_to_verify_expected_tokens``: optional int32 ``[req_to_token rows, max_context_len]``.
    """

    violation_log: ViolationLog
    kernel_run_counters: torch.Tensor
    slot_run_counters: torch.Tensor
    enable_chain_position_assert: torch.Tensor
    req_to_verify_expected_tokens: Optional[torch.Tensor] = None

    @classmethod
    def allocate(
        cls,
        *,
        ring_capacity: int,
        device,
        expected_token_pool_shape: Optional[Tuple[int, int]] = None,
    ) -> "CanaryDeviceState":
        device = torch.device(device)
        pool = None
        if expected_token_pool_shape is not None:
            pool = torch.full(
                tuple(expected_token_pool_shape), -1, dtype=torch.int32, device=device
            )
        return cls(
            violation_log=ViolationLog.allocate(ring_capacity=ring_capacity, device=device),
            kernel_run_counters=torch.zeros(
                NUM_CANARY_LAUNCH_TAGS, dtype=torch.int64, device=device
            ),
            slot_run_counters=torch.zeros(NUM_CANARY_LAUNCH_TAGS, dtype=torch.int64, device=device),
            enable_chain_position_assert=torch.zeros(1, dtype=torch.int32, device=device),
            req_to_verify_expected_tokens=pool,
        )

    @property
    def device(self) -> torch.device:
        return self.kernel_run_counters.device

    def counters_for(self, tag: CanaryLaunchTag) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(slot_run_counter, kernel_run_counter)``: ``[1]`` views for launches of ``tag``."""
        i = int(tag)
        return self.slot_run_counters[i : i + 1], self.kernel_run_counters[i : i + 1]

    def mark_init_finished(self) -> None:
        """Turn the write kernel's chain-position check on (end of warm-up / graph capture)."""
        self.set_chain_position_assert(True)

    def set_chain_position_assert(self, on: bool) -> None:
        """The chain-position flag (a fill on the current stream; never inside a capture)."""
        self.enable_chain_position_assert.fill_(1 if on else 0)
