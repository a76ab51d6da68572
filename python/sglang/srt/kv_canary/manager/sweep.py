"""``SweepOrchestrator``: every N forwards, verify every slot the radix cache holds
(docs/subsystems.md, "Radix sweep").

Per-forward checks only see slots that running requests read; KV idle in the radix cache
could rot unseen until a later request hits it. Runs after a forward, outside any graph, over
every buffer group with its SWEEP endpoints (which verify the TAIL records, with the real-KV
fingerprint when ``--kv-canary-real-data`` is on, and every layer's with
``--kv-canary-real-data-layers all``). One plan buffer is reused across passes and
large caches are verified in chunks of its capacity.
"""

from __future__ import annotations

import logging
from typing import Sequence

from sglang.jit_kernel.kv_canary.types import CanaryPhase, PoolKind, VerifyPlan
from sglang.jit_kernel.kv_canary.verify import launch_canary_verify_kernel
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.capacities import SWEEP_CHUNK_CAPACITY
from sglang.srt.kv_canary.endpoint import CanaryEndpoint
from sglang.srt.kv_canary.radix_cache_walker import walk_radix_cache_for_canary
from sglang.srt.kv_canary.single_forward_manager.launches import launch_deep_verify
from sglang.srt.kv_canary.sweep_plan_builder import build_verify_plan_radix_sweep

logger = logging.getLogger(__name__)


class SweepOrchestrator:
    def __init__(
        self,
        *,
        interval: int,
        endpoints: Sequence[CanaryEndpoint],
        device,
        chunk_capacity: int = SWEEP_CHUNK_CAPACITY,
    ):
        self.interval = interval
        self.endpoints = [ep for ep in endpoints if ep.phase == CanaryPhase.SWEEP]
        self.sweep_passes = 0
        self.radix_cache = None
        self._last_sweep_step = None
        self.plan = (
            VerifyPlan.allocate(verify_capacity=chunk_capacity, device=device)
            if interval > 0
            else None
        )

    def attach_radix_cache(self, radix_cache) -> None:
        """The scheduler's tree cache (start-up). Without a radix cache (``ChunkCache``: no
        slot stays cached after its request) there is nothing to sweep: the sweep stays off
        and a warning says so. A tree the walker cannot read stops start-up, naming it."""
        self.radix_cache = None
        if self.interval <= 0 or radix_cache is None:
            return
        if seam.is_chunk_cache(radix_cache):
            logger.warning(
                "kv_canary: --kv-canary-sweep-interval %d has nothing to sweep: this server "
                "runs without a radix cache (%s: --disable-radix-cache, or a PD decode "
                "server's default), so no slot stays cached after its request; the "
                "per-forward checks still run",
                self.interval,
                type(radix_cache).__name__,
            )
            return
        supported = seam.radix_cache_types()
        if not isinstance(radix_cache, supported):
            raise NotImplementedError(
                f"--kv-canary-sweep-interval cannot walk {type(radix_cache).__name__} "
                f"(supported: {', '.join(t.__name__ for t in supported)}); set "
                "--kv-canary-sweep-interval 0 or use one of those trees"
            )
        self.radix_cache = radix_cache

    def maybe_run_sweep(self, step: int) -> bool:
        """Sweep if enabled, a cache is attached, and ``interval`` steps have passed since the
        last sweep (the first call sweeps). Returns whether it swept."""
        if self.interval <= 0 or self.radix_cache is None:
            return False
        if self._last_sweep_step is not None and step - self._last_sweep_step < self.interval:
            return False
        self._last_sweep_step = step
        self.run_sweep()
        return True

    def run_sweep(self) -> None:
        # HiCache: slots a queued host -> device load fills are in the tree already
        seam.hicache_wait_for_loads(self.radix_cache)
        walks = {}
        for ep in self.endpoints:
            swa = ep.group.kind == PoolKind.SWA
            if swa not in walks:
                walks[swa] = walk_radix_cache_for_canary(
                    radix_cache=self.radix_cache, swa_resident_only=swa
                )
            walk = walks[swa]
            start = 0
            while start < walk.num_slots:
                start += build_verify_plan_radix_sweep(
                    walk=walk, plan_out=self.plan, start=start, swa_index_lut=ep.group.swa_index_lut
                )
                launch_canary_verify_kernel(
                    context=ep.context, plan=self.plan, check_verify_expected_token=False
                )
                launch_deep_verify(ep, self.plan, rotate=False)  # every layer, if on
        self.sweep_passes += 1
