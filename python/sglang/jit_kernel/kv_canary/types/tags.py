"""Launch tags and what they stand for: phase, KV half and pool kind of each launch, and
the record row's size (docs/architecture.md, "Record format"). No Triton."""

from __future__ import annotations

import enum


from sglang.jit_kernel.kv_canary.consts import (
    CANARY_FIELD_BYTES,
    CANARY_NUM_FIELDS,
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
