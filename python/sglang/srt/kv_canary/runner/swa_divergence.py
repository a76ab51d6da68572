"""``SwaDivergenceReporter``: running count of FULL vs SWA verify entries (SPEC §10).

On a hybrid sliding-window pool the FULL group verifies each request's whole prefix while the
SWA group verifies only its window, so the two counts diverge as contexts grow past the window;
the ratio shows how much of the KV the SWA layers read (and the canary re-checks) per forward.
Every ``interval`` steps (``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``, 0 = off) one line
``kv_canary_swa_divergence=<json>`` is logged.

The counts are the plans' ``verify_num_valid`` (entries planned for a forward, evicted SWA
slots included: the verify kernel skips those), counted only for plans that were enabled (an
overflowed plan verifies nothing). They are never read on the forward path: the manager adds
:meth:`watched_tensors` to its delayed device→host copies and hands each host copy (one per
forward, staged after it) to :meth:`consume`. Host-only; not graph-related.
"""

from __future__ import annotations

import json
import logging
from typing import Dict, Sequence

import torch

from sglang.jit_kernel.kv_canary.verify import PoolKind

logger = logging.getLogger(__name__)

SWA_DIVERGENCE_LINE_PREFIX = "kv_canary_swa_divergence="


def _key(sfm_index: int, group_index: int) -> str:
    return f"swa_divergence_num_valid_{sfm_index}_{group_index}"


class SwaDivergenceReporter:
    """``sfm_plans``: per single-forward manager (by index), its groups' verify plans in the
    order of its ``status_plan_enabled`` entries, as ``(kind, verify_plan)`` pairs."""

    def __init__(self, *, interval: int,
                 sfm_plans: Dict[int, Sequence]):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"SwaDivergenceReporter interval must be an int >= 0, got "
                             f"{interval!r}")
        self.interval = interval
        self._kinds = {i: [kind for kind, _ in plans] for i, plans in sfm_plans.items()}
        self._sources = {_key(i, g): plan.verify_num_valid
                         for i, plans in sfm_plans.items() for g, (_, plan) in enumerate(plans)}
        self.full_verify_entries = 0
        self.swa_verify_entries = 0
        self.forwards = 0

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def watched_tensors(self) -> Dict[str, torch.Tensor]:
        """Device tensors to stage with the manager's delayed copies (empty when off)."""
        return dict(self._sources) if self.enabled else {}

    def consume(self, *, host: Dict[str, torch.Tensor], step: int, sfm_index: int) -> None:
        """Add the forward staged at ``step`` (by single-forward manager ``sfm_index``) and log
        the running totals when ``step`` is a multiple of the interval."""
        if not self.enabled:
            return
        enabled = host[f"plan_enabled_{sfm_index}"].tolist()
        for g, kind in enumerate(self._kinds[sfm_index]):
            if not enabled[g]:
                continue
            n = int(host[_key(sfm_index, g)][0])
            if kind == PoolKind.SWA:
                self.swa_verify_entries += n
            else:
                self.full_verify_entries += n
        self.forwards += 1
        if step % self.interval == 0:
            logger.info("%s%s", SWA_DIVERGENCE_LINE_PREFIX, json.dumps(self.snapshot(step)))

    def snapshot(self, step: int) -> dict:
        full, swa = self.full_verify_entries, self.swa_verify_entries
        return {"step": step, "forwards": self.forwards, "full_verify_entries": full,
                "swa_verify_entries": swa, "full_minus_swa": full - swa,
                "swa_over_full": round(swa / full, 6) if full else None}
