"""The scheduler's side of ``CanaryManager`` (docs/architecture.md, "Runtime"; docs/subsystems.md,
"Containment"): what the scheduler hands over at its start-up (tree cache, running requests,
metrics, PD transfer fakes), abort mode's work after each batch result, the canary's memory,
and the read-back's consumers (:class:`~sglang.srt.kv_canary.manager.reporting.ForwardReporter`)
by name. Host only, at start-up and between forwards.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Sequence

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.memory import CanaryMemory, host_mirror_bytes_per_slot
from sglang.srt.kv_canary.violations.containment import ContainmentManager
from sglang.srt.kv_canary.violations.rank_relay import (
    ContainmentNotice,
    RankAgreement,
    RankRelay,
    connect_input,
)
from sglang.srt.kv_canary.manager.health import KernelRunCounterHealthChecker
from sglang.srt.kv_canary.manager.hicache import HostTierMirror
from sglang.srt.kv_canary.violations.metrics import CanaryMetrics
from sglang.srt.kv_canary.manager.overflow import VerifyOverflowWarner
from sglang.srt.kv_canary.violations.resolver import RequestResolver
from sglang.srt.kv_canary.manager.stats import PeriodicCanaryStatsLogger
from sglang.srt.kv_canary.violations.reporter import ViolationManager


class SchedulerSide:
    """``CanaryManager``'s scheduler-facing part (a base class of it: it uses the manager's
    ``reporter``, ``sweep``, ``groups``, ``config``, ``ranks``, ``host_tier``,
    ``device_host``, ``step``, ``_staged``, ``_on_host_copies`` and ``_tree_cache``, set in
    its ``__init__``)."""

    @property
    def violations(self) -> ViolationManager:
        return self.reporter.violations

    @property
    def requests(self) -> RequestResolver:
        return self.reporter.requests

    @property
    def containment(self) -> Optional[ContainmentManager]:
        return self.reporter.containment

    @property
    def metrics(self) -> Optional[CanaryMetrics]:
        return self.reporter.metrics

    @property
    def health(self) -> KernelRunCounterHealthChecker:
        return self.reporter.health

    @property
    def stats(self) -> PeriodicCanaryStatsLogger:
        return self.reporter.stats

    @property
    def overflow(self) -> VerifyOverflowWarner:
        return self.reporter.overflow

    def attach_radix_cache(self, radix_cache) -> None:
        """Hand over the scheduler's tree cache (for the sweep, and abort mode's eviction,
        which refuses a cache it cannot evict from)."""
        if self.containment is not None:
            self.containment.attach_radix_cache(radix_cache)
        self.sweep.attach_radix_cache(radix_cache)
        # no tree (ChunkCache): nothing cached for the self-tests' cache faults either
        self._tree_cache = (
            None if radix_cache is None or sglang_seam.is_chunk_cache(radix_cache) else radix_cache
        )
        if not self.ranks.draft:
            # a draft pool's host pool exists only later: attach_draft_host_tier
            self._mirror_host_tier(sglang_seam.hicache_host_pool(radix_cache))

    def attach_draft_host_tier(self, radix_cache) -> bool:
        """A speculative draft canary with HiCache: mirror its rows in the host pool sglang
        registered for this canary's pool (after ``Scheduler._maybe_register_hicache_draft``;
        one host slot per target host slot, copied in the target's backups and loads). False
        where sglang registered no host pool for this pool: the draft KV of prefixes loaded
        back from host memory is then not restored (docs/user_guide.md, "HiCache")."""
        device_pool, host_pool = sglang_seam.hicache_draft_pools(radix_cache)
        if host_pool is None or sglang_seam.pool_canary(device_pool) is not self:
            return False
        self._mirror_host_tier(host_pool)
        return True

    def _mirror_host_tier(self, host_pool) -> None:
        if host_pool is not None and self.host_tier is None:
            self.host_tier = HostTierMirror(
                groups=self.groups,
                host_pool=host_pool,
                real_kv_hash_mode=self.config.real_kv_hash_mode,
                sweep_pages=self.config.host_sweep_pages if self.config.sweep_interval else 0,
            )

    @property
    def host_mirror_bytes_per_slot(self) -> int:
        """Bytes HiCache's host tier keeps per host slot for this canary."""
        return host_mirror_bytes_per_slot(self._memory_inputs.groups)

    @property
    def memory(self) -> CanaryMemory:
        """What this canary holds, by part (docs/user_guide.md, "Memory"); with HiCache, the
        host mirror once the scheduler has attached its tree."""
        inputs = self._memory_inputs
        if self.host_tier is not None:
            inputs = dataclasses.replace(inputs, host_mirror_slots=self.host_tier.host_slots)
        return CanaryMemory.for_inputs(inputs)

    def attach_scheduler(
        self,
        *,
        radix_cache,
        running_reqs: Callable[[], Sequence],
        metrics_labels: Optional[Dict[str, object]],
        kv_slots_in_use: Callable[[], int],
        metrics_registry=None,
        metrics_of: Optional["SchedulerSide"] = None,
        faked_transfer: Optional[Callable[[object], bool]] = None,
        retraction: Optional["sglang_seam.SchedulerRetraction"] = None,
    ) -> None:
        """The scheduler's side, at its start-up: its tree cache, its running requests (to
        name and abort), its metric labels (None: metrics off; ``metrics_registry``: a
        ``prometheus_client`` registry other than the process's, for tests) and its count of
        KV slots in use (the protected-tokens gauge). ``metrics_of``: the scheduler's first
        canary (an EAGLE draft pool's canary counts into the target's series).
        ``faked_transfer``: whether sglang faked a request's KV transfer (a PD decode server:
        reads of such a request's slots are set aside, not reported). ``retraction``: the
        scheduler's retraction of running requests (heal mode takes requests back through
        it)."""
        self.attach_radix_cache(radix_cache)
        if retraction is not None and self.containment is not None and self.containment.heals:
            self.containment.attach_retraction(retraction)
        self.requests.running_reqs = running_reqs
        if faked_transfer is not None:
            self.requests.faked_transfer = faked_transfer
        reporter = self.reporter
        reporter.kv_slots_in_use = kv_slots_in_use
        if reporter.metrics is not None:
            return
        if metrics_of is not None:
            reporter.metrics = metrics_of.metrics.sibling() if metrics_of.metrics else None
        elif metrics_labels is not None:
            reporter.metrics = CanaryMetrics(metrics_labels, registry=metrics_registry)
        if reporter.metrics is not None:
            reporter.metrics.set_memory(self.memory, draft=self.ranks.draft)

    def attach_ranks(self, group: "sglang_seam.SchedulerRankGroup") -> None:
        """Several TP ranks, at the scheduler's start-up on every rank (abort mode; nothing
        to do otherwise): this canary's relay bound, the endpoints exchanged, TP rank 0's
        scheduler input connected to every rank's relay, the containment's agreements made
        over the group (docs/multi_rank_abort_design.md)."""
        if self.containment is None:
            return
        relay = RankRelay(origin=self.ranks.describe_rank(), pool=self.reporter.pool)
        endpoints = group.gather(relay.endpoint)
        if group.input_socket is not None:
            connect_input(group.input_socket, endpoints)
        self.containment.attach_ranks(relay, RankAgreement(group.gather, group.size))

    def apply_containment_notices(self, notices: Sequence[ContainmentNotice]) -> None:
        """The notices of this iteration's inputs (every rank gets the same): abort mode's
        containment of what one rank reported."""
        self.reporter.apply_notices(notices)

    def tag_batch_result(self, result) -> None:
        """Heal mode, after the scheduler launched a batch: its result object remembers this
        canary's step of the forward that computes it. No-op otherwise."""
        if self.containment is not None and self.containment.heals:
            sglang_seam.tag_result_forward_step(result, self.step)

    def before_batch_result(self, result=None) -> None:
        """Before the scheduler processes a batch result: heal mode takes back the requests
        its reports marked, so sglang appends no token of theirs from this result. When the
        forward that computed ``result`` is still the one whose read-back is pending (no
        later forward was launched to consume it: the last batch before a quiet period, or a
        batch processed before the next launch), that read-back is consumed first: the host
        waits for its copy, so no token of a forward is kept before its checks are read.
        No-op in the other modes."""
        containment = self.containment
        if containment is None or not containment.heals:
            return
        step = sglang_seam.result_forward_step(result)
        staged = self._staged
        if step is not None and staged is not None and staged.step == step:
            self.device_host.consume(self._on_host_copies)
        self.reporter.before_batch_result()

    def after_batch_result(self) -> None:
        """After the scheduler processed a batch result (finished requests released their
        KV): abort mode evicts the corrupt prefixes it can now. No-op otherwise."""
        self.reporter.after_batch_result(launched_step=self.step)

    def on_scheduler_idle(self) -> None:
        """The scheduler's loop ran no batch this iteration (sglang's ``Scheduler.on_idle``):
        the last forward's read-back, which the next forward would otherwise consume, is
        reported now, with abort mode's containment and eviction, so a violation read by the
        last forward before a quiet period is not held back until the next request
        (docs/architecture.md, "Reading results"). The host waits for that read-back's copy
        (its forward has run); nothing to do when none is pending. Host only, between
        forwards."""
        containment = self.containment
        if self.device_host.consume(self._on_host_copies) or (
            containment is not None and containment.heal_pending
        ):
            self.reporter.before_batch_result()
            self.reporter.after_batch_result(launched_step=self.step)

    @property
    def retired_slots(self) -> int:
        """Heal mode: KV slots retired and out of the allocator (0 otherwise)."""
        containment = self.containment
        return containment.retired_slots if containment is not None else 0

    @property
    def radix_cache(self):
        """The scheduler's radix tree once attached (None before, and for a server without
        one)."""
        return self._tree_cache

    @property
    def sweep_passes(self) -> int:
        return self.sweep.sweep_passes
