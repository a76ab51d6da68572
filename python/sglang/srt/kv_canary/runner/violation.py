"""Violation reporting: the structured line (format and parse), the log/raise policy, and the
per-step pump (docs/user_guide.md, "Reading a violation report"; docs/architecture.md, "Record
format").

The structured line is the contract for operators' greps and for every test and tool of
this project: they read it with :func:`parse_violation_line` / :func:`parse_violation_lines`,
never with a regex of their own. Fields, in order::

    kv_canary violation: launch_tag=<TAG> fail_reason=<r1>[+<r2>...] slot_idx=<n> position=<n>
        stored_token=<n> expected_token=<n> stored_chain_hash=0x<16 hex> expected_aux=0x<16 hex>
        forward_step=<n> read_position=<n> req_to_token_row=<n> seen_by=<TAG>[,<TAG>...]
        kv_layer=<n> rids=<rid>[,<rid>...]

(one line). ``forward_step`` is the forward step at which the host reported it;
``read_position`` / ``req_to_token_row`` say where the slot was read: attention read
``req_to_token[req_to_token_row, read_position]`` (a write: the forward wrote the slot for that
position of that row; a sweep: ``req_to_token_row=-1`` and ``read_position`` is the slot's
depth in the radix tree). ``kv_layer`` is the sglang layer id whose per-layer fingerprint
(``--kv-canary-real-data-layers all``) failed, ``-1`` for every other check. One line per
incident: every ring row of one forward window with
the same pool kind, slot, read position and row is merged into one line, whose
``fail_reason`` is the union of their reasons, whose other fields are the first row's, and
whose ``seen_by`` lists every launch tag that saw it, first-seen first (``launch_tag`` is the
first of them). ``rids`` names the requests the incident touches (the one that read the slot,
then every running request mapping it: :mod:`~sglang.srt.kv_canary.runner.requests`), ``-``
when none (a sweep of a slot no request maps); a character of a request id outside
``[A-Za-z0-9_.:~-]`` is percent-encoded (``%2C`` for a comma), and the parser decodes it.

The ring is read back after every forward and then emptied (docs/architecture.md, "Reading
results"), so each forward step has its own ``ring_capacity`` rows of detail: violations past
that in one step are counted in a "more violation(s) not recorded" line, and the next step's
violations are detailed again.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import urllib.parse
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang.jit_kernel.kv_canary.consts import (
    HOST_TIER_ROW,
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
    FailReason,
    to_uint64,
)
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag, PoolKind
from sglang.srt.kv_canary.config import CanaryMode

logger = logging.getLogger(__name__)

VIOLATION_LINE_PREFIX = "kv_canary violation:"


def tag_name(kind: int) -> str:
    """A launch tag's name (``UNKNOWN_<n>`` for a value that is none)."""
    try:
        return CanaryLaunchTag(kind).name
    except ValueError:
        return f"UNKNOWN_{kind}"


@dataclasses.dataclass(frozen=True)
class ViolationIncident:
    """One corrupted slot as one forward window saw it: the first ring row (int64 columns in
    the order of ``consts``), the union of every merged row's fail bits, and the launch tags
    that saw it (first-seen first)."""

    row: Tuple[int, ...]
    fail_bits: int
    seen_by: Tuple[int, ...]
    rids: Tuple[str, ...] = ()  # the requests it touches, once resolved


def _as_incident(item) -> ViolationIncident:
    """An incident as is; a single ring row as the incident of that row alone."""
    return item if isinstance(item, ViolationIncident) else merge_incidents([item])[0]


def row_pool_kind(row: Sequence[int]) -> Optional[PoolKind]:
    """The slot space of a ring row's slot (its tag's pool kind); None for an unknown tag."""
    try:
        return CanaryLaunchTag(int(row[VIOLATION_FIELD_KERNEL_KIND])).pool_kind
    except ValueError:
        return None


def incident_key(row: Sequence[int]) -> Tuple:
    """What makes two ring rows one incident: the pool kind of the tag (FULL and SWA slots
    are different slot spaces), the slot, the read position and the ``req_to_token`` row."""
    kind = row_pool_kind(row)
    pool = kind.name if kind is not None else f"UNKNOWN_{int(row[VIOLATION_FIELD_KERNEL_KIND])}"
    return (pool, int(row[VIOLATION_FIELD_SLOT_IDX]), int(row[VIOLATION_FIELD_READ_POSITION]),
            int(row[VIOLATION_FIELD_REQ_TO_TOKEN_ROW]))


