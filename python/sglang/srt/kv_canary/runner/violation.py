"""Violation reporting: formatting ring rows, log/raise policy, and the per-step pump (SPEC §3)."""

from __future__ import annotations

import logging
from typing import Dict, List, Sequence

import torch

from sglang.jit_kernel.kv_canary.consts import (
    VIOLATION_FIELD_EXPECTED_AUX,
    VIOLATION_FIELD_EXPECTED_TOKEN,
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_KERNEL_KIND,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_SLOT_IDX,
    VIOLATION_FIELD_STORED_CHAIN_HASH,
    VIOLATION_FIELD_STORED_TOKEN,
    FailReason,
    to_uint64,
)
from sglang.jit_kernel.kv_canary.verify import CanaryLaunchTag
from sglang.srt.kv_canary.config import CanaryMode

logger = logging.getLogger(__name__)

VIOLATION_LINE_PREFIX = "kv_canary violation:"


def _tag_name(kind: int) -> str:
    try:
        return CanaryLaunchTag(kind).name
    except ValueError:
        return f"UNKNOWN_{kind}"


def format_violation_line(row: Sequence[int]) -> str:
    """The stable, grep-able one-line form of a ring row."""
    return (
        f"{VIOLATION_LINE_PREFIX} launch_tag={_tag_name(int(row[VIOLATION_FIELD_KERNEL_KIND]))} "
        f"fail_reason={FailReason.describe(int(row[VIOLATION_FIELD_FAIL_REASON_BITS]))} "
        f"slot_idx={int(row[VIOLATION_FIELD_SLOT_IDX])} "
        f"position={int(row[VIOLATION_FIELD_POSITION])} "
        f"stored_token={int(row[VIOLATION_FIELD_STORED_TOKEN])} "
        f"expected_token={int(row[VIOLATION_FIELD_EXPECTED_TOKEN])} "
        f"stored_chain_hash=0x{to_uint64(row[VIOLATION_FIELD_STORED_CHAIN_HASH]):016x} "
        f"expected_aux=0x{to_uint64(row[VIOLATION_FIELD_EXPECTED_AUX]):016x}"
    )


def format_violation_block(row: Sequence[int], step: int) -> str:
    """A human explanation of a ring row, printed after its structured line."""
    tag = _tag_name(int(row[VIOLATION_FIELD_KERNEL_KIND]))
    bits = int(row[VIOLATION_FIELD_FAIL_REASON_BITS])
    lines = [f"  KV slot {int(row[VIOLATION_FIELD_SLOT_IDX])} failed its canary check in launch "
             f"{tag} (reported at forward step {step}):"]
    explain = {
        FailReason.VERIFY_CHAIN_HASH_MISMATCH:
            "the record's prev_hash does not match its predecessor slot's record: the slot "
            "holds KV of another sequence, or req_to_token points at the wrong slot",
        FailReason.VERIFY_POSITION_MISMATCH:
            "the record holds a different sequence position than attention reads it for",
        FailReason.VERIFY_TOKEN_MISMATCH:
            "the record holds a different token than the request's own history",
        FailReason.VERIFY_REAL_KV_HASH_MISMATCH:
            "the KV bytes changed since they were written (corruption or a stale/overwritten "
            "slot)",
        FailReason.WRITE_TOKEN_MISMATCH: "the token written differs from the expected input",
        FailReason.WRITE_POSITION_MISMATCH:
            "the position written is not the expected one (expected position in expected_aux)",
    }
    for reason, text in explain.items():
        if bits & reason:
            lines.append(f"    - {reason.name.lower()}: {text}")
    return "\n".join(lines)


class ViolationReporter:
    """Log mode: every new violation once as a WARNING. Raise mode: ``RuntimeError`` carrying
    the structured lines (sglang's scheduler then exits, as on any scheduler error)."""

    def __init__(self, mode: CanaryMode):
        self.mode = CanaryMode.parse(mode)

    def report(self, rows: List[Sequence[int]], *, step: int, dropped: int = 0) -> None:
        if not rows and not dropped:
            return
        texts = [format_violation_line(r) + "\n" + format_violation_block(r, step) for r in rows]
        if dropped:
            texts.append(f"{VIOLATION_LINE_PREFIX} {dropped} more violation(s) not recorded: "
                         "the ring is full (raise SGLANG_KV_CANARY_RING_CAPACITY)")
        if self.mode == CanaryMode.RAISE:
            raise RuntimeError("kv_canary detected KV-cache corruption:\n" + "\n".join(texts))
        for text in texts:
            logger.warning("%s", text)


class ViolationManager:
    """Turns host copies of the ring into reports of the violations not yet reported."""

    def __init__(self, *, reporter: ViolationReporter, ring_capacity: int):
        self.reporter = reporter
        self.ring_capacity = ring_capacity
        self.reported = 0  # violations counted so far (kept or dropped)

    def process(self, host: Dict[str, torch.Tensor], *, step: int) -> None:
        """``host`` holds ``violation_write_index`` and ``violation_ring`` copies."""
        count = int(host["violation_write_index"][0])
        if count <= self.reported:
            return
        lo = min(self.reported, self.ring_capacity)
        hi = min(count, self.ring_capacity)
        rows = host["violation_ring"][lo:hi].tolist()
        dropped = (count - self.reported) - (hi - lo)
        self.reported = count
        self.reporter.report(rows, step=step, dropped=dropped)
