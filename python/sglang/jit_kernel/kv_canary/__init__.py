"""KV-canary device kernels (Triton) and their torch references.

Public API (docs/architecture.md, "Kernel rules"); every launcher takes keyword arguments only
and dispatches CUDA tensors to Triton, CPU tensors to the torch reference (or to Triton's
interpreter under ``TRITON_INTERPRET=1``).
"""

from sglang.jit_kernel.kv_canary.consts import (
    CANARY_CHAIN_ANCHOR,
    FailReason,
    RealKvHashMode,
    splitmix64,
    canary_chain_key,
    canary_chain_step,
)
from sglang.jit_kernel.kv_canary.plan import launch_canary_plan_kernels
from sglang.jit_kernel.kv_canary.plan_ref import launch_canary_plan_kernels_torch_reference
from sglang.jit_kernel.kv_canary.scatter_req_token_ids import (
    launch_scatter_packed_token_ids_kernel,
    launch_scatter_req_token_ids_kernel,
    scatter_packed_token_ids_torch_reference,
    scatter_req_token_ids_torch_reference,
)
from sglang.jit_kernel.kv_canary.types import (
    CANARY_SLOT_BYTES,
    CanaryLaunchTag,
    CanaryPhase,
    KvHalf,
    PoolKind,
    RealKvSource,
    VerifyOrWriteContext,
    PlanLanes,
    VerifyPlan,
    WriteParts,
    WritePlan,
    WriteTree,
)
from sglang.jit_kernel.kv_canary.verify import launch_canary_verify_kernel
from sglang.jit_kernel.kv_canary.verify_ref import launch_canary_verify_kernel_torch_reference
from sglang.jit_kernel.kv_canary.write import launch_canary_chain_writes, launch_canary_write_kernel
from sglang.jit_kernel.kv_canary.write_ref import launch_canary_write_kernel_torch_reference

__all__ = [
    "CANARY_CHAIN_ANCHOR",
    "CANARY_SLOT_BYTES",
    "CanaryLaunchTag",
    "CanaryPhase",
    "FailReason",
    "KvHalf",
    "PoolKind",
    "RealKvHashMode",
    "RealKvSource",
    "VerifyOrWriteContext",
    "PlanLanes",
    "VerifyPlan",
    "WriteParts",
    "WritePlan",
    "WriteTree",
    "launch_canary_plan_kernels",
    "launch_canary_plan_kernels_torch_reference",
    "launch_canary_verify_kernel",
    "launch_canary_verify_kernel_torch_reference",
    "launch_canary_chain_writes",
    "launch_canary_write_kernel",
    "launch_canary_write_kernel_torch_reference",
    "launch_scatter_packed_token_ids_kernel",
    "launch_scatter_req_token_ids_kernel",
    "scatter_packed_token_ids_torch_reference",
    "scatter_req_token_ids_torch_reference",
    "splitmix64",
    "canary_chain_key",
    "canary_chain_step",
]
