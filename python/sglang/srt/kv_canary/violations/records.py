"""Violation ring rows decoded once into typed records, and one forward window's records merged
into incidents (docs/architecture.md, "Record format"; docs/user_guide.md, "Reading a violation
report").

:meth:`ViolationRecord.from_row` is the one reader of the ring's columns
(``consts.VIOLATION_FIELD_*``); everything after the read-back (the line, the requests an
incident touches, abort mode's containment, the metrics) takes records. Host-side only.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from sglang.jit_kernel.kv_canary.consts import (
    HOST_TIER_ROW,
    NO_KV_LAYER,
    VIOLATION_FIELD_EXPECTED_AUX,
    VIOLATION_FIELD_EXPECTED_TOKEN,
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_KERNEL_KIND,
    VIOLATION_FIELD_KV_LAYER,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_READ_POSITION,
    VIOLATION_FIELD_REQ_TO_TOKEN_ROW,
    VIOLATION_FIELD_SLOT_IDX,
    VIOLATION_FIELD_STORED_CHAIN_HASH,
    VIOLATION_FIELD_STORED_TOKEN,
    VIOLATION_NUM_FIELDS,
)
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag, PoolKind


def tag_name(kind: int) -> str:
    """A launch tag's name (``UNKNOWN_<n>`` for a value that is none)."""
    try:
        return CanaryLaunchTag(kind).name
    except ValueError:
        return f"UNKNOWN_{kind}"


@dataclasses.dataclass(frozen=True)
class ViolationRecord:
    """One ring row: what a launch saw wrong with one slot. ``launch_tag`` is the raw tag value
    (a corrupted row may hold one that names no tag: :attr:`tag` is then None); the hashes are
    the ring's signed int64 values."""

    launch_tag: int
    slot_idx: int
    position: int  # the position the slot's record holds
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    fail_bits: int
    read_position: int  # the position attention read the slot for (a sweep: its depth)
    req_to_token_row: int  # NO_REQ_TO_TOKEN_ROW for a sweep, HOST_TIER_ROW for the host tier
    kv_layer: int = NO_KV_LAYER

    @classmethod
    def from_row(cls, row: Sequence[int]) -> "ViolationRecord":
        """Decode one ring row (``VIOLATION_NUM_FIELDS`` integers in the record format's
        order); a row of another width is refused."""
        if len(row) != VIOLATION_NUM_FIELDS:
            raise ValueError(
                f"a violation ring row has {VIOLATION_NUM_FIELDS} fields, got {len(row)}"
            )
        v = [int(x) for x in row]
        return cls(
            launch_tag=v[VIOLATION_FIELD_KERNEL_KIND],
            slot_idx=v[VIOLATION_FIELD_SLOT_IDX],
            position=v[VIOLATION_FIELD_POSITION],
            stored_token=v[VIOLATION_FIELD_STORED_TOKEN],
            expected_token=v[VIOLATION_FIELD_EXPECTED_TOKEN],
            stored_chain_hash=v[VIOLATION_FIELD_STORED_CHAIN_HASH],
            expected_aux=v[VIOLATION_FIELD_EXPECTED_AUX],
            fail_bits=v[VIOLATION_FIELD_FAIL_REASON_BITS],
            read_position=v[VIOLATION_FIELD_READ_POSITION],
            req_to_token_row=v[VIOLATION_FIELD_REQ_TO_TOKEN_ROW],
            kv_layer=v[VIOLATION_FIELD_KV_LAYER],
        )

    @property
    def tag(self) -> Optional[CanaryLaunchTag]:
        try:
            return CanaryLaunchTag(self.launch_tag)
        except ValueError:
            return None

    @property
    def tag_name(self) -> str:
        return tag_name(self.launch_tag)

    @property
    def pool_kind(self) -> Optional[PoolKind]:
        """The slot space of :attr:`slot_idx` (its tag's pool kind); None for an unknown tag."""
        tag = self.tag
        return tag.pool_kind if tag is not None else None

    @property
    def on_host_tier(self) -> bool:
        """A HiCache host-tier sweep's record: :attr:`slot_idx` is a host-pool index."""
        return self.req_to_token_row == HOST_TIER_ROW

    def incident_key(self) -> Tuple:
        """What makes two records one incident: the pool kind of the tag (FULL and SWA slots
        are different slot spaces), the slot, the read position and the ``req_to_token``
        row."""
        kind = self.pool_kind
        pool = kind.name if kind is not None else f"UNKNOWN_{self.launch_tag}"
        return (pool, self.slot_idx, self.read_position, self.req_to_token_row)


def decode_ring_rows(rows: Sequence[Sequence[int]]) -> List[ViolationRecord]:
    """The records of a host copy of ring rows (``ring[:kept].tolist()``), in order."""
    return [ViolationRecord.from_row(r) for r in rows]


@dataclasses.dataclass(frozen=True)
class ViolationIncident:
    """One corrupted slot as one forward window saw it: its first record, the union of every
    merged record's fail bits, the launch tags that saw it (first-seen first) and, once
    resolved, the requests it touches."""

    record: ViolationRecord
    fail_bits: int
    seen_by: Tuple[int, ...]
    rids: Tuple[str, ...] = ()
    rows: int = dataclasses.field(default=1, compare=False)  # ring rows merged into it

    @classmethod
    def of(cls, record: ViolationRecord) -> "ViolationIncident":
        """The incident of one record alone."""
        return cls(record=record, fail_bits=record.fail_bits, seen_by=(record.launch_tag,))


def merge_incidents(records: Sequence[ViolationRecord]) -> List[ViolationIncident]:
    """Group one forward window's records into incidents (:meth:`ViolationRecord.incident_key`),
    in order of first record."""
    first: Dict[Tuple, List] = {}
    for rec in records:
        key = rec.incident_key()
        entry = first.get(key)
        if entry is None:
            first[key] = [rec, rec.fail_bits, [rec.launch_tag], 1]
            continue
        entry[1] |= rec.fail_bits
        entry[3] += 1
        if rec.launch_tag not in entry[2]:
            entry[2].append(rec.launch_tag)
    return [
        ViolationIncident(record=r, fail_bits=b, seen_by=tuple(t), rows=n)
        for r, b, t, n in first.values()
    ]
