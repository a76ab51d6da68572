"""Violation reporting: the structured line (format and parse), the log/raise policy, and the
per-step pump (docs/user_guide.md, "Reading a violation report"; docs/architecture.md, "Record
format").

The structured line is the contract for operators' greps and for every test and tool of
this project: they read it with :func:`parse_violation_line` / :func:`parse_violation_lines`,
never with a regex of their own. Fields, in order::

    kv_canary violation: launch_tag=<TAG> fail_reason=<r1>[+<r2>...] slot_idx=<n> position=<n>
        stored_token=<n> expected_token=<n> stored_chain_hash=0x<16 hex> expected_aux=0x<16 hex>
        forward_step=<n>

(one line; ``forward_step`` is the forward step at which the host reported it).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import List, Optional, Sequence, Tuple

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
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag
from sglang.srt.kv_canary.config import CanaryMode

logger = logging.getLogger(__name__)

VIOLATION_LINE_PREFIX = "kv_canary violation:"


def _tag_name(kind: int) -> str:
    try:
        return CanaryLaunchTag(kind).name
    except ValueError:
        return f"UNKNOWN_{kind}"


def format_violation_line(row: Sequence[int], *, step: int) -> str:
    """The stable, grep-able one-line form of a ring row reported at forward ``step``."""
    return (
        f"{VIOLATION_LINE_PREFIX} launch_tag={_tag_name(int(row[VIOLATION_FIELD_KERNEL_KIND]))} "
        f"fail_reason={FailReason.describe(int(row[VIOLATION_FIELD_FAIL_REASON_BITS]))} "
        f"slot_idx={int(row[VIOLATION_FIELD_SLOT_IDX])} "
        f"position={int(row[VIOLATION_FIELD_POSITION])} "
        f"stored_token={int(row[VIOLATION_FIELD_STORED_TOKEN])} "
        f"expected_token={int(row[VIOLATION_FIELD_EXPECTED_TOKEN])} "
        f"stored_chain_hash=0x{to_uint64(row[VIOLATION_FIELD_STORED_CHAIN_HASH]):016x} "
        f"expected_aux=0x{to_uint64(row[VIOLATION_FIELD_EXPECTED_AUX]):016x} "
        f"forward_step={int(step)}"
    )


@dataclasses.dataclass(frozen=True)
class ViolationLine:
    """The fields of one structured violation line (hashes as unsigned ints)."""

    launch_tag: str
    fail_reasons: Tuple[str, ...]
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    forward_step: int


_INT = r"(-?\d+)"
_HEX = r"0x([0-9a-f]{16})"
_LINE_RE = re.compile(
    re.escape(VIOLATION_LINE_PREFIX)
    + rf" launch_tag=(\w+) fail_reason=([\w+]+) slot_idx={_INT} position={_INT}"
    + rf" stored_token={_INT} expected_token={_INT} stored_chain_hash={_HEX}"
    + rf" expected_aux={_HEX} forward_step={_INT}")


def _line_from_match(m: "re.Match") -> ViolationLine:
    return ViolationLine(
        launch_tag=m.group(1), fail_reasons=tuple(m.group(2).split("+")),
        slot_idx=int(m.group(3)), position=int(m.group(4)), stored_token=int(m.group(5)),
        expected_token=int(m.group(6)), stored_chain_hash=int(m.group(7), 16),
        expected_aux=int(m.group(8), 16), forward_step=int(m.group(9)))


def parse_violation_line(line: str) -> Optional[ViolationLine]:
    """The violation in ``line`` (a log line may carry a prefix before it), or None."""
    m = _LINE_RE.search(line)
    return _line_from_match(m) if m is not None else None


def parse_violation_lines(text: str, *, unique: bool = True) -> List[ViolationLine]:
    """Every structured violation line in ``text`` (a server's output, a raised error's
    message), in order; with ``unique`` a line printed twice (raise mode logs the error
    and re-raises it) counts once."""
    out: List[ViolationLine] = []
    seen = set()
    for m in _LINE_RE.finditer(text):
        v = _line_from_match(m)
        if unique and v in seen:
            continue
        seen.add(v)
        out.append(v)
    return out


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
        texts = [format_violation_line(r, step=step) + "\n" + format_violation_block(r, step)
                 for r in rows]
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

    def process(self, *, write_index: int, ring: torch.Tensor, step: int) -> None:
        """``write_index``: the ring's write index (violations counted so far), ``ring``: a host
        copy of the ring, both read back after forward ``step``."""
        count = int(write_index)
        if count <= self.reported:
            return
        lo = min(self.reported, self.ring_capacity)
        hi = min(count, self.ring_capacity)
        rows = ring[lo:hi].tolist()
        dropped = (count - self.reported) - (hi - lo)
        self.reported = count
        self.reporter.report(rows, step=step, dropped=dropped)
