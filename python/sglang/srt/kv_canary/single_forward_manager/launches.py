"""The plan / verify / write launches of one forward (called only by the single-forward
manager; the radix sweep and the token-history upload launch their own kernels).

Everything here is graph-safe: launches on static buffers, no allocation, no host sync.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from sglang.jit_kernel.kv_canary.deep import (
    launch_deep_fingerprint_verify,
    launch_deep_fingerprint_write,
)
from sglang.jit_kernel.kv_canary.plan import launch_canary_plan_kernels
from sglang.jit_kernel.kv_canary.types import (
    CanaryLaunchTag,
    CanaryPhase,
    KvHalf,
    PlanLanes,
    PoolKind,
    VerifyPlan,
    WriteParts,
    WritePlan,
    WriteTree,
)
from sglang.jit_kernel.kv_canary.verify import launch_canary_verify_kernel
from sglang.jit_kernel.kv_canary.write import (
    launch_canary_chain_writes,
    launch_canary_write_kernel,
)
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities
from sglang.srt.kv_canary.endpoint import CanaryEndpoint


@dataclasses.dataclass(frozen=True, eq=False)
class ForwardLaunchInputs:
    """What one forward's launches read of the batch (the single-forward manager's
    ``_side_launches`` / ``_tail_launches``):

    - ``req_pool_indices`` / ``prefix_lens`` / ``extend_seq_lens``: int32/int64 ``[bs]`` (the
      plan input; ``req_pool_indices`` 0 marks a padding row);
    - ``input_ids`` / ``positions`` / ``out_cache_loc``: int32/int64 ``[num_tokens]``, laid out
      as the plan's write offsets say (``out_cache_loc`` contiguous);
    - ``expected_inputs``: the write-input check's expected tokens and positions
      ``[num_tokens]`` each (None with the check off);
    - ``lanes``: a draft round's forward with ``--speculative-eagle-topk`` > 1 (its rows are
      lanes: :class:`PlanLanes`), else None; ``tree``: a target verify of draft trees (the
      write follows each node's path: :class:`WriteTree`), else None.

    Either the batch's own tensors (eager without graphs, and inside sglang's captures) or
    static buffers of the canary's capacities (:class:`EagerForwardGraphs`)."""

    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    expected_inputs: Optional[Tuple[torch.Tensor, torch.Tensor]]
    lanes: Optional[PlanLanes] = None
    tree: Optional[WriteTree] = None


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
    def allocate(
        cls, group: CanaryBufferGroup, capacities: CanaryLaunchCapacities, device
    ) -> "GroupPlans":
        slots = None
        if group.kind == PoolKind.SWA:
            slots = torch.zeros(
                capacities.write_entry_capacity, dtype=group.swa_index_lut.dtype, device=device
            )
        return cls(
            group=group,
            verify_plan=VerifyPlan.allocate(
                verify_capacity=capacities.verify_capacity, device=device
            ),
            write_plan=WritePlan.allocate(
                write_req_capacity=capacities.write_req_capacity, device=device
            ),
            write_slots=slots,
        )


def launch_group_plan(
    plans: GroupPlans,
    *,
    req_pool_indices,
    prefix_lens,
    extend_seq_lens,
    req_to_token,
    expected_tokens,
    expected_valid_lens,
    lanes: Optional[PlanLanes] = None,
) -> None:
    """Plan one group's verify entries and write layout for this forward (``lanes``: a
    draft round's lane rows)."""
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
        req_to_verify_expected_tokens_valid_lens=(
            expected_valid_lens if expected_tokens is not None else None
        ),
        kv_token_id_vs_position_offset=group.kv_token_id_vs_position_offset,
        lanes=lanes,
    )


def write_slots_for(plans: GroupPlans, out_cache_loc: torch.Tensor) -> torch.Tensor:
    """The slots the write kernel stores to: ``out_cache_loc`` itself for FULL groups, its
    translation through the SWA table (into the static buffer) for SWA groups."""
    out = translated_slots(plans, out_cache_loc)
    if plans.write_slots is not None:
        torch.index_select(plans.group.swa_index_lut, 0, out_cache_loc, out=out)
    return out


def translated_slots(plans: GroupPlans, out_cache_loc: torch.Tensor) -> torch.Tensor:
    """The view :func:`write_slots_for` fills (without filling it again)."""
    if plans.write_slots is None:
        return out_cache_loc
    return plans.write_slots[: out_cache_loc.shape[0]]


PlansByGroup = Mapping[CanaryBufferGroup, GroupPlans]


def launch_verifies(
    endpoints: Iterable[CanaryEndpoint],
    phase: CanaryPhase,
    *,
    plans_by_group: PlansByGroup,
    check_verify_expected_token: bool,
) -> None:
    """Verify launch of every endpoint of ``phase`` (HEAD or TAIL), on its group's plan."""
    for ep in endpoints:
        if ep.phase == phase:
            launch_canary_verify_kernel(
                context=ep.context,
                plan=plans_by_group[ep.group].verify_plan,
                check_verify_expected_token=check_verify_expected_token,
            )


