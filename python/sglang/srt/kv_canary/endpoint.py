"""``CanaryEndpoint``: one (buffer, half, phase) launch target with its ready-made context."""

from __future__ import annotations

import dataclasses
from typing import List

from sglang.jit_kernel.kv_canary.consts import RealKvHashMode
from sglang.jit_kernel.kv_canary.types import (
    CanaryLaunchTag,
    CanaryPhase,
    KvHalf,
    VerifyOrWriteContext,
)
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.state import CanaryDeviceState


@dataclasses.dataclass(frozen=True, eq=False)
class CanaryEndpoint:
    """A launch target: its tag (phase, half, pool kind), group and kernel context."""

    tag: CanaryLaunchTag
    group: CanaryBufferGroup
    context: VerifyOrWriteContext

    @property
    def phase(self) -> CanaryPhase:
        return self.tag.phase

    @property
    def half(self) -> KvHalf:
        return self.tag.half


def build_endpoints_from_group(
    *, group: CanaryBufferGroup, state: CanaryDeviceState, config: CanaryConfig
) -> List[CanaryEndpoint]:
    """HEAD / TAIL / SWEEP endpoints for the K half (and the V half when the group has V
    buffers). HEAD never fingerprints; TAIL and SWEEP use ``config.real_kv_hash_mode`` over
    the group's sources for that half; SWEEP verifies the TAIL buffers."""
    halves = [KvHalf.K] + ([KvHalf.V] if group.has_v else [])
    endpoints = []
    for half in halves:
        head, tail = (
            (group.k_head, group.k_tail) if half == KvHalf.K else (group.v_head, group.v_tail)
        )
        sources = group.real_kv_sources_k if half == KvHalf.K else group.real_kv_sources_v
        for phase in (CanaryPhase.HEAD, CanaryPhase.TAIL, CanaryPhase.SWEEP):
            tag = CanaryLaunchTag.of(phase, half, group.kind)
            fingerprint = phase != CanaryPhase.HEAD and config.real_kv_hash_mode and sources
            slot_counter, kernel_counter = state.counters_for(tag)
            endpoints.append(
                CanaryEndpoint(
                    tag=tag,
                    group=group,
                    context=VerifyOrWriteContext(
                        canary_buf=head if phase == CanaryPhase.HEAD else tail,
                        kernel_kind=tag,
                        violation_ring=state.violation_log.violation_ring,
                        violation_write_index=state.violation_log.violation_write_index,
                        slot_run_counter=slot_counter,
                        kernel_run_counter=kernel_counter,
                        real_kv_sources=tuple(sources) if fingerprint else (),
                        real_kv_hash_mode=config.real_kv_hash_mode
                        if fingerprint
                        else RealKvHashMode.NONE,
                        enable_chain_position_assert=state.enable_chain_position_assert,
                    ),
                )
            )
    return endpoints
