"""The structured violation line (format and parse) and the explanation printed after it
(docs/user_guide.md, "Reading a violation report"; docs/architecture.md, "Record format").

The line is the contract for operators' greps and for every test and tool here, which read it
with :func:`parse_violation_line` / :func:`parse_violation_lines`, never a regex of their own.
One line per incident (merged as docs/architecture.md, "Reading results" says), fields in this
order, ``rids`` last (``-`` when none; characters outside ``[A-Za-z0-9_.:~-]`` percent-encoded)::

    kv_canary violation: launch_tag=<TAG> fail_reason=<r1>[+<r2>...] slot_idx=<n> position=<n>
        stored_token=<n> expected_token=<n> stored_chain_hash=0x<16 hex> expected_aux=0x<16 hex>
        forward_step=<n> read_position=<n> req_to_token_row=<n> seen_by=<TAG>[,<TAG>...]
        kv_layer=<n> rids=<rid>[,<rid>...]
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from typing import List, Optional, Sequence, Tuple, Union

from sglang.jit_kernel.kv_canary.consts import FailReason, to_uint64
from sglang.srt.kv_canary.violations.records import (
    ViolationIncident,
    ViolationRecord,
    tag_name,
)

VIOLATION_LINE_PREFIX = "kv_canary violation:"


def _as_incident(item: Union[ViolationIncident, ViolationRecord]) -> ViolationIncident:
    """An incident as is; a record as the incident of that record alone."""
    return item if isinstance(item, ViolationIncident) else ViolationIncident.of(item)


def format_violation_line(item: Union[ViolationIncident, ViolationRecord], *, step: int) -> str:
    """The stable, grep-able one-line form of an incident (or of one record, as an incident of
    one) reported at forward ``step``."""
    inc = _as_incident(item)
    rec = inc.record
    return (
        f"{VIOLATION_LINE_PREFIX} launch_tag={rec.tag_name} "
        f"fail_reason={FailReason.describe(inc.fail_bits)} "
        f"slot_idx={rec.slot_idx} "
        f"position={rec.position} "
        f"stored_token={rec.stored_token} "
        f"expected_token={rec.expected_token} "
        f"stored_chain_hash=0x{to_uint64(rec.stored_chain_hash):016x} "
        f"expected_aux=0x{to_uint64(rec.expected_aux):016x} "
        f"forward_step={int(step)} "
        f"read_position={rec.read_position} "
        f"req_to_token_row={rec.req_to_token_row} "
        f"seen_by={','.join(tag_name(t) for t in inc.seen_by)} "
        f"kv_layer={rec.kv_layer} "
        f"rids={format_rids(inc.rids)}"
    )


_RID_SAFE = "_.:~-"  # with letters and digits, left as they are in ``rids=``


def format_rids(rids: Sequence[str]) -> str:
    """``rids=``'s value: the ids comma-separated and percent-encoded, ``-`` for none."""
    return ",".join(urllib.parse.quote(str(r), safe=_RID_SAFE) for r in rids) or "-"


def parse_rids(text: str) -> Tuple[str, ...]:
    return () if text == "-" else tuple(urllib.parse.unquote(r) for r in text.split(","))


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
    read_position: int
    req_to_token_row: int
    seen_by: Tuple[str, ...]
    kv_layer: int  # -1 unless a per-layer fingerprint failed
    rids: Tuple[str, ...]  # empty for ``rids=-``


_INT = r"(-?\d+)"
_HEX = r"0x([0-9a-f]{16})"
_LINE_RE = re.compile(
    re.escape(VIOLATION_LINE_PREFIX)
    + rf" launch_tag=(\w+) fail_reason=([\w+]+) slot_idx={_INT} position={_INT}"
    + rf" stored_token={_INT} expected_token={_INT} stored_chain_hash={_HEX}"
    + rf" expected_aux={_HEX} forward_step={_INT} read_position={_INT}"
    + rf" req_to_token_row={_INT} seen_by=([\w,]+) kv_layer={_INT}"
    + r" rids=([^\s,]+(?:,[^\s,]+)*)"
)


