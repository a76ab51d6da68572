"""``CanaryManager``: owns the device state, endpoints and single-forward managers of one model
runner and does the after-forward work (docs/architecture.md, "Runtime"). Built by
:func:`~sglang.srt.kv_canary.builder.build_canary`; the plugin's hooks drive it per forward::

    with manager.with_active_single_forward_manager(0):
        with manager.with_ops_outside_graph(forward_batch):
            # eager: the wrapped model.forward calls manager.pre_ops_maybe_inside_graph(fb),
            #   the model, manager.post_ops_maybe_inside_graph(fb)
            # CUDA-graph replay: manager.before_graph_replay(); the graph holds those
            #   launches; then manager.mark_replayed_inside_graph()

and around each CUDA-graph capture: ``with manager.with_active_single_forward_manager(i),
manager.capturing(): ...``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING, Callable, Dict, Optional, Sequence, Tuple

import torch

from sglang.jit_kernel.kv_canary.types import CanaryPhase, PoolKind
from sglang.srt.kv_canary.batch_state import (
    NO_FORWARD_REQUESTS,
    ForwardRequests,
    batch_state,
    batch_state_for,
)
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.capacities import REPLAY_TOKENS_PER_REQUEST, CanaryLaunchCapacities
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode
from sglang.srt.kv_canary.endpoint import build_endpoints_from_group
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.memory import (
    CanaryMemory,
    CanaryMemoryInputs,
    host_mirror_bytes_per_slot,
)
from sglang.srt.kv_canary.perturb import CanaryPerturber
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.runner.containment import ContainmentManager
from sglang.srt.kv_canary.runner.device_host import DelayedDeviceHostHandler
from sglang.srt.kv_canary.runner.health import KernelRunCounterHealthChecker
from sglang.srt.kv_canary.runner.hicache import HostTierMirror
from sglang.srt.kv_canary.runner.metrics import CanaryMetrics
from sglang.srt.kv_canary.runner.overflow import VerifyOverflowWarner
from sglang.srt.kv_canary.runner.requests import RequestResolver, violation_path_sync
from sglang.srt.kv_canary.runner.stats import PeriodicCanaryStatsLogger
from sglang.srt.kv_canary.runner.swa_divergence import SwaDivergenceReporter
from sglang.srt.kv_canary.runner.sweep import SweepOrchestrator
from sglang.srt.kv_canary.runner.violation import ViolationManager, ViolationReporter
from sglang.srt.kv_canary.single_forward_manager import SfmStatus, SingleForwardManager
from sglang.srt.kv_canary.state import CanaryDeviceState
from sglang.srt.kv_canary.token_history import TokenHistoryUploader
from sglang.srt.kv_canary.token_oracle.manager import TokenOracleManager

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ForwardBatch

logger = logging.getLogger(__name__)

# the reports of an EAGLE draft runner's canary name its pool
DRAFT_POOL_LABEL = (
    "the EAGLE draft model's KV pool (its position p holds the KV computed from token p + 1)"
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


def _lasting_rows(forward_batch: "ForwardBatch") -> frozenset:
    """The rows of the batch's requests with more than two tokens left to generate (they
    outlive the forward after this one, which reads this one's reports)."""
    requests = batch_state_for(forward_batch).requests
    if requests is None:
        return frozenset()
    return frozenset(
        row
        for req, row in zip(requests.reqs, requests.rows)
        if row is not None and sglang_seam.req_tokens_left(req) > 2
    )


@dataclasses.dataclass(frozen=True, eq=False)
class StagedForward:
    """The forward whose read-back is staged: its step, single-forward managers (one, or a
    replayed EAGLE draft round's) and requests."""

    step: int
    sfm_indices: Tuple[int, ...]
    requests: ForwardRequests


@dataclasses.dataclass(eq=False)
class DraftRound:
    """An EAGLE draft round in progress (:meth:`CanaryManager.with_draft_round`): whether it is
    being captured into the draft CUDA graph, and the index of its next forward (= the
    single-forward manager that forward uses)."""

    capturing: bool
    next_forward: int = 0


