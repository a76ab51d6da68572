"""Host-side types of the KV-canary kernels (docs/architecture.md, "Record format" and "Plans"),
by job: launch tags (``tags``), the launch context and real-KV sources (``context``), the verify
and write plans (``plans``), the per-layer fingerprint table (``deep``). No Triton here (torch
only): the runtime, the validators and the torch references take their types from this package;
the kernel modules (``verify``, ``write``) re-export them for the documented import paths. The
record, packed-token and descriptor layouts are constants of ``consts``.
"""

from sglang.jit_kernel.kv_canary.types.tags import (
    CANARY_SLOT_BYTES,
    CanaryPhase,
    KvHalf,
    PoolKind,
    CanaryLaunchTag,
    NUM_CANARY_LAUNCH_TAGS,
)
from sglang.jit_kernel.kv_canary.types.context import (
    RealKvSource,
    VerifyOrWriteContext,
)
from sglang.jit_kernel.kv_canary.types.plans import (
    PlanLanes,
    VerifyPlan,
    WriteParts,
    WritePlan,
    WriteTree,
)
from sglang.jit_kernel.kv_canary.types.deep import (
    DeepColumn,
    DeepFingerprintTable,
)

__all__ = [
    "CANARY_SLOT_BYTES",
    "CanaryPhase",
    "KvHalf",
    "PoolKind",
    "CanaryLaunchTag",
    "NUM_CANARY_LAUNCH_TAGS",
    "RealKvSource",
    "VerifyOrWriteContext",
    "PlanLanes",
    "VerifyPlan",
    "WriteParts",
    "WritePlan",
    "WriteTree",
    "DeepColumn",
    "DeepFingerprintTable",
]