def _line_from_match(m: "re.Match") -> ViolationLine:
    return ViolationLine(
        launch_tag=m.group(1),
        fail_reasons=tuple(m.group(2).split("+")),
        slot_idx=int(m.group(3)),
        position=int(m.group(4)),
        stored_token=int(m.group(5)),
        expected_token=int(m.group(6)),
        stored_chain_hash=int(m.group(7), 16),
        expected_aux=int(m.group(8), 16),
        forward_step=int(m.group(9)),
        read_position=int(m.group(10)),
        req_to_token_row=int(m.group(11)),
        seen_by=tuple(m.group(12).split(",")),
        kv_layer=int(m.group(13)),
        rids=parse_rids(m.group(14)),
    )


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


def _where_read(inc: ViolationIncident) -> str:
    """Where the incident's slot was read, in words (its first record; every reason of it)."""
    rec, bits = inc.record, inc.fail_bits
    slot, pos, req_row = rec.slot_idx, rec.read_position, rec.req_to_token_row
    phase = rec.tag.phase if rec.tag is not None else None
    if rec.on_host_tier:
        return (
            f"  The host-tier sweep (HiCache) read host-pool slot {slot}, the cached token at "
            f"depth {pos}, in host memory (its KV bytes no longer match its fingerprint)."
        )
    if req_row < 0:
        return (
            f"  The radix-cache sweep read slot {slot} as the cached token at depth {pos} "
            "(no request holds it)."
        )
    if bits & (FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH):
        return (
            f"  The forward wrote slot {slot} for position {pos} of the request in "
            f"req_to_token row {req_row}."
        )
    where = f"  Attention read req_to_token[{req_row}, {pos}] = slot {slot} for position {pos}"
    if rec.position != pos:
        where += (
            f"; the slot's record holds position {rec.position}: that entry points at the "
            "wrong slot"
        )
    elif bits == FailReason.VERIFY_CHAIN_HASH_MISMATCH and pos > 0:
        where += (
            f"; its predecessor req_to_token[{req_row}, {pos - 1}] holds a record that does "
            "not chain to it (look for a report at that position)"
        )
    return where + (f" ({phase.name.lower()} check)." if phase is not None else ".")


def format_violation_block(item: Union[ViolationIncident, ViolationRecord], step: int) -> str:
    """A human explanation of an incident (or a record), printed after its structured line."""
    inc = _as_incident(item)
    rec = inc.record
    bits = inc.fail_bits
    seen = ", ".join(tag_name(t) for t in inc.seen_by)
    lines = [
        f"  KV slot {rec.slot_idx} failed its canary check in launch "
        f"{rec.tag_name} (seen by {seen}; reported at forward step {step}):",
        _where_read(inc),
    ]
    if rec.kv_layer >= 0:
        half = rec.tag.half.name if rec.tag is not None else "?"
        lines.append(
            f"  Layer {rec.kv_layer}'s {half} row of the slot no longer matches the "
            "fingerprint taken when it was written (per-layer check, "
            "--kv-canary-real-data-layers all); first row's layer, if several failed."
        )
    explain = {
        FailReason.VERIFY_CHAIN_HASH_MISMATCH: "the record's prev_hash does not match its predecessor slot's record: the slot "
        "holds KV of another sequence, or req_to_token points at the wrong slot",
        FailReason.VERIFY_POSITION_MISMATCH: "the record holds a different sequence position than attention reads it for",
        FailReason.VERIFY_TOKEN_MISMATCH: "the record holds a different token than the request's own history",
        FailReason.VERIFY_REAL_KV_HASH_MISMATCH: "the KV bytes changed since they were written (corruption or a stale/overwritten "
        "slot)",
        FailReason.WRITE_TOKEN_MISMATCH: "the token written differs from the expected input",
        FailReason.WRITE_POSITION_MISMATCH: "the position written is not the expected one (expected position in expected_aux)",
    }
    for reason, text in explain.items():
        if bits & reason:
            lines.append(f"    - {reason.name.lower()}: {text}")
    lines.append(
        "  Requests touched: "
        + (", ".join(inc.rids) if inc.rids else "none running (no request maps the slot)")
    )
    return "\n".join(lines)
