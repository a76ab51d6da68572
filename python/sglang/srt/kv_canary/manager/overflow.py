"""Warn when a forward's verify plan overflowed its capacity (the forward went unverified)."""

from __future__ import annotations

import logging
from typing import Sequence

logger = logging.getLogger(__name__)


class VerifyOverflowWarner:
    """Logs a WARNING for each forward whose plan was disabled by a capacity overflow, with
    the running count, so an operator sees that coverage was lost and why."""

    def __init__(self, *, verify_capacity: int):
        self.verify_capacity = verify_capacity
        self.overflows = 0

    def check(self, *, step: int, plan_enabled: Sequence[int]) -> None:
        skipped = sum(1 for e in plan_enabled if int(e) != 1)
        if skipped:
            self.overflows += skipped
            logger.warning(
                "kv_canary: forward step %d had more verify entries than the capacity %d in %d "
                "buffer group(s); that forward was not verified (%d overflow(s) so far). The "
                "capacity is 3x the KV pool size: lower --max-running-requests or the context "
                "length if this persists.",
                step,
                self.verify_capacity,
                skipped,
                self.overflows,
            )