def chain_write_launches(
    endpoints: Iterable[CanaryEndpoint],
    *,
    plans_by_group: PlansByGroup,
    input_ids,
    positions,
    out_cache_loc,
    expected_inputs: Optional[Tuple[torch.Tensor, torch.Tensor]],
    tree: Optional[WriteTree] = None,
) -> List[Callable[[], None]]:
    """The HEAD writes and the TAIL writes' chain part of every group, one callable per group
    (its buffers' chains walked side by side in one launch), independent of one another, to
    run in any order or side by side. A HEAD write is its chain part (HEAD never
    fingerprints). SWA groups' slots are translated now, on the current stream. ``tree``: a
    target verify of draft trees (each node chained from its path)."""
    by_group: Dict[CanaryBufferGroup, List[CanaryEndpoint]] = {}
    for ep in endpoints:
        if ep.phase in (CanaryPhase.HEAD, CanaryPhase.TAIL):
            if ep.phase == CanaryPhase.HEAD and ep.context.fingerprint_mode:
                raise RuntimeError(
                    f"kv_canary: HEAD endpoint {ep.tag.name} fingerprints; "
                    "HEAD writes are chain-only"
                )
            by_group.setdefault(ep.group, []).append(ep)
    launches = []
    for group, eps in by_group.items():
        plans = plans_by_group[group]
        launches.append(
            functools.partial(
                launch_canary_chain_writes,
                contexts=[ep.context for ep in eps],
                plan=plans.write_plan,
                input_ids=input_ids,
                positions=positions,
                out_cache_loc=write_slots_for(plans, out_cache_loc),
                enable_write_input_assert=expected_inputs is not None,
                expected_input_tokens=expected_inputs[0] if expected_inputs is not None else None,
                expected_input_positions=expected_inputs[1]
                if expected_inputs is not None
                else None,
                tree=tree,
            )
        )
    return launches


def launch_fingerprint_writes(
    endpoints: Iterable[CanaryEndpoint],
    *,
    plans_by_group: PlansByGroup,
    input_ids,
    positions,
    out_cache_loc,
) -> None:
    """The TAIL writes' fingerprint part (:attr:`WriteParts.FINGERPRINT`) of every TAIL
    endpoint with real-data fingerprints, after the model wrote the KV bytes and after
    :func:`chain_write_launches` (which translated SWA groups' slots: read here as
    :func:`translated_slots`). Endpoints without fingerprints launch nothing."""
    for ep in endpoints:
        if ep.phase != CanaryPhase.TAIL or not ep.context.fingerprint_mode:
            continue
        plans = plans_by_group[ep.group]
        launch_canary_write_kernel(
            context=ep.context,
            plan=plans.write_plan,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=translated_slots(plans, out_cache_loc),
            parts=WriteParts.FINGERPRINT,
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )


def launch_deep_verify(ep: CanaryEndpoint, plan: VerifyPlan, *, rotate: bool) -> None:
    """Per-layer fingerprint check of ``plan``'s slots for ``ep``'s group (a no-op without a
    table; called for the group's K endpoint of the phase: one launch covers both halves):
    the forward's rotating window (``rotate``) or every layer (the sweep)."""
    group = ep.group
    if group.deep is None or ep.half != KvHalf.K:
        return
    launch_deep_fingerprint_verify(
        table=group.deep,
        plan=plan,
        canary_buf=ep.context.canary_buf,
        violation_ring=ep.context.violation_ring,
        violation_write_index=ep.context.violation_write_index,
        tag_k=ep.tag,
        tag_v=CanaryLaunchTag.of(ep.phase, KvHalf.V, group.kind),
        rotate=rotate,
    )


def launch_deep_verifies(
    endpoints: Iterable[CanaryEndpoint], phase: CanaryPhase, *, plans_by_group: PlansByGroup
) -> None:
    """The forward's rotating per-layer check of every group with a table, on its plan."""
    for ep in endpoints:
        if ep.phase == phase:
            launch_deep_verify(ep, plans_by_group[ep.group].verify_plan, rotate=True)


def launch_deep_writes(plans_by_group: PlansByGroup, out_cache_loc: torch.Tensor) -> None:
    """Every layer's fingerprint of the slots this forward wrote, for every group with a
    table (SWA groups: the slots the write translated, :func:`translated_slots`)."""
    for group, plans in plans_by_group.items():
        if group.deep is not None:
            launch_deep_fingerprint_write(
                table=group.deep,
                plan=plans.write_plan,
                out_cache_loc=translated_slots(plans, out_cache_loc),
            )
