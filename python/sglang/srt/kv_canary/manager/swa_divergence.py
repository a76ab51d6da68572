"""``SwaDivergenceReporter``: running count of FULL vs SWA verify entries on a hybrid
sliding-window pool (docs/architecture.md, "The adapters and what they cover";
docs/user_guide.md, "Sliding-window models (SWA) and DeepSeek-V4").

Every ``interval`` steps (``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``, 0 = off) it logs
``kv_canary_swa_divergence=<json>``: the enabled plans' ``verify_num_valid`` summed per pool
kind (evicted SWA entries included; the verify kernel skips them). Never read on the forward
path: the manager adds :meth:`SwaDivergenceReporter.device_tensors` to its delayed read-back
and hands each host copy (one per forward) to :meth:`SwaDivergenceReporter.consume`. Host only.
"""

from __future__ import annotations

import json
import logging
from typing import Sequence, Tuple

import torch

from sglang.jit_kernel.kv_canary.types import PoolKind, VerifyPlan

logger = logging.getLogger(__name__)

SWA_DIVERGENCE_LINE_PREFIX = "kv_canary_swa_divergence="


class SwaDivergenceReporter:
    """``sfm_plans``: per single-forward manager (in index order), its groups' verify plans
    in the order of its status entries (``sfm.groups``), as ``(kind, verify_plan)`` pairs."""

    def __init__(
        self, *, interval: int, sfm_plans: Sequence[Sequence[Tuple[PoolKind, VerifyPlan]]]
    ):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(
                f"SwaDivergenceReporter interval must be an int >= 0, got {interval!r}"
            )
        self.interval = interval
        self._kinds = tuple(tuple(kind for kind, _ in plans) for plans in sfm_plans)
        self._sources = tuple(
            tuple(plan.verify_num_valid for _, plan in plans) for plans in sfm_plans
        )
        self.full_verify_entries = 0
        self.swa_verify_entries = 0
        self.forwards = 0

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def device_tensors(self) -> Tuple[Tuple[torch.Tensor, ...], ...]:
        """Per single-forward manager, its plans' ``verify_num_valid`` (int32 ``[1]`` each),
        to stage with the manager's delayed copies; empty when off."""
        return self._sources if self.enabled else ()

    def consume(
        self,
        *,
        num_valid: Sequence[torch.Tensor],
        plan_enabled: Sequence[int],
        step: int,
        sfm_index: int,
    ) -> None:
        """Add the forward staged at ``step`` by single-forward manager ``sfm_index``:
        ``num_valid`` the host copies of its :meth:`device_tensors` entry, ``plan_enabled`` its
        status' flags; log the running totals when ``step`` is a multiple of the interval."""
        if not self.enabled:
            return
        for kind, n, enabled in zip(self._kinds[sfm_index], num_valid, plan_enabled):
            if not enabled:
                continue
            if kind == PoolKind.SWA:
                self.swa_verify_entries += int(n[0])
            else:
                self.full_verify_entries += int(n[0])
        self.forwards += 1
        if step % self.interval == 0:
            logger.info("%s%s", SWA_DIVERGENCE_LINE_PREFIX, json.dumps(self.snapshot(step)))

    def snapshot(self, step: int) -> dict:
        full, swa = self.full_verify_entries, self.swa_verify_entries
        return {
            "step": step,
            "forwards": self.forwards,
            "full_verify_entries": full,
            "swa_verify_entries": swa,
            "full_minus_swa": full - swa,
            "swa_over_full": round(swa / full, 6) if full else None,
        }