class CanaryManager:
    """One per guarded model runner. ``groups``: the pool's buffer groups; ``capacities``:
    the per-forward buffer sizes; ``req_to_token``: the runner's int32 ``[rows,
    max_context_len]`` table; ``token_oracle``: required with the write-input check."""

    def __init__(
        self,
        *,
        config: CanaryConfig,
        groups: Sequence[CanaryBufferGroup],
        capacities: CanaryLaunchCapacities,
        req_to_token: torch.Tensor,
        device,
        num_single_forward_managers: int = 1,
        draft_forwards_per_round: int = 0,
        token_oracle: Optional[TokenOracleManager] = None,
        memory_inputs: CanaryMemoryInputs,
        ranks: RankFacts = RankFacts(),
        kv_pool=None,
    ):
        if not config.enabled:
            raise ValueError("CanaryManager needs --kv-canary log, raise or abort (got none)")
        if not groups:
            raise ValueError("CanaryManager needs at least one buffer group")
        if num_single_forward_managers < 1:
            raise ValueError("num_single_forward_managers must be >= 1")
        if not 0 <= draft_forwards_per_round <= num_single_forward_managers:
            raise ValueError(
                f"draft_forwards_per_round must be in [0, "
                f"{num_single_forward_managers}] (one single-forward manager per "
                f"draft forward), got {draft_forwards_per_round}"
            )
        if config.enable_write_input_assert and token_oracle is None:
            raise ValueError(
                "enable_write_input_assert needs a TokenOracleManager (token_oracle=...)"
            )
        device = torch.device(device)
        self._device = device
        self.config = config
        # what this canary allocates (the builder's description; HiCache's host mirror added
        # when the scheduler attaches its tree): :attr:`memory`
        self._memory_inputs = memory_inputs
        self.capacities = capacities
        self.groups = tuple(groups)
        self.state = CanaryDeviceState.allocate(
            ring_capacity=config.ring_capacity,
            device=device,
            expected_token_pool_shape=(
                tuple(req_to_token.shape) if config.enable_verify_token_assert else None
            ),
        )
        # the one owner of the expected-token pool's contents (token checks on)
        self.token_history = (
            TokenHistoryUploader(
                self.state.req_to_verify_expected_tokens,
                replay_rows=capacities.write_req_capacity,
                replay_tokens=max(
                    REPLAY_TOKENS_PER_REQUEST * capacities.write_req_capacity,
                    capacities.write_entry_capacity,
                ),
            )
            if config.enable_verify_token_assert
            else None
        )
        self.endpoints = tuple(
            ep
            for g in self.groups
            for ep in build_endpoints_from_group(group=g, state=self.state, config=config)
        )
        self.token_oracle = token_oracle
        self.sfms = tuple(
            SingleForwardManager(
                groups=self.groups,
                endpoints=self.endpoints,
                state=self.state,
                capacities=capacities,
                config=config,
                req_to_token=req_to_token,
                device=device,
                index=i,
                token_history=self.token_history,
                token_oracle=token_oracle,
                kv_pool=kv_pool,
            )
            for i in range(num_single_forward_managers)
        )
        # fault injection (self-tests only): off unless a SGLANG_KV_CANARY_PERTURB_* is set
        self.perturber: Optional[CanaryPerturber] = None
        self.host_tier: Optional[HostTierMirror] = None  # with HiCache, once the tree exists
        self.ranks = ranks
        if config.perturb.injects_on(ranks):  # SGLANG_KV_CANARY_PERTURB_*_RANK match
            self.perturber = CanaryPerturber(
                config=config.perturb,
                groups=self.groups,
                req_to_token=req_to_token,
                radix_cache=lambda: self.radix_cache,
                draft=ranks.draft,
                page_size=(sglang_seam.kv_pool_page_size(kv_pool) if kv_pool is not None else 1),
            )
            if token_oracle is not None:
                token_oracle.after_sample = self.perturber.swap_next_tokens
        self.swa_divergence = SwaDivergenceReporter(
            interval=config.swa_divergence_stats_interval,
            sfm_plans=[
                [(g.kind, sfm.plans[g].verify_plan) for g in sfm.groups] for sfm in self.sfms
            ],
        )
        log = self.state.violation_log
        self.device_host = DelayedDeviceHostHandler(
            CanaryReadback(
                violation_write_index=log.violation_write_index,
                violation_ring=log.violation_ring,
                kernel_run_counters=self.state.kernel_run_counters,
                slot_run_counters=self.state.slot_run_counters,
                sfm_status=tuple(sfm.status for sfm in self.sfms),
                swa_verify_num_valid=self.swa_divergence.device_tensors(),
            ),
            zero_after_copy=(log.violation_write_index,),
        )
        self.violations = ViolationManager(
            reporter=ViolationReporter(
                config.mode,
                pool=DRAFT_POOL_LABEL if ranks.draft else "",
                rank=ranks.describe_rank() if ranks.several else "",
                server=ranks.server_role,
            ),
            ring_capacity=config.ring_capacity,
        )
        self.health = KernelRunCounterHealthChecker(
            expected_tags=[
                ep.tag for ep in self.endpoints if ep.phase in (CanaryPhase.HEAD, CanaryPhase.TAIL)
            ]
        )
        self.stats = PeriodicCanaryStatsLogger(every_n_steps=config.stats_print_every_n_steps)
        self.overflow = VerifyOverflowWarner(verify_capacity=capacities.verify_capacity)
        self.sweep = SweepOrchestrator(
            interval=config.sweep_interval, endpoints=self.endpoints, device=device
        )
        self._tree_cache = None  # the scheduler's radix tree (attach_radix_cache)
        # who a violation touches (rids=), abort mode's containment, Prometheus (attached
        # with the scheduler: attach_scheduler)
        swa_lut = next((g.swa_index_lut for g in self.groups if g.kind == PoolKind.SWA), None)
        self.requests = RequestResolver(req_to_token=req_to_token, swa_index_lut=swa_lut)
        self.containment = None
        if config.mode == CanaryMode.ABORT:
            full = next((g for g in self.groups if g.kind == PoolKind.FULL), None)
            if full is None:  # every adapter builds one; a new one must too
                raise ValueError(
                    "--kv-canary abort needs the pool's full-attention buffer "
                    "group (its records say which request owns a slot)"
                )
            self.containment = ContainmentManager(
                resolver=self.requests, swa_index_lut=swa_lut, records=full.k_tail
            )
        self.metrics: Optional[CanaryMetrics] = None
        self._kv_slots_in_use: Callable[[], int] = lambda: 0
        self.step = 0
        self._active: Optional[SingleForwardManager] = None
        # EAGLE draft worker: forwards per draft round (0 elsewhere), the round in progress,
        # and whether the draft graph runner is capturing
        self.draft_forwards_per_round = draft_forwards_per_round
        self._draft_round: Optional[DraftRound] = None
        self._capturing_draft_graph = False
        # sglang's piecewise CUDA-graph set-up in progress (its dummy forwards run no canary)
        self._piecewise_graph_setup = False
        self._staged: Optional[StagedForward] = None

    # ---- which single-forward manager is active ----------------------------------------

    @contextlib.contextmanager
    def with_active_single_forward_manager(self, index: int):
        if not 0 <= index < len(self.sfms):
            raise IndexError(
                f"single-forward manager {index} does not exist ({len(self.sfms)} configured)"
            )
        if self._active is not None:
            raise RuntimeError(
                f"kv_canary: single-forward manager {index} activated while "
                f"{self._active.index} is active (nesting is not allowed)"
            )
        self._active = self.sfms[index]
        try:
            yield self._active
        finally:
            self._active = None

    @property
    def active_sfm(self) -> SingleForwardManager:
        if self._active is None:
            raise RuntimeError(
                "kv_canary: no single-forward manager is active (missing "
                "with_active_single_forward_manager around the forward)"
            )
        return self._active

    # ---- per-forward ops -------------------------------------------------------------------

    @contextlib.contextmanager
    def with_ops_outside_graph(self, forward_batch: "ForwardBatch"):
        """The outside-graph bracket of one forward. A forward that raises (in the canary's
        own pre-ops, e.g. a capacity check, or in the model) leaves the single-forward manager
        IDLE, so the next forward starts clean and reports its own error."""
        sfm = self.active_sfm
        with self._outside_graph((sfm,), forward_batch, replayed=False):
            yield sfm

    @contextlib.contextmanager
    def _outside_graph(
        self, sfms: Sequence[SingleForwardManager], forward_batch: "ForwardBatch", *, replayed: bool
    ):
        """The outside ops of the forwards one model call runs (one, or a replayed draft
        round's), then one read-back; ``replayed``: their inside ops ran in a CUDA graph."""
        # this forward's kernels queue after last step's read-back (and the ring's reset)
        self.device_host.fence()
        if self.perturber is not None:
            self.perturber.before_forward(
                forward_batch, step=self.step + 1, lasting_rows=lambda: _lasting_rows(forward_batch)
            )
        try:
            for sfm in sfms:
                sfm.pre_ops_outside_graph(forward_batch)
                if replayed:  # a draft round's graph: its replay reads the tokens
                    sfm.upload_tokens_before_replay()
            yield
        except BaseException:
            for sfm in sfms:
                sfm.abort()
            raise
        for sfm in sfms:
            if replayed:
                sfm.mark_replayed_inside_graph()
            sfm.post_ops_outside_graph()
        self.after_forward(sfms, forward_batch)

    def pre_ops_maybe_inside_graph(self, forward_batch: "ForwardBatch") -> None:
        if not self._piecewise_graph_setup:
            self.active_sfm.pre_ops_maybe_inside_graph(forward_batch)

    def post_ops_maybe_inside_graph(self, forward_batch: "ForwardBatch") -> None:
        if not self._piecewise_graph_setup:
            self.active_sfm.post_ops_maybe_inside_graph(forward_batch)

    @contextlib.contextmanager
    def piecewise_graph_setup(self):
        """Around sglang's piecewise CUDA-graph set-up (warm-up and capture of the layers):
        the ``model.forward`` calls it makes carry dummy batches outside any forward bracket,
        so the inside ops skip them. Nothing of the canary is captured in the pieces: a
        piecewise replay runs the canary's launches eagerly, around the replayed pieces."""
        if self._active is not None:
            raise RuntimeError(
                "kv_canary: piecewise CUDA-graph set-up inside a forward "
                f"(single-forward manager {self._active.index} is active)"
            )
        self._piecewise_graph_setup = True
        try:
            yield
        finally:
            self._piecewise_graph_setup = False

    def before_graph_replay(self) -> None:
        """Right before a CUDA graph replays the active single-forward manager's inside ops
        (the replay hooks call it): the work those ops read that an eager forward leaves
        until after the model's launches (the token-history upload)."""
        self.active_sfm.upload_tokens_before_replay()

    def mark_replayed_inside_graph(self) -> None:
        self.active_sfm.mark_replayed_inside_graph()

    def capturing(self):
        """Context for a CUDA-graph capture of the active single-forward manager."""
        return self.active_sfm.capturing()

    # ---- EAGLE draft rounds ------------------------------------------------------------------
    #
    # A draft round is sglang's ``draft_forward``: ``draft_forwards_per_round`` (= speculative
    # steps - 1) draft-model forwards in one loop, each writing one draft token per request
    # after the previous one's. Eager, each forward is bracketed like any other (its own
    # single-forward manager, outside ops and read-back); in the draft CUDA graph the loop is
    # captured whole, so forward i's inside ops are captured with single-forward manager i, and
    # a replay brackets all of them at once (:meth:`with_replayed_draft_round`).

    @contextlib.contextmanager
    def with_draft_round(self):
        """Around one ``draft_forward`` call (eager, or inside the draft graph's capture)."""
        if self._draft_round is not None:
            raise RuntimeError("kv_canary: an EAGLE draft round started inside another one")
        self._draft_round = DraftRound(capturing=self._capturing_draft_graph)
        try:
            yield self._draft_round
        finally:
            self._draft_round = None

    @property
    def in_draft_round(self) -> bool:
        return self._draft_round is not None

    @contextlib.contextmanager
    def with_draft_forward(self, forward_batch: "ForwardBatch"):
        """Around one draft-model forward of the round in progress: the next single-forward
        manager, captured (inside the draft graph's capture) or bracketed as an eager
        forward."""
        draft_round = self._draft_round
        if draft_round is None:
            raise RuntimeError("kv_canary: a draft forward outside an EAGLE draft round")
        index = draft_round.next_forward
        if index >= self.draft_forwards_per_round:
            raise RuntimeError(
                f"kv_canary: EAGLE draft round ran more than {self.draft_forwards_per_round} "
                "draft forwards (--speculative-num-steps - 1, which sized the canary)"
            )
        draft_round.next_forward += 1
        with self.with_active_single_forward_manager(index):
            if draft_round.capturing:
                with self.capturing():
                    yield
            else:
                with self.with_ops_outside_graph(forward_batch):
                    yield

    @contextlib.contextmanager
    def capturing_draft_graph(self):
        """Around the draft CUDA-graph runner's capture of one batch size: the draft rounds
        run in it (sglang's warm-up runs and the capture) only record the inside ops."""
        self._capturing_draft_graph = True
        try:
            yield
        finally:
            self._capturing_draft_graph = False

    @contextlib.contextmanager
    def with_replayed_draft_round(self, forward_batch: "ForwardBatch"):
        """Around a replay of the draft CUDA graph (one whole draft round): the outside ops
        of every draft forward it holds, then one read-back for the round. No-op with a
        single speculative step (the round runs no draft forward)."""
        sfms = self.sfms[: self.draft_forwards_per_round]
        if not sfms:
            yield
            return
        with self._outside_graph(sfms, forward_batch, replayed=True):
            yield

    # ---- lifecycle ---------------------------------------------------------------------------

    def mark_init_finished(self) -> None:
        """End of warm-up and graph capture: turn the chain-position check on; on CUDA,
        capture the read-back's copies and each single-forward manager's eager-forward graphs
        (its launches for the forwards no sglang graph holds: prefills, large decode
        batches)."""
        self.state.mark_init_finished()
        if self._device.type == "cuda":
            if not self.device_host.captured:
                self.device_host.capture()
            for sfm in self.sfms:
                if sfm.eager_graphs is None:
                    sfm.enable_static_eager_launches(capture_graphs=True)

    def on_forward_batch_init(self, forward_batch: "ForwardBatch", reqs) -> None:
        """The ``ForwardBatch.init_new`` hook (host only): the batch's requests and their rows
        (for the reports' ``rids=``), token-id snapshot (token checks on) and the token
        oracle's rows (oracle on), in the batch's canary state."""
        state = batch_state_for(forward_batch)
        state.requests = ForwardRequests.of(reqs)
        if self.token_history is None and self.token_oracle is None:
            return
        if (
            self.ranks.draft
            and self.draft_forwards_per_round == 0
            and forward_batch.forward_mode == sglang_seam.ForwardMode.DECODE
        ):
            return  # a one-step draft round runs no draft forward: nothing to attach
        if self.token_history is not None:
            self.token_history.defer_snapshot(state, reqs)
        if self.token_oracle is not None:
            self.token_oracle.attach_batch(forward_batch, state, reqs)

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
        host_pool = sglang_seam.hicache_host_pool(radix_cache)
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
        metrics_of: Optional["CanaryManager"] = None,
        faked_transfer: Optional[Callable[[object], bool]] = None,
    ) -> None:
        """The scheduler's side, at its start-up: its tree cache, its running requests (to
        name and abort), its metric labels (None: metrics off; ``metrics_registry``: a
        ``prometheus_client`` registry other than the process's, for tests) and its count of
        KV slots in use (the protected-tokens gauge). ``metrics_of``: the scheduler's first
        canary (an EAGLE draft pool's canary counts into the target's series).
        ``faked_transfer``: whether sglang faked a request's KV transfer (a PD decode server:
        reads of such a request's slots are set aside, not reported)."""
        self.attach_radix_cache(radix_cache)
        self.requests.running_reqs = running_reqs
        if faked_transfer is not None:
            self.requests.faked_transfer = faked_transfer
        self._kv_slots_in_use = kv_slots_in_use
        if self.metrics is not None:
            return
        if metrics_of is not None:
            self.metrics = metrics_of.metrics.sibling() if metrics_of.metrics else None
        elif metrics_labels is not None:
            self.metrics = CanaryMetrics(metrics_labels, registry=metrics_registry)
        if self.metrics is not None:
            self.metrics.set_memory(self.memory, draft=self.ranks.draft)

    def after_batch_result(self) -> None:
        """After the scheduler processed a batch result (finished requests released their
        KV): abort mode evicts the corrupt prefixes it can now. No-op otherwise."""
        if self.containment is not None:
            aborted = self.containment.after_batch_result()
            guard = self.containment.guard
            if self.metrics is not None:
                self.metrics.on_aborted(aborted)
                if guard is not None:
                    self.metrics.on_release_guard(
                        held_back_slots=guard.held_back_slots, reclaimed_slots=guard.reclaimed_slots
                    )

    @property
    def radix_cache(self):
        """The scheduler's radix tree once attached (None before, and for a server without
        one)."""
        return self._tree_cache

    @property
    def sweep_passes(self) -> int:
        return self.sweep.sweep_passes

    # ---- after each forward ----------------------------------------------------------------

    def after_forward(
        self, sfms: Sequence[SingleForwardManager], forward_batch: Optional["ForwardBatch"] = None
    ) -> None:
        """Step counter, fault injection (self-tests only; before the sweep so that a fault
        in an idle cached slot is swept this step), the radix sweep (when due), then the
        delayed violation / overflow / health / stats pump: on CUDA the copies staged after
        the previous forward are consumed and this forward's are staged (never syncing the
        forward stream); on CPU both happen now."""
        self.step += 1
        if self.perturber is not None and forward_batch is not None:
            self.perturber.after_forward(forward_batch, step=self.step)
        if self.sweep.maybe_run_sweep(self.step) and self.host_tier is not None:
            self._host_tier_sweep()
        state = batch_state(forward_batch) if forward_batch is not None else None
        requests = (
            state.requests
            if state is not None and state.requests is not None
            else NO_FORWARD_REQUESTS
        )
        if self.device_host.synchronous:
            self._stage(sfms, requests)
            self.device_host.consume(self._on_host_copies)
        else:
            self.device_host.consume(self._on_host_copies)
            self._stage(sfms, requests)

    def _host_tier_sweep(self) -> None:
        """HiCache: after a radix sweep, the host-tier sweep's pages (on the CPU); its
        incidents are counted and reported at once (no ring: found on the host)."""
        incidents = self.host_tier.sweep(self.radix_cache)
        if incidents:
            self.violations.count(incidents)
            self._report(incidents, dropped=0, step=self.step, requests=NO_FORWARD_REQUESTS)

    def count_violations(self) -> int:
        """Violations counted so far over every forward window (kept in the ring or dropped),
        after consuming the read-back still pending (the host waits for it: for tests, tools
        and shutdown, never on the forward path). The ring itself holds only the current
        window, so its write index is no running total."""
        if self.device_host.has_pending:
            self.device_host.consume(self._on_host_copies)
        return self.violations.total

    def _report(self, incidents, *, dropped: int, step: int, requests: ForwardRequests) -> None:
        """Name the requests each incident touches, count it, contain it (abort mode), then
        report it (raise mode raises here, after the counters moved). Only on a step with an
        incident; it may wait for the device (docs/architecture.md, "Containment and
        metrics")."""
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
            self.metrics.on_incidents(incidents, dropped=dropped)
        if self.containment is not None:
            aborted = self.containment.contain(incidents, touched)
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

    def _stage(self, sfms: Sequence[SingleForwardManager], requests: ForwardRequests) -> None:
        """Stage this step's read-back. One ring window per forward step: the ring's write
        index is zeroed right after its copy, on the copy stream (no host sync; the next
        forward's fence orders it after that), so a later step's violations are detailed
        again however many came before (docs/architecture.md, "Reading results"). Nothing on
        the forward stream waits for the copy or the reset, and the next forward's bracket
        launches no reset of its own before the model's kernels."""
        self.device_host.stage()
        self._staged = StagedForward(self.step, tuple(s.index for s in sfms), requests)

    def _on_host_copies(self, host: CanaryReadback) -> None:
        staged = self._staged
        step = staged.step
        plans_enabled = {i: host.sfm_status[i].plan_enabled.tolist() for i in staged.sfm_indices}
        for plan_enabled in plans_enabled.values():
            self.overflow.check(step=step, plan_enabled=plan_enabled)
        kernel_counters = host.kernel_run_counters.tolist()
        slot_counters = host.slot_run_counters.tolist()
        incidents, dropped = self.violations.collect(
            write_index=int(host.violation_write_index[0]), ring=host.violation_ring
        )
        if incidents or dropped:
            self._report(incidents, dropped=dropped, step=step, requests=staged.requests)
        if self.metrics is not None:
            self.metrics.on_step(
                verified_slots=sum(slot_counters),
                sweep_passes=self.sweep_passes,
                protected_tokens=self._kv_slots_in_use(),
            )
        self.stats.maybe_log(
            step=step,
            kernel_counters=kernel_counters,
            slot_counters=slot_counters,
            violations=self.violations.total,
            sweep_passes=self.sweep_passes,
            host_tier=(
                (self.host_tier.backed_up_slots, self.host_tier.loaded_slots)
                if self.host_tier is not None
                else None
            ),
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