def merge_incidents(rows: Sequence[Sequence[int]]) -> List[ViolationIncident]:
    """Group the ring rows of one forward window into incidents, in order of first row."""
    first: Dict[Tuple, List] = {}
    for row in rows:
        row = tuple(int(v) for v in row)
        key = incident_key(row)
        entry = first.get(key)
        tag = row[VIOLATION_FIELD_KERNEL_KIND]
        bits = row[VIOLATION_FIELD_FAIL_REASON_BITS]
        if entry is None:
            first[key] = [row, bits, [tag]]
            continue
        entry[1] |= bits
        if tag not in entry[2]:
            entry[2].append(tag)
    return [ViolationIncident(row=r, fail_bits=b, seen_by=tuple(t)) for r, b, t in first.values()]


def format_violation_line(row, *, step: int) -> str:
    """The stable, grep-able one-line form of an incident (or of a single ring row, as an
    incident of one) reported at forward ``step``."""
    inc = _as_incident(row)
    row = inc.row
    return (
        f"{VIOLATION_LINE_PREFIX} launch_tag={tag_name(int(row[VIOLATION_FIELD_KERNEL_KIND]))} "
        f"fail_reason={FailReason.describe(inc.fail_bits)} "
        f"slot_idx={int(row[VIOLATION_FIELD_SLOT_IDX])} "
        f"position={int(row[VIOLATION_FIELD_POSITION])} "
        f"stored_token={int(row[VIOLATION_FIELD_STORED_TOKEN])} "
        f"expected_token={int(row[VIOLATION_FIELD_EXPECTED_TOKEN])} "
        f"stored_chain_hash=0x{to_uint64(row[VIOLATION_FIELD_STORED_CHAIN_HASH]):016x} "
        f"expected_aux=0x{to_uint64(row[VIOLATION_FIELD_EXPECTED_AUX]):016x} "
        f"forward_step={int(step)} "
        f"read_position={int(row[VIOLATION_FIELD_READ_POSITION])} "
        f"req_to_token_row={int(row[VIOLATION_FIELD_REQ_TO_TOKEN_ROW])} "
        f"seen_by={','.join(tag_name(t) for t in inc.seen_by)} "
        f"kv_layer={int(row[VIOLATION_FIELD_KV_LAYER])} "
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
    + r" rids=([^\s,]+(?:,[^\s,]+)*)")


def _line_from_match(m: "re.Match") -> ViolationLine:
    return ViolationLine(
        launch_tag=m.group(1), fail_reasons=tuple(m.group(2).split("+")),
        slot_idx=int(m.group(3)), position=int(m.group(4)), stored_token=int(m.group(5)),
        expected_token=int(m.group(6)), stored_chain_hash=int(m.group(7), 16),
        expected_aux=int(m.group(8), 16), forward_step=int(m.group(9)),
        read_position=int(m.group(10)), req_to_token_row=int(m.group(11)),
        seen_by=tuple(m.group(12).split(",")), kv_layer=int(m.group(13)),
        rids=parse_rids(m.group(14)))


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
    """Where the incident's slot was read, in words (its first row; every reason of it)."""
    row, bits = inc.row, inc.fail_bits
    slot = row[VIOLATION_FIELD_SLOT_IDX]
    pos = row[VIOLATION_FIELD_READ_POSITION]
    req_row = row[VIOLATION_FIELD_REQ_TO_TOKEN_ROW]
    try:
        phase = CanaryLaunchTag(row[VIOLATION_FIELD_KERNEL_KIND]).phase
    except ValueError:
        phase = None
    if req_row == HOST_TIER_ROW:
        return (f"  The host-tier sweep (HiCache) read host-pool slot {slot}, the cached token at "
                f"depth {pos}, in host memory (its KV bytes no longer match its fingerprint).")
    if req_row < 0:
        return (f"  The radix-cache sweep read slot {slot} as the cached token at depth {pos} "
                "(no request holds it).")
    stored = row[VIOLATION_FIELD_POSITION]
    if bits & (FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH):
        return (f"  The forward wrote slot {slot} for position {pos} of the request in "
                f"req_to_token row {req_row}.")
    where = (f"  Attention read req_to_token[{req_row}, {pos}] = slot {slot} for position {pos}")
    if stored != pos:
        where += f"; the slot's record holds position {stored}: that entry points at the wrong slot"
    elif bits == FailReason.VERIFY_CHAIN_HASH_MISMATCH and pos > 0:
        where += (f"; its predecessor req_to_token[{req_row}, {pos - 1}] holds a record that does "
                  "not chain to it (look for a report at that position)")
    return where + (f" ({phase.name.lower()} check)." if phase is not None else ".")


