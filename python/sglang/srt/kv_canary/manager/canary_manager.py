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
manager.capturing(): ...``. Its scheduler-facing part is ``scheduler_side``, the EAGLE draft
worker's brackets ``draft_rounds``; the read-back goes to ``reporting.ForwardReporter``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from sglang.srt.kv_canary.batch_state import (
    NO_FORWARD_REQUESTS,
    ForwardRequests,
    batch_state,
    batch_state_for,
)
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.capacities import REPLAY_TOKENS_PER_REQUEST, CanaryLaunchCapacities
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.endpoint import build_endpoints_from_group
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.memory import (
    CanaryMemoryInputs,
)
from sglang.srt.kv_canary.perturb import CanaryPerturber
from sglang.srt.kv_canary.plan_input import LaneLayout
from sglang.srt.kv_canary.ranks import RankFacts
from sglang.srt.kv_canary.manager.device_host import DelayedDeviceHostHandler
from sglang.srt.kv_canary.manager.draft_rounds import DraftRound, DraftRoundBrackets
from sglang.srt.kv_canary.manager.hicache import HostTierMirror
from sglang.srt.kv_canary.manager.reporting import (
    CanaryReadback,
    ForwardReporter,
    StagedForward,
)
from sglang.srt.kv_canary.manager.scheduler_side import SchedulerSide
from sglang.srt.kv_canary.manager.swa_divergence import SwaDivergenceReporter
from sglang.srt.kv_canary.manager.sweep import SweepOrchestrator
from sglang.srt.kv_canary.single_forward_manager import SingleForwardManager
from sglang.srt.kv_canary.state import CanaryDeviceState
from sglang.srt.kv_canary.token_history import TokenHistoryUploader
from sglang.srt.kv_canary.token_oracle.expected_tokens import TokenOracleManager

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ForwardBatch

logger = logging.getLogger(__name__)


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


