"""Violation reporting policy: log, abort and raise modes, and the read-back of one forward
window of the ring into incidents (docs/user_guide.md, "Reading a violation report";
docs/architecture.md, "Reading results"). The records and incidents are
:mod:`~sglang.srt.kv_canary.violations.records`'s, the line
:mod:`~sglang.srt.kv_canary.violations.lines`'s.

The ring is read back after every forward and then emptied, so each forward step has its own
``ring_capacity`` rows of detail: violations past that in one step are counted in a "more
violation(s) not recorded" line, and the next step's violations are detailed again.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import torch

from sglang.srt.kv_canary.config import CanaryMode
from sglang.srt.kv_canary.violations.lines import (
    VIOLATION_LINE_PREFIX,
    format_violation_block,
    format_violation_line,
)
from sglang.srt.kv_canary.violations.records import (
    ViolationIncident,
    decode_ring_rows,
    merge_incidents,
)

logger = logging.getLogger(__name__)


class ViolationReporter:
    """Log and abort modes: every new violation once as a WARNING (abort mode's containment
    is the manager's). Raise mode: ``RuntimeError`` carrying the structured lines (sglang's
    scheduler then exits, as on any scheduler error)."""

    def __init__(
        self,
        mode: CanaryMode,
        *,
        pool: str = "",
        rank: str = "",
        server: str = "",
        not_acted_on: str = "",
    ):
        if not isinstance(mode, CanaryMode):  # parsed once, by CanaryConfig
            raise TypeError(f"ViolationReporter takes a CanaryMode, got {mode!r}")
        self.mode = mode
        # which pool the reports are about, when a server has two canaries (EAGLE's draft
        # pool); "" for the one (target) pool
        self.pool = pool
        # which rank raises, on a server of several (e.g. "tp_rank 1, pp_rank 0, dp_rank 0"):
        # the raise message has no log prefix naming it; "" on a one-rank server
        self.rank = rank
        # which server of a PD pair ("PD decode server"); "" without PD
        self.server = server
        # why the server's --kv-canary mode does not act on these reports (a draft pool's
        # under raise / abort: logged only), ending each report; "" when it acts
        self.not_acted_on = not_acted_on

    def report(
        self,
        incidents: Sequence[ViolationIncident],
        *,
        step: int,
        dropped: int = 0,
        ring_capacity: Optional[int] = None,
    ) -> None:
        """``incidents``: one forward window's (:func:`merge_incidents`); ``dropped``: its
        rows past ``ring_capacity``."""
        if not incidents and not dropped:
            return
        where = f"\n  Pool: {self.pool}." if self.pool else ""
        where += f"\n  Server: {self.server}." if self.server else ""
        where += f"\n  {self.not_acted_on}" if self.not_acted_on else ""
        texts = [
            format_violation_line(i, step=step) + "\n" + format_violation_block(i, step) + where
            for i in incidents
        ]
        if dropped:
            held = f" (it holds {ring_capacity} per forward step)" if ring_capacity else ""
            texts.append(
                f"{VIOLATION_LINE_PREFIX} {dropped} more violation(s) not recorded "
                f"at forward step {step}: the ring is full{held}; later steps are "
                "recorded again (raise SGLANG_KV_CANARY_RING_CAPACITY for more detail)"
            )
        if self.mode == CanaryMode.RAISE:
            pool = f" in {self.pool}" if self.pool else ""
            rank = f" on {self.rank}" if self.rank else ""
            server = f" of the {self.server}" if self.server else ""
            raise RuntimeError(
                f"kv_canary detected KV-cache corruption{pool}{rank}{server}:\n" + "\n".join(texts)
            )
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
        self.set_aside_incidents = 0  # no fault: reads of a faked PD transfer (set_aside)

    def collect(
        self, *, write_index: int, ring: torch.Tensor
    ) -> Tuple[List[ViolationIncident], int]:
        """The window's incidents and its dropped row count (counted in the totals);
        ``write_index``: the window's violation count, ``ring``: a host copy of the ring,
        both read back after one forward."""
        count = int(write_index)
        if count <= 0:
            return [], 0
        kept = min(count, self.ring_capacity)
        incidents = merge_incidents(decode_ring_rows(ring[:kept].tolist()))
        dropped = count - kept
        self.total += count
        self.total_dropped += dropped
        self.total_incidents += len(incidents)
        return incidents, dropped

    def set_aside(self, incidents: Sequence[ViolationIncident]) -> None:
        """Take collected incidents that are no fault (a PD decode server's reads of a
        request whose transfer sglang faked) out of the totals; counted in
        ``set_aside_incidents``."""
        self.total -= sum(inc.rows for inc in incidents)
        self.total_incidents -= len(incidents)
        self.set_aside_incidents += len(incidents)

    def count(self, incidents: Sequence[ViolationIncident]) -> None:
        """Count incidents found on the host (the HiCache host-tier sweep), not in the ring."""
        self.total += len(incidents)
        self.total_incidents += len(incidents)

    def report(self, incidents: Sequence[ViolationIncident], *, dropped: int, step: int) -> None:
        self.reporter.report(
            incidents, step=step, dropped=dropped, ring_capacity=self.ring_capacity
        )
