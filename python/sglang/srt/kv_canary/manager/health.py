"""``KernelRunCounterHealthChecker``: the canary must keep running (docs/architecture.md,
"Runtime")."""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Sequence

from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag

HEALTH_WARMUP_STEPS = 100
HEALTH_INTERVAL_STEPS = 100


class KernelRunCounterHealthChecker:
    """Every ``interval`` steps after ``warmup`` steps, each expected tag's kernel counter must
    have grown since the previous check; otherwise the canary path is not executing (a hook
    lost, a graph captured without the canary) and a ``RuntimeError`` says which tags."""

    def __init__(
        self,
        *,
        expected_tags: Iterable[CanaryLaunchTag],
        warmup_steps: int = HEALTH_WARMUP_STEPS,
        interval_steps: int = HEALTH_INTERVAL_STEPS,
    ):
        self.expected_tags = tuple(expected_tags)
        self.warmup_steps = warmup_steps
        self.interval_steps = interval_steps
        self._last: Optional[Dict[CanaryLaunchTag, int]] = None

    def check(self, *, step: int, kernel_counters: Sequence[int]) -> None:
        if step < self.warmup_steps or (step - self.warmup_steps) % self.interval_steps:
            return
        now = {t: int(kernel_counters[int(t)]) for t in self.expected_tags}
        if self._last is not None:
            stuck = [
                f"{t.name} (stuck at {now[t]})"
                for t in self.expected_tags
                if now[t] <= self._last[t]
            ]
            if stuck:
                raise RuntimeError(
                    "kv_canary health check failed: the canary path is not executing: kernel "
                    f"counters did not grow over the last {self.interval_steps} forward steps "
                    f"for {', '.join(stuck)}"
                )
        self._last = now
