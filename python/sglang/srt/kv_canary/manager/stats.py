"""``PeriodicCanaryStatsLogger``: one stats line every N forward steps (docs/architecture.md,
"Runtime")."""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Tuple

from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag, CanaryPhase

logger = logging.getLogger(__name__)

STATS_LINE_PREFIX = "kv_canary stats:"


class PeriodicCanaryStatsLogger:
    def __init__(self, *, every_n_steps: int):
        self.every_n_steps = every_n_steps

    def maybe_log(
        self,
        *,
        step: int,
        kernel_counters: Sequence[int],
        slot_counters: Sequence[int],
        violations: int,
        sweep_passes: int,
        host_tier: Optional[Tuple[int, int]] = None,
    ) -> None:
        """``host_tier``: HiCache's canary rows (slots backed up, slots loaded back) so far,
        appended as ``host_backed_up=`` / ``host_loaded=`` (None: no host tier)."""
        if not self.every_n_steps or step % self.every_n_steps:
            return
        protected = sum(
            int(slot_counters[int(t)]) for t in CanaryLaunchTag if t.phase != CanaryPhase.SWEEP
        )
        active = [t.name for t in CanaryLaunchTag if int(kernel_counters[int(t)]) > 0]
        host = (
            f" host_backed_up={host_tier[0]} host_loaded={host_tier[1]}"
            if host_tier is not None
            else ""
        )
        logger.info(
            "%s step=%d protected_tokens=%d sweep_passes=%d violations=%d active_tags=%s%s",
            STATS_LINE_PREFIX,
            step,
            protected,
            sweep_passes,
            violations,
            ",".join(active) or "none",
            host,
        )
