"""The one place that turns (groups, endpoints, a forward batch) into kernel launches.

Everything here is graph-safe: launches on static buffers, no allocation, no host sync.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Tuple

import torch

from sglang.jit_kernel.kv_canary.plan import launch_canary_plan_kernels
from sglang.jit_kernel.kv_canary.verify import (
    CanaryPhase,
    PoolKind,
    VerifyPlan,
    launch_canary_verify_kernel,
)
from sglang.jit_kernel.kv_canary.write import WritePlan, launch_canary_write_kernel
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities
from sglang.srt.kv_canary.endpoint import CanaryEndpoint


@dataclasses.dataclass(frozen=True, eq=False)
class GroupPlans:
    """Per-group, per-forward plan buffers (allocated once per single-forward manager).

    ``write_slots`` (SWA groups only): ``[write_entry_capacity]`` (the table's dtype) holding
    ``out_cache_loc`` translated through the group's table before the write.
    """

    group: CanaryBufferGroup
    verify_plan: VerifyPlan
    write_plan: WritePlan
    write_slots: Optional[torch.Tensor]

    @classmethod
    def allocate(cls, group: CanaryBufferGroup, capacities: CanaryLaunchCapacities,
                 device) -> "GroupPlans":
        slots = None
        if group.kind == PoolKind.SWA:
            slots = torch.zeros(capacities.write_entry_capacity, dtype=group.swa_index_lut.dtype,
                                device=device)
        return cls(
            group=group,
            verify_plan=VerifyPlan.allocate(verify_capacity=capacities.verify_capacity,
                                            device=device),
            write_plan=WritePlan.allocate(write_req_capacity=capacities.write_req_capacity,
                                          device=device),
            write_slots=slots,
        )


def launch_group_plan(plans: GroupPlans, *, req_pool_indices, prefix_lens, extend_seq_lens,
                      req_to_token, expected_tokens, expected_valid_lens) -> None:
    """Plan one group's verify entries and write layout for this forward."""
    group = plans.group
    launch_canary_plan_kernels(
        verify_plan_out=plans.verify_plan,
        write_plan_out=plans.write_plan,
        req_pool_indices=req_pool_indices,
        prefix_lens=prefix_lens,
        extend_seq_lens=extend_seq_lens,
        req_to_token=req_to_token,
        swa_window_size=group.swa_window_size,
        full_to_swa_index_mapping=group.swa_index_lut,
        verify_capacity=plans.verify_plan.capacity,
        req_to_verify_expected_tokens=expected_tokens,
        req_to_verify_expected_tokens_valid_lens=(expected_valid_lens
                                                  if expected_tokens is not None else None),
        kv_token_id_vs_position_offset=group.kv_token_id_vs_position_offset,
    )


def write_slots_for(plans: GroupPlans, out_cache_loc: torch.Tensor) -> torch.Tensor:
    """The slots the write kernel stores to: ``out_cache_loc`` itself for FULL groups, its
    translation through the SWA table (into the static buffer) for SWA groups."""
    if plans.write_slots is None:
        return out_cache_loc
    out = plans.write_slots[: out_cache_loc.shape[0]]
    torch.index_select(plans.group.swa_index_lut, 0, out_cache_loc, out=out)
    return out


def launch_phase(endpoints: Iterable[CanaryEndpoint], phase: CanaryPhase, *,
                 plans_by_group, input_ids, positions, out_cache_loc,
                 check_verify_expected_token: bool,
                 expected_inputs: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """For every endpoint of ``phase`` (HEAD or TAIL): verify its group's plan, then write."""
    for ep in endpoints:
        if ep.phase != phase:
            continue
        plans = plans_by_group[id(ep.group)]
        launch_canary_verify_kernel(context=ep.context, plan=plans.verify_plan,
                                    check_verify_expected_token=check_verify_expected_token)
        launch_canary_write_kernel(
            context=ep.context, plan=plans.write_plan, input_ids=input_ids,
            positions=positions, out_cache_loc=write_slots_for(plans, out_cache_loc),
            enable_write_input_assert=expected_inputs is not None,
            expected_input_tokens=expected_inputs[0] if expected_inputs is not None else None,
            expected_input_positions=expected_inputs[1] if expected_inputs is not None else None,
        )
