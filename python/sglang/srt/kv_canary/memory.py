"""The canary's memory, by part, for one guarded pool (docs/user_guide.md, "Memory").

One formula, :meth:`CanaryMemory.for_inputs`, from a typed description of what the canary
will allocate (:class:`CanaryMemoryInputs`: its buffer groups' geometry, the capacities, the
``req_to_token`` shape, which checks are on). Two callers: the KV-pool sizing hook
(``memory_budget.reserve_canary_memory``, before sglang sizes the pool, with the geometry the pool will
get), and the builder (after the canary is built, with the geometry it got: the figure of the
start-up line, ``/server_info`` and ``sglang:kv_canary_memory_bytes``). The CPU tests sum the
tensors a built canary holds and compare them with this, part by part.

Counted: every tensor the canary keeps for the server's life. Not counted: the short-lived
tensors of a radix sweep's walk and of abort mode's containment (they come and go beside
sglang's own activations, in the memory ``--mem-fraction-static`` leaves free), CUDA streams
and events.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, Tuple

from sglang.jit_kernel.kv_canary.consts import STAGE_TABLE_NUMEL, VIOLATION_NUM_FIELDS
from sglang.jit_kernel.kv_canary.types import (
    CANARY_SLOT_BYTES,
    NUM_CANARY_LAUNCH_TAGS,
    CanaryPhase,
    PoolKind,
)
from sglang.jit_kernel.kv_canary.consts import (
    DEEP_DESC_WORDS,
    REAL_KV_DESC_WORDS,
    REAL_KV_MAX_SOURCES,
    packed_tokens_numel,
)
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.capacities import (
    REPLAY_TOKENS_PER_REQUEST,
    SNAPSHOT_HOST_BUFFERS,
    SWEEP_CHUNK_CAPACITY,
    CanaryLaunchCapacities,
)

_I64 = 8
_I32 = 4
# VerifyPlan: five int64 entry arrays, plus its int32 count and enable flag
_VERIFY_PLAN_ARRAYS = 5
# PlanInput: prefix_lens, extend_seq_lens, req_pool_indices and its constant fill of ones
_PLAN_INPUT_ARRAYS = 4
# PlanInput's lanes (a draft runner with topk > 1): per row its request, whether it is a later
# lane, its req_to_token row, its valid length, its request's committed length (int64), and
# PlanLanes' three arrays; at page size > 1 also each row's k * page_size
_PLAN_LANE_ARRAYS = 8
# EagerForwardGraphs (CUDA only): input_ids, positions, out_cache_loc on the device; its two
# staging tables in pinned host memory (the staging kernel reads them in place)
_EAGER_GRAPH_ARRAYS = 3
_STAGE_TABLE_BYTES = STAGE_TABLE_NUMEL * _I64
# a launch context's real-KV source descriptors (one context per phase and half of a group)
_CONTEXT_DESCRIPTOR_BYTES = REAL_KV_MAX_SOURCES * REAL_KV_DESC_WORDS * _I64


class MemoryPart(enum.Enum):
    """What a byte is for (the ``part`` label of ``sglang:kv_canary_memory_bytes``)."""

    # the 32-byte HEAD / TAIL records, per KV slot, and the launch contexts over them
    RECORDS = "records"
    LAYER_FINGERPRINTS = "layer_fingerprints"  # --kv-canary-real-data-layers all, per slot
    PLANS = "plans"  # each forward's verify and write plans (verify: 3x the pool's slots)
    FORWARD_INPUTS = "forward_inputs"  # each forward's static launch inputs
    TOKEN_TABLE = "token_table"  # token checks: expected token ids, req_to_token's shape
    SWEEP = "sweep"  # --kv-canary-sweep-interval: the sweep's verify plan
    READBACK = "readback"  # violation ring, counters, their staging and host copies
    HOST_MIRROR = "host_mirror"  # HiCache: the records of the host tier's slots (host memory)


@dataclasses.dataclass(frozen=True)
class GroupGeometry:
    """One buffer group as allocated: ``slots`` record rows, ``record_halves`` (1: K, 2: K and
    V records), ``layer_columns`` (per-layer fingerprint columns, 0 without
    ``--kv-canary-real-data-layers all``), ``swa_lut_itemsize`` (SWA groups: bytes per entry of
    the full-to-SWA table, the dtype of the group's write-slot buffer; 0 otherwise)."""

    kind: PoolKind
    slots: int
    record_halves: int = 1
    layer_columns: int = 0
    swa_lut_itemsize: int = 0

    def __post_init__(self):
        _check_count("GroupGeometry.slots", self.slots, minimum=1)
        if self.record_halves not in (1, 2):
            raise ValueError(
                f"GroupGeometry.record_halves must be 1 or 2, got {self.record_halves!r}"
            )
        _check_count("GroupGeometry.layer_columns", self.layer_columns, minimum=0)
        if (self.kind == PoolKind.SWA) != (self.swa_lut_itemsize > 0):
            raise ValueError(
                "GroupGeometry.swa_lut_itemsize is > 0 exactly for SWA groups, got "
                f"{self.swa_lut_itemsize!r} for a {self.kind.name} group"
            )

    @classmethod
    def of(cls, group: CanaryBufferGroup) -> "GroupGeometry":
        """The geometry of a built group."""
        lut = group.swa_index_lut
        return cls(
            kind=group.kind,
            slots=group.num_slots,
            record_halves=2 if group.has_v else 1,
            layer_columns=group.deep.num_columns if group.deep is not None else 0,
            swa_lut_itemsize=(
                lut.element_size() if group.kind == PoolKind.SWA and lut is not None else 0
            ),
        )


@dataclasses.dataclass(frozen=True)
class CanaryMemoryInputs:
    """What the canary of one model runner allocates, as plain values (the builder reads them
    off its config; the sizing hook predicts them). ``single_forward_managers``: 1, or an
    EAGLE draft runner's forwards per round; ``host_mirror_slots``: HiCache host slots (0
    without HiCache)."""

    groups: Tuple[GroupGeometry, ...]
    capacities: CanaryLaunchCapacities
    req_to_token_shape: Tuple[int, int]
    single_forward_managers: int = 1
    ring_capacity: int = 1024
    token_checks: bool = False
    write_input_check: bool = False
    sweep: bool = False
    swa_divergence_stats: bool = False
    cuda: bool = True
    host_mirror_slots: int = 0
    # draft trees (docs/speculative_trees.md): a draft runner's lane buffers, a target
    # runner's parent table
    plan_lanes: bool = False
    verify_trees: bool = False
    # the lanes at --page-size > 1 (their per-row page stride)
    plan_lane_pages: bool = False

    def __post_init__(self):
        if not self.groups:
            raise ValueError("CanaryMemoryInputs.groups needs at least one group")
        if len(self.req_to_token_shape) != 2:
            raise ValueError(
                f"CanaryMemoryInputs.req_to_token_shape must be (rows, columns), "
                f"got {self.req_to_token_shape!r}"
            )
        for name, v in (
            ("req_to_token_shape", self.req_to_token_shape[0]),
            ("req_to_token_shape", self.req_to_token_shape[1]),
            ("single_forward_managers", self.single_forward_managers),
            ("ring_capacity", self.ring_capacity),
        ):
            _check_count(f"CanaryMemoryInputs.{name}", v, minimum=1)
        _check_count("CanaryMemoryInputs.host_mirror_slots", self.host_mirror_slots, minimum=0)
        if self.plan_lane_pages and not self.plan_lanes:
            raise ValueError("CanaryMemoryInputs.plan_lane_pages needs plan_lanes (paged lanes)")


@dataclasses.dataclass(frozen=True)
class CanaryMemory:
    """Bytes by part: ``device`` (the GPU's, or the CPU's on a CPU server) and ``host``
    (pinned on CUDA). Parts absent from a mapping hold nothing."""

    device: Tuple[Tuple[MemoryPart, int], ...]
    host: Tuple[Tuple[MemoryPart, int], ...]

    @property
    def device_bytes(self) -> int:
        return sum(n for _, n in self.device)

    @property
    def host_bytes(self) -> int:
        return sum(n for _, n in self.host)

    def as_dict(self) -> Dict[str, Dict[str, int]]:
        """``{"device": {part: bytes}, "host": {...}}`` plus totals (``/server_info``)."""
        return {
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "device": {p.value: n for p, n in self.device},
            "host": {p.value: n for p, n in self.host},
        }

    def describe(self) -> str:
        """One line: totals and the parts, largest first, in MiB."""

        def parts(items):
            return ", ".join(
                f"{p.value} {format_bytes(n)}" for p, n in sorted(items, key=lambda x: -x[1])
            )

        text = f"device {format_bytes(self.device_bytes)} ({parts(self.device)})"
        if self.host:
            text += f"; host {format_bytes(self.host_bytes)} ({parts(self.host)})"
        return text

    @classmethod
    def for_inputs(cls, inputs: CanaryMemoryInputs) -> "CanaryMemory":
        caps = inputs.capacities
        reqs, entries = caps.write_req_capacity, caps.write_entry_capacity
        groups = inputs.groups
        device: Dict[MemoryPart, int] = {}
        host: Dict[MemoryPart, int] = {}

        def add(where, part, n):
            if n:
                where[part] = where.get(part, 0) + n

        for g in groups:
            add(device, MemoryPart.RECORDS, 2 * g.record_halves * g.slots * CANARY_SLOT_BYTES)
            contexts = len(CanaryPhase) * g.record_halves  # a launch context per phase and half
            add(device, MemoryPart.RECORDS, contexts * _CONTEXT_DESCRIPTOR_BYTES)
            if g.layer_columns:
                add(
                    device,
                    MemoryPart.LAYER_FINGERPRINTS,
                    g.slots * g.layer_columns * _I64  # the table
                    + g.layer_columns * DEEP_DESC_WORDS * _I64  # its column descriptors
                    + _I64,
                )  # the rotation cursor
        for _ in range(inputs.single_forward_managers):
            for g in groups:
                add(
                    device,
                    MemoryPart.PLANS,
                    _verify_plan_bytes(caps.verify_capacity)
                    + _write_plan_bytes(reqs)
                    + entries * g.swa_lut_itemsize,
                )
            add(
                device,
                MemoryPart.FORWARD_INPUTS,
                _PLAN_INPUT_ARRAYS * reqs * _I64  # PlanInput
                + reqs * _I64  # expected_valid_lens
                + len(groups) * _I32  # plan_enabled
                + entries * _I64  # forward_slots
                + (2 * entries * _I64 if inputs.write_input_check else 0)  # ExpectedInputs
                + (_EAGER_GRAPH_ARRAYS * entries * _I64 if inputs.cuda else 0)
                + (_PLAN_LANE_ARRAYS * reqs * _I64 if inputs.plan_lanes else 0)
                + (reqs * _I64 if inputs.plan_lane_pages else 0)
                + (entries * _I64 if inputs.verify_trees else 0),  # WriteTree.parent
            )
            if inputs.cuda:
                add(host, MemoryPart.FORWARD_INPUTS, 2 * _STAGE_TABLE_BYTES)
        if inputs.token_checks:
            rows, cols = inputs.req_to_token_shape
            replay = packed_tokens_numel(reqs, max(REPLAY_TOKENS_PER_REQUEST * reqs, entries))
            add(device, MemoryPart.TOKEN_TABLE, rows * cols * _I32 + replay * _I64)
            # the empty upload's header and the snapshots' reused host buffers
            add(host, MemoryPart.TOKEN_TABLE, _I64 + SNAPSHOT_HOST_BUFFERS * replay * _I64)
        if inputs.sweep:
            add(device, MemoryPart.SWEEP, _verify_plan_bytes(SWEEP_CHUNK_CAPACITY))
        counters = 2 * NUM_CANARY_LAUNCH_TAGS * _I64
        ring = inputs.ring_capacity * VIOLATION_NUM_FIELDS * _I64
        # what the read-back copies: ring, its index, counters, each forward's plan flags
        # (and, with SWA divergence stats, each plan's verify count)
        copied = (
            ring
            + _I32
            + counters
            + inputs.single_forward_managers
            * len(groups)
            * (_I32 + (_I32 if inputs.swa_divergence_stats else 0))
        )
        add(
            device,
            MemoryPart.READBACK,
            ring
            + _I32
            + counters
            + _I32  # + chain flag
            + (copied if inputs.cuda else 0),
        )  # the device staging buffer
        add(host, MemoryPart.READBACK, 2 * copied)  # double-buffered host copies
        add(
            host,
            MemoryPart.HOST_MIRROR,
            inputs.host_mirror_slots * host_mirror_bytes_per_slot(groups),
        )
        order = list(MemoryPart)
        return cls(
            device=tuple(sorted(device.items(), key=lambda kv: order.index(kv[0]))),
            host=tuple(sorted(host.items(), key=lambda kv: order.index(kv[0]))),
        )


def host_mirror_bytes_per_slot(groups: Tuple[GroupGeometry, ...]) -> int:
    """Bytes HiCache's host tier keeps per host slot beside its KV: every group's records
    and per-layer fingerprints (``runner.hicache.HostTierMirror``)."""
    return sum(2 * g.record_halves * CANARY_SLOT_BYTES + g.layer_columns * _I64 for g in groups)


def _verify_plan_bytes(capacity: int) -> int:
    return _VERIFY_PLAN_ARRAYS * capacity * _I64 + 2 * _I32


def _write_plan_bytes(reqs: int) -> int:
    # write_offsets and verify_req_offsets [reqs + 1], seed slots and rows [reqs], a count
    return 2 * (reqs + 1) * _I64 + 2 * reqs * _I64 + _I32


def format_bytes(n: int) -> str:
    """``n`` bytes in MiB (KiB below one MiB), for the start-up lines."""
    return f"{n / (1 << 20):.1f} MiB" if abs(n) >= 1 << 20 else f"{n / (1 << 10):.1f} KiB"


def _check_count(name: str, v, *, minimum: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