def format_violation_block(row, step: int) -> str:
    """A human explanation of an incident (or a ring row), printed after its structured line."""
    inc = _as_incident(row)
    row = inc.row
    tag = tag_name(row[VIOLATION_FIELD_KERNEL_KIND])
    bits = inc.fail_bits
    seen = ", ".join(tag_name(t) for t in inc.seen_by)
    lines = [f"  KV slot {row[VIOLATION_FIELD_SLOT_IDX]} failed its canary check in launch "
             f"{tag} (seen by {seen}; reported at forward step {step}):",
             _where_read(inc)]
    layer = int(row[VIOLATION_FIELD_KV_LAYER])
    if layer >= 0:
        try:
            half = CanaryLaunchTag(row[VIOLATION_FIELD_KERNEL_KIND]).half.name
        except ValueError:
            half = "?"
        lines.append(f"  Layer {layer}'s {half} row of the slot no longer matches the fingerprint "
                     "taken when it was written (per-layer check, "
                     "--kv-canary-real-data-layers all); first row's layer, if several failed.")
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
    lines.append("  Requests touched: " + (", ".join(inc.rids) if inc.rids else
                                            "none running (no request maps the slot)"))
    return "\n".join(lines)


class ViolationReporter:
    """Log and abort modes: every new violation once as a WARNING (abort mode's containment
    is the manager's). Raise mode: ``RuntimeError`` carrying the structured lines (sglang's
    scheduler then exits, as on any scheduler error)."""

    def __init__(self, mode: CanaryMode, *, pool: str = "", rank: str = ""):
        self.mode = CanaryMode.parse(mode)
        # which pool the reports are about, when a server has two canaries (EAGLE's draft
        # pool); "" for the one (target) pool
        self.pool = pool
        # which rank raises, on a server of several (e.g. "tp_rank 1, pp_rank 0, dp_rank 0"):
        # the raise message has no log prefix naming it; "" on a one-rank server
        self.rank = rank

    def report(self, incidents: Sequence[ViolationIncident], *, step: int, dropped: int = 0,
               ring_capacity: Optional[int] = None) -> None:
        """``incidents``: one forward window's (:func:`merge_incidents`); ``dropped``: its
        rows past ``ring_capacity``."""
        if not incidents and not dropped:
            return
        where = f"\n  Pool: {self.pool}." if self.pool else ""
        texts = [format_violation_line(i, step=step) + "\n" + format_violation_block(i, step)
                 + where for i in incidents]
        if dropped:
            held = f" (it holds {ring_capacity} per forward step)" if ring_capacity else ""
            texts.append(f"{VIOLATION_LINE_PREFIX} {dropped} more violation(s) not recorded "
                         f"at forward step {step}: the ring is full{held}; later steps are "
                         "recorded again (raise SGLANG_KV_CANARY_RING_CAPACITY for more detail)")
        if self.mode == CanaryMode.RAISE:
            pool = f" in {self.pool}" if self.pool else ""
            rank = f" on {self.rank}" if self.rank else ""
            raise RuntimeError(f"kv_canary detected KV-cache corruption{pool}{rank}:\n"
                               + "\n".join(texts))
        for text in texts:
            logger.warning("%s", text)


class ViolationManager:
    """Turns the host copy of one forward window of the ring into incident reports.

    The runner empties the ring after staging each read-back, so every window starts at row
    0: ``write_index`` is the number of violations the window counted, the first
    ``min(write_index, ring_capacity)`` rows are kept, the rest were dropped (counted only)."""

    def __init__(self, *, reporter: ViolationReporter, ring_capacity: int):
        self.reporter = reporter
        self.ring_capacity = ring_capacity
        self.total = 0  # ring rows counted so far, kept or dropped, over all windows
        self.total_dropped = 0  # of those, rows past a window's capacity
        self.total_incidents = 0  # reported lines (merged rows) so far

    def collect(self, *, write_index: int, ring: torch.Tensor
                ) -> Tuple[List[ViolationIncident], int]:
        """The window's incidents and its dropped row count (counted in the totals);
        ``write_index``: the window's violation count, ``ring``: a host copy of the ring,
        both read back after one forward."""
        count = int(write_index)
        if count <= 0:
            return [], 0
        kept = min(count, self.ring_capacity)
        incidents = merge_incidents(ring[:kept].tolist())
        dropped = count - kept
        self.total += count
        self.total_dropped += dropped
        self.total_incidents += len(incidents)
        return incidents, dropped

    def count(self, incidents: Sequence[ViolationIncident]) -> None:
        """Count incidents found on the host (the HiCache host-tier sweep), not in the ring."""
        self.total += len(incidents)
        self.total_incidents += len(incidents)

    def report(self, incidents: Sequence[ViolationIncident], *, dropped: int, step: int
               ) -> None:
        self.reporter.report(incidents, step=step, dropped=dropped,
                             ring_capacity=self.ring_capacity)

    def process(self, *, write_index: int, ring: torch.Tensor, step: int) -> None:
        """:meth:`collect` then :meth:`report` (incidents without request ids)."""
        incidents, dropped = self.collect(write_index=write_index, ring=ring)
        if incidents or dropped:
            self.report(incidents, dropped=dropped, step=step)
