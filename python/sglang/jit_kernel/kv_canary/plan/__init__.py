"""Plan kernels: turn a batch's (req_pool_indices, prefix, extend) into verify / write plans."""

from sglang.jit_kernel.kv_canary.plan.api import launch_canary_plan_kernels

__all__ = ["launch_canary_plan_kernels"]
