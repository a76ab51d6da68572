"""What happens to one forward's read-back (docs/architecture.md, "Reading results" and
"Violation pipeline"): the typed read-back (:class:`CanaryReadback`), the forward it
belongs to (:class:`StagedForward`), and :class:`ForwardReporter`, which consumes it (overflow,
health, stats, SWA divergence, metrics) and reports its incidents (the requests each touches,
abort mode's containment, the reporter). One per ``CanaryManager``, which hands it plain
values per forward; host only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Sequence, Tuple

import torch

from sglang.jit_kernel.kv_canary.types import CanaryPhase, PoolKind
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.batch_state import ForwardRequests
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode
from sglang.srt.kv_canary.ranks import SAME_POSITION_DRAFT_WORKERS, RankFacts
from sglang.srt.kv_canary.violations.containment import ContainmentManager
from sglang.srt.kv_canary.violations.rank_relay import ContainmentNotice
from sglang.srt.kv_canary.manager.health import KernelRunCounterHealthChecker
from sglang.srt.kv_canary.violations.metrics import CanaryMetrics
from sglang.srt.kv_canary.manager.overflow import VerifyOverflowWarner
from sglang.srt.kv_canary.violations.resolver import RequestResolver, violation_path_sync
from sglang.srt.kv_canary.manager.stats import PeriodicCanaryStatsLogger
from sglang.srt.kv_canary.manager.swa_divergence import SwaDivergenceReporter
from sglang.srt.kv_canary.violations.reporter import ViolationManager, ViolationReporter
from sglang.srt.kv_canary.single_forward_manager import SfmStatus

logger = logging.getLogger(__name__)


def draft_not_acted_on(mode: CanaryMode) -> str:
    """The last line of a draft pool's report that ``mode`` does not act on
    (``SGLANG_KV_CANARY_DRAFT_VIOLATIONS=report``, the default)."""
    return (
        f"Not acted on (--kv-canary {mode.value}): a draft model's KV costs draft acceptance "
        "only, the target model verifies every token; SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act "
        f"makes --kv-canary {mode.value} act on it."
    )


def draft_pool_label(draft_worker: str) -> str:
    """How the reports of a draft runner's canary name its pool (``draft_worker``: EAGLE,
    STANDALONE or DFLASH, whose position p holds the KV projected from token p's target hidden
    state)."""
    if draft_worker in SAME_POSITION_DRAFT_WORKERS:
        return (
            f"the {draft_worker} draft model's KV pool (its position p holds the KV projected "
            "from the target's hidden state of token p)"
        )
    return (
        f"the {draft_worker} draft model's KV pool (its position p holds the KV computed from "
        "token p + 1)"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class CanaryReadback:
    """What the manager reads back after every forward (device tensors here; the delayed
    host copy has the same type, holding host tensors).

    - ``violation_write_index`` int32 ``[1]``, ``violation_ring`` int64 ``[capacity,
      VIOLATION_NUM_FIELDS]``: one forward window (the ring is emptied after each stage);
    - ``kernel_run_counters`` / ``slot_run_counters`` int64 ``[num tags]``;
    - ``sfm_status``: each single-forward manager's :class:`SfmStatus`, by index;
    - ``swa_verify_num_valid``: per single-forward manager, its plans' ``verify_num_valid``
      (only with SWA divergence stats on; empty otherwise).
    """

    violation_write_index: torch.Tensor
    violation_ring: torch.Tensor
    kernel_run_counters: torch.Tensor
    slot_run_counters: torch.Tensor
    sfm_status: Tuple[SfmStatus, ...]
    swa_verify_num_valid: Tuple[Tuple[torch.Tensor, ...], ...]


@dataclasses.dataclass(frozen=True, eq=False)
class StagedForward:
    """The forward whose read-back is staged: its step, single-forward managers (one, or a
    replayed EAGLE draft round's) and requests."""

    step: int
    sfm_indices: Tuple[int, ...]
    requests: ForwardRequests


class ForwardReporter:
    """The consumers of a forward's read-back and the report path of its incidents, built
    from the canary's settings. ``metrics`` (None: metrics off) and ``kv_slots_in_use`` are
    set when the scheduler attaches; ``requests`` gets the scheduler's running requests then
    too."""

    def __init__(
        self,
        *,
        config: CanaryConfig,
        ranks: RankFacts,
        capacities: CanaryLaunchCapacities,
        groups: Sequence[CanaryBufferGroup],
        expected_tags: Sequence,
        swa_divergence: SwaDivergenceReporter,
        req_to_token: torch.Tensor,
        device: torch.device,
    ):
        self._device = device
        # a draft pool's violations are only logged unless the operator opts in
        # (CanaryConfig.acting_mode); they are counted either way, labelled by pool
        self.mode = config.acting_mode(draft=ranks.draft)
        self.pool = "draft" if ranks.draft else "target"
        self.violations = ViolationManager(
            reporter=ViolationReporter(
                self.mode,
                pool=draft_pool_label(ranks.draft_worker) if ranks.draft else "",
                rank=ranks.describe_rank() if ranks.several else "",
                server=ranks.server_role,
                not_acted_on="" if self.mode == config.mode else draft_not_acted_on(config.mode),
            ),
            ring_capacity=config.ring_capacity,
        )
        self.health = KernelRunCounterHealthChecker(expected_tags=list(expected_tags))
        self.stats = PeriodicCanaryStatsLogger(every_n_steps=config.stats_print_every_n_steps)
        self.overflow = VerifyOverflowWarner(verify_capacity=capacities.verify_capacity)
        self.swa_divergence = swa_divergence
        # who a violation touches (rids=), abort mode's containment
        swa_lut = next((g.swa_index_lut for g in groups if g.kind == PoolKind.SWA), None)
        self.requests = RequestResolver(req_to_token=req_to_token, swa_index_lut=swa_lut)
        self.containment: Optional[ContainmentManager] = None
        if self.mode.contains:
            full = next((g for g in groups if g.kind == PoolKind.FULL), None)
            if full is None:  # every adapter builds one, but for an SWA-only pool
                raise ValueError(
                    f"--kv-canary {self.mode.value} needs the pool's full-attention buffer "
                    "group (its records say which request owns a slot), which this pool has "
                    "none of"
                    + (
                        " (a draft model's pool of sliding-window layers only): a draft "
                        "pool's violations are acted on only with "
                        "SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act; unset it (report)"
                        if ranks.draft
                        else ""
                    )
                )
            self.containment = ContainmentManager(
                resolver=self.requests,
                swa_index_lut=swa_lut,
                records=full.k_tail,
                heal_max=config.max_heals if self.mode == CanaryMode.HEAL else None,
                retire_after=config.retire_after,
                retire_max_fraction=config.retire_max_fraction,
            )
        self.metrics: Optional[CanaryMetrics] = None
        self.kv_slots_in_use: Callable[[], int] = lambda: 0

    def counts(self) -> dict:
        """What this pool's canary reported so far: violation lines, rows dropped past the
        ring, requests aborted and healed, and the mode its violations are handled in (``log``
        for a draft pool whose reports the server's mode does not act on). Host values only."""
        containment = self.containment
        return {
            "violations": self.violations.total_incidents,
            "dropped_violations": self.violations.total_dropped,
            "aborted_requests": containment.aborted_requests if containment is not None else 0,
            "healed_requests": containment.healed_requests if containment is not None else 0,
            "retired_slots": containment.retired_slots if containment is not None else 0,
            "acting_mode": self.mode.value,
        }

    @staticmethod
    def expected_tags(endpoints) -> list:
        """The launch tags whose kernel counters must grow (the HEAD and TAIL endpoints')."""
        return [ep.tag for ep in endpoints if ep.phase in (CanaryPhase.HEAD, CanaryPhase.TAIL)]

    def consume(
        self,
        host: CanaryReadback,
        staged: StagedForward,
        *,
        sweep_passes: int,
        host_tier: Optional[Tuple[int, int]],
    ) -> None:
        """One forward's host copies: overflow and SWA divergence per single-forward manager,
        its incidents reported (only on a step with one), metrics, stats, the health check.
        ``host_tier``: HiCache's (backed-up, loaded) slot counts, None without it."""
        step = staged.step
        plans_enabled = {i: host.sfm_status[i].plan_enabled.tolist() for i in staged.sfm_indices}
        for plan_enabled in plans_enabled.values():
            self.overflow.check(step=step, plan_enabled=plan_enabled)
        kernel_counters = host.kernel_run_counters.tolist()
        slot_counters = host.slot_run_counters.tolist()
        incidents, dropped = self.violations.collect(
            write_index=host.violation_write_index.tolist()[0], ring=host.violation_ring
        )
        if incidents or dropped:
            self.report(incidents, dropped=dropped, step=step, requests=staged.requests)
        if self.metrics is not None:
            self.metrics.on_step(
                verified_slots=sum(slot_counters),
                sweep_passes=sweep_passes,
                protected_tokens=self.kv_slots_in_use(),
            )
        self.stats.maybe_log(
            step=step,
            kernel_counters=kernel_counters,
            slot_counters=slot_counters,
            violations=self.violations.total,
            sweep_passes=sweep_passes,
            host_tier=host_tier,
        )
        self.health.check(step=step, kernel_counters=kernel_counters)
        if self.swa_divergence.enabled:
            for sfm_index, plan_enabled in plans_enabled.items():
                self.swa_divergence.consume(
                    num_valid=host.swa_verify_num_valid[sfm_index],
                    plan_enabled=plan_enabled,
                    step=step,
                    sfm_index=sfm_index,
                )

    def report(self, incidents, *, dropped: int, step: int, requests: ForwardRequests) -> None:
        """Name the requests each incident touches, count it, contain it (abort mode), then
        report it (raise mode raises here, after the counters moved). Only on a step with an
        incident; it may wait for the device (docs/architecture.md, "Violation
        pipeline")."""
        with violation_path_sync(self._device):
            self._report_synced(incidents, dropped=dropped, step=step, requests=requests)

    def _report_synced(
        self, incidents, *, dropped: int, step: int, requests: ForwardRequests
    ) -> None:
        touched = self.requests.resolve(incidents, requests)
        if any(t.faked_transfer for t in touched):
            self._set_aside_faked_transfers(
                [inc for inc, t in zip(incidents, touched) if t.faked_transfer]
            )
            kept = [(inc, t) for inc, t in zip(incidents, touched) if not t.faked_transfer]
            incidents, touched = [k[0] for k in kept], [k[1] for k in kept]
            if not incidents and not dropped:
                return
        incidents = [dataclasses.replace(inc, rids=t.rids) for inc, t in zip(incidents, touched)]
        if self.metrics is not None:
            self.metrics.on_incidents(incidents, dropped=dropped, pool=self.pool)
        if self.containment is not None:
            aborted = self.containment.contain(incidents, touched, step=step)
            if self.metrics is not None:
                self.metrics.on_aborted(aborted)
        self.violations.report(incidents, dropped=dropped, step=step)

    def _set_aside_faked_transfers(self, incidents: Sequence) -> None:
        """A PD decode server's reads of requests whose KV transfer sglang faked (its warm-up,
        ``/health_generate``): nothing was sent to those slots, so what they hold is no fault.
        Taken out of the violation counts, counted apart, logged once."""
        self.violations.set_aside(incidents)
        if self.violations.set_aside_incidents == len(incidents):
            logger.info(
                "kv_canary: %d slot(s) read by requests whose KV transfer sglang fakes (bootstrap "
                "host %s: the warm-up request, /health_generate) are not reported: nothing was "
                "sent for them. A transfer of any other request that delivers nothing is "
                "reported (logged once; count: ViolationManager.set_aside_incidents)",
                len(incidents),
                sglang_seam.fake_bootstrap_host(),
            )

    def apply_notices(self, notices: Sequence[ContainmentNotice]) -> None:
        """Abort mode on several ranks: contain what the notices for this pool (``target`` /
        ``draft``) ask, at the iteration every rank received them."""
        if self.containment is None:
            return
        for notice in notices:
            if notice.pool == self.pool:
                aborted = self.containment.apply(notice)
                if self.metrics is not None:
                    self.metrics.on_aborted(aborted)

    def before_batch_result(self) -> None:
        """Heal mode, before the scheduler processes a batch result: take back the requests
        its reports marked (metrics of the heals)."""
        if self.containment is None:
            return
        took = self.containment.before_batch_result()
        if self.metrics is not None:
            if took.healed:
                self.metrics.on_healed(took.healed)
            if took.aborted:
                self.metrics.on_aborted(took.aborted)

    def after_batch_result(self, *, launched_step: int) -> None:
        """Abort and heal mode, after the scheduler processed a batch result: evict the
        corrupt prefixes it can now, queue healed requests again (metrics of the aborts and
        the release guard)."""
        if self.containment is None:
            return
        aborted = self.containment.after_batch_result(launched_step=launched_step)
        guard = self.containment.guard
        if self.metrics is not None:
            self.metrics.on_aborted(aborted)
            if self.containment.heals:
                self.metrics.set_retired(self.containment.retired_slots)
                self.metrics.on_heal_seconds(self.containment.take_heal_seconds())
            if guard is not None:
                self.metrics.on_release_guard(
                    held_back_slots=guard.held_back_slots, reclaimed_slots=guard.reclaimed_slots
                )