class CanaryManager(SchedulerSide, DraftRoundBrackets):
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
        token_oracle: Optional[TokenOracleManager] = None,
        memory_inputs: CanaryMemoryInputs,
        ranks: RankFacts = RankFacts(),
        kv_pool=None,
    ):
        if not config.enabled:
            raise ValueError("CanaryManager needs --kv-canary log, raise, abort or heal (got none)")
        if not groups:
            raise ValueError("CanaryManager needs at least one buffer group")
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
                lanes=(
                    LaneLayout(
                        topk=ranks.draft_topk,
                        steps=ranks.draft_steps,
                        page_size=ranks.draft_page_size,
                    )
                    if ranks.draft_topk > 1
                    else None
                ),
                verify_tree_depth=ranks.verify_tree_depth,
                forwards_write=ranks.forwards_write_records,
                block_prefix_from_positions=ranks.block_prefix_from_positions,
            )
            for i in range(ranks.single_forward_managers)
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
                # the scheduler's own test, once attached (a PD decode server's faked transfers)
                faked_transfer=lambda req: self.reporter.requests.faked_transfer(req),
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
            defer_on_cpu=config.cpu_deferred_readback,
        )
        self.reporter = ForwardReporter(
            config=config,
            ranks=ranks,
            capacities=capacities,
            groups=self.groups,
            expected_tags=ForwardReporter.expected_tags(self.endpoints),
            swa_divergence=self.swa_divergence,
            req_to_token=req_to_token,
            device=device,
        )
        self.sweep = SweepOrchestrator(
            interval=config.sweep_interval, endpoints=self.endpoints, device=device
        )
        self._tree_cache = None  # the scheduler's radix tree (attach_radix_cache)
        self.step = 0
        self._active: Optional[SingleForwardManager] = None
        # EAGLE draft worker: forwards per draft round (0 elsewhere), the round in progress,
        # and whether the draft graph runner is capturing
        self.draft_forwards_per_round = ranks.draft_forwards_per_round
        self._draft_round: Optional[DraftRound] = None
        self._capturing_draft_graph = False
        # sglang's piecewise CUDA-graph set-up in progress (its dummy forwards run no canary)
        self._piecewise_graph_setup = False
        self._init_finished = False  # mark_init_finished ran (the chain-position check is on)
        self._staged: Optional[StagedForward] = None
        # the requests of the hand-built batches run inside with_hand_built_batch_requests
        self._hand_built_reqs: Optional[tuple] = None

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
        if self._hand_built_reqs is not None and batch_state(forward_batch) is None:
            # a batch sglang built by hand (no ForwardBatch.init_new): its requests' state now
            self.on_forward_batch_init(forward_batch, self._hand_built_reqs)
        with self._outside_graph((sfm,), forward_batch, replayed=False):
            yield sfm

    @contextlib.contextmanager
    def with_hand_built_batch_requests(self, reqs):
        """Around sglang code that builds a ``ForwardBatch`` by hand (not through
        ``ForwardBatch.init_new``, whose hook sets a batch's canary state) and runs it on this
        runner: DFLASH's draft block. Such a batch gets ``reqs``' state (their rows for the
        reports, their token histories with token checks on) at its forward
        (docs/speculative_multilayer_adaptive_dflash_mtp.md, "3.4 Changes to the canary")."""
        if self._hand_built_reqs is not None:
            raise RuntimeError("kv_canary: hand-built batch requests set twice (no nesting)")
        self._hand_built_reqs = tuple(reqs)
        try:
            yield
        finally:
            self._hand_built_reqs = None

    def write_outside_forward(self, forward_batch: "ForwardBatch") -> None:
        """Records of KV sglang wrote into this runner's pool outside any model forward
        (DFLASH's draft appends), after that write: single-forward manager 0's write-only
        launches (:meth:`SingleForwardManager.write_outside_forward`), on the current stream.
        No step is counted and nothing is read back here: the next forward on this runner
        reads its slots, verifies them and reads back what both found."""
        if self._active is not None:
            raise RuntimeError(
                "kv_canary: a write outside any forward while single-forward manager "
                f"{self._active.index} is active"
            )
        # these launches queue after the last read-back (and the ring's reset), as a forward's
        self.device_host.fence()
        self.sfms[0].write_outside_forward(forward_batch)

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
                sfm.pre_ops_outside_graph(forward_batch, replayed=replayed)
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

    # ---- lifecycle ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def graph_capture_setup(self):
        """Around one sglang graph capture call (its warm-up forwards and the capture), from
        outside the capture: a graph captured after start-up (``--speculative-adaptive``
        captures every candidate step count's graphs after the runners' init) warms up on
        dummy batches of arbitrary positions, so the chain-position check is off meanwhile,
        as during start-up, and on again after."""
        if not self._init_finished:
            yield
            return
        self.state.set_chain_position_assert(False)
        try:
            yield
        finally:
            self.state.set_chain_position_assert(True)

    def mark_init_finished(self) -> None:
        """End of warm-up and graph capture: turn the chain-position check on; on CUDA,
        capture the read-back's copies and each single-forward manager's eager-forward graphs
        (its launches for the forwards no sglang graph holds: prefills, large decode
        batches)."""
        self.state.mark_init_finished()
        self._init_finished = True
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

    # ---- after each forward ----------------------------------------------------------------

    def after_forward(
        self, sfms: Sequence[SingleForwardManager], forward_batch: Optional["ForwardBatch"] = None
    ) -> None:
        """Step counter, fault injection (self-tests only; before the sweep so that a fault
        in an idle cached slot is swept this step), the radix sweep (when due), then the
        delayed violation / overflow / health / stats pump: on CUDA the copies staged after
        the previous forward are consumed and this forward's are staged (never syncing the
        forward stream); on CPU both happen now (unless the config defers the CPU's read-back
        as on CUDA)."""
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
            self.reporter.report(incidents, dropped=0, step=self.step, requests=NO_FORWARD_REQUESTS)

    def count_violations(self) -> int:
        """Violations counted so far over every forward window (kept in the ring or dropped),
        after consuming the read-back still pending (the host waits for it: for tests, tools
        and shutdown, never on the forward path). The ring itself holds only the current
        window, so its write index is no running total."""
        self.device_host.consume(self._on_host_copies)
        return self.violations.total

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
        host_tier = self.host_tier
        self.reporter.consume(
            host,
            self._staged,
            sweep_passes=self.sweep_passes,
            host_tier=(
                (host_tier.backed_up_slots, host_tier.loaded_slots)
                if host_tier is not None
                else None
            ),
        )
