"""``SingleForwardManager``: the canary work around one model forward, four ops checked in order
(the lifecycle as data: ``phases.py``; design: docs/architecture.md, "One forward"):

1. ``pre_ops_outside_graph(fb)``: host capacity checks, the oracle's expected inputs; takes the
   batch the inside ops read (capturing: their own argument); token upload left pending.
2. ``pre_ops_maybe_inside_graph(fb)``: the fork point, an event on the forward stream.
3. ``post_ops_maybe_inside_graph(fb)``: side stream from the fork: token upload (eager), plans,
   HEAD, TAIL chain, status (:class:`SfmStatus`); join; TAIL verify and fingerprints.
4. ``post_ops_outside_graph()``: back to IDLE.

2 and 3 are graph-safe: captured in decode graphs (:meth:`capturing`: only they run), replayed
(:meth:`upload_tokens_before_replay` before, :meth:`mark_replayed_inside_graph` after), or in an
eager forward replays of :class:`EagerForwardGraphs`; 1 and 4 never are. Tensors are allocated
in ``__init__`` and :meth:`enable_static_eager_launches` (start-up).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import torch

from sglang.jit_kernel.kv_canary.tree_parents import launch_tree_parents_kernel
from sglang.jit_kernel.kv_canary.types import CanaryPhase, WriteTree
from sglang.srt.kv_canary import cuda_streams, sglang_seam
from sglang.srt.kv_canary.batch_state import batch_state
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.endpoint import CanaryEndpoint
from sglang.srt.kv_canary.expected_inputs import ExpectedInputs
from sglang.srt.kv_canary.plan_input import LaneLayout, PlanInput
from sglang.srt.kv_canary.single_forward_manager.eager_graphs import EagerForwardGraphs
from sglang.srt.kv_canary.single_forward_manager.launches import (
    ForwardLaunchInputs,
    GroupPlans,
    chain_write_launches,
    launch_deep_verifies,
    launch_deep_writes,
    launch_fingerprint_writes,
    launch_group_plan,
    launch_verifies,
)
from sglang.srt.kv_canary.single_forward_manager.phases import (
    CAPTURE_TRANSITIONS,
    TRANSITIONS,
    CanaryPhaseError,
    SfmOp,
    SfmPhase,
)
from sglang.srt.kv_canary.state import CanaryDeviceState
from sglang.srt.kv_canary.token_history import TokenHistoryUploader

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ForwardBatch
    from sglang.srt.kv_canary.token_oracle.expected_tokens import TokenOracleManager


@dataclasses.dataclass(frozen=True, eq=False)
class SfmStatus:
    """A single-forward manager's per-forward output, written inside the (graph-captured)
    pre-ops and read one step later on the host.

    - ``plan_enabled``: int32 ``[num_groups]``; entry i is group i's (``sfm.groups[i]``) verify
      plan ``enable`` flag (0 = the plan overflowed its capacity: that forward went unverified
      in that group).
    """

    plan_enabled: torch.Tensor


class SingleForwardManager:
    """``groups`` fixes the order of the status entries; ``token_history`` (token checks on)
    and ``token_oracle`` (write-input check on) are the owners this manager hands batches to.
    All per-forward tensors are allocated here."""

    def __init__(
        self,
        *,
        groups: Sequence[CanaryBufferGroup],
        endpoints: Sequence[CanaryEndpoint],
        state: CanaryDeviceState,
        capacities: CanaryLaunchCapacities,
        config: CanaryConfig,
        req_to_token: torch.Tensor,
        device,
        index: int = 0,
        token_history: Optional[TokenHistoryUploader] = None,
        token_oracle: Optional["TokenOracleManager"] = None,
        kv_pool=None,
        lanes: Optional[LaneLayout] = None,
        verify_tree_depth: int = 0,
        forwards_write: bool = True,
        block_prefix_from_positions: bool = False,
    ):
        """``lanes``: the lane layout (topk, steps, page size) on a draft runner with
        ``--speculative-eagle-topk`` > 1 (its draft round's forwards planned by lane); ``verify_tree_depth`` > 0 on its
        target runner (the verify's draft trees written along their paths, at most that many
        entries per path): docs/speculative_trees.md. ``forwards_write`` /
        ``block_prefix_from_positions``: :class:`~sglang.srt.kv_canary.ranks.RankFacts`'
        ``forwards_write_records`` / ``block_prefix_from_positions`` (DFLASH's draft runner)."""
        if config.enable_verify_token_assert and token_history is None:
            raise ValueError(
                "SingleForwardManager: token checks are on "
                "(enable_verify_token_assert) but no token_history was given"
            )
        if config.enable_write_input_assert and token_oracle is None:
            raise ValueError(
                "SingleForwardManager: the write-input check is on "
                "(enable_write_input_assert) but no token_oracle was given"
            )
        self.index = index
        # False: forwards verify only (DFLASH's draft blocks; RankFacts.forwards_write_records)
        self.forwards_write = forwards_write
        self.kv_pool = kv_pool  # the guarded pool (HiCache: its layer-load counter)
        self.token_oracle = token_oracle
        self.token_history = token_history
        self.config = config
        self.capacities = capacities
        self.state = state
        self.endpoints = tuple(endpoints)
        self.req_to_token = req_to_token
        self.groups: Tuple[CanaryBufferGroup, ...] = tuple(groups)
        self.plans: Dict[CanaryBufferGroup, GroupPlans] = {
            g: GroupPlans.allocate(g, capacities, device) for g in self.groups
        }
        self.plan_input = PlanInput(
            write_req_capacity=capacities.write_req_capacity,
            device=device,
            lanes=lanes,
            block_prefix_from_positions=block_prefix_from_positions,
        )
        # a target verify of draft trees: each node's parent (filled outside the graph)
        self.tree = (
            WriteTree.allocate(
                capacity=capacities.write_entry_capacity,
                max_depth=verify_tree_depth,
                device=device,
            )
            if verify_tree_depth
            else None
        )
        # per-request valid lengths of the expected-token pool (filled outside the graph)
        self.expected_valid_lens = torch.zeros(
            capacities.write_req_capacity, dtype=torch.int64, device=device
        )
        self.expected_inputs = (
            ExpectedInputs(write_entry_capacity=capacities.write_entry_capacity, device=device)
            if config.enable_write_input_assert
            else None
        )
        self.status = SfmStatus(
            plan_enabled=torch.zeros(len(self.groups), dtype=torch.int32, device=device)
        )
        # the forward's slots when sglang hands a strided view (an EAGLE draft forward's row
        # of the round's slots): copied here, inside the pre-ops, for the launches
        self.forward_slots = torch.zeros(
            capacities.write_entry_capacity, dtype=torch.int64, device=device
        )
        # CUDA: the pre-forward work runs on this side stream, beside the model forward
        device = torch.device(device)
        self.side_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        # the fork point on the forward stream (2.), where the side-stream work starts, and
        # the join (3.), where the forward stream waits for the side stream's work
        self._fork = torch.cuda.Event() if self.side_stream is not None else None
        self._joined = torch.cuda.Event() if self.side_stream is not None else None
        # the side half's HEAD and TAIL-chain writes: one launch per group (its buffers'
        # serial chains side by side on one SM), the groups' launches side by side
        self._write_lanes = cuda_streams.ParallelLanes(max(1, len(self.groups)), device)
        self._device_index = self.side_stream.device_index if self.side_stream is not None else None
        # the batch of the outside bracket (1.): what an eager forward's inside ops read
        self._batch: Optional["ForwardBatch"] = None
        # token checks: this forward's token-history upload is still to be done
        self._tokens_pending = False
        self.phase = SfmPhase.IDLE
        self._capturing = False
        # eager forwards' launches on static inputs (a graph replay on CUDA), once enabled
        self.eager_graphs: Optional[EagerForwardGraphs] = None

    def enable_static_eager_launches(self, *, capture_graphs: bool) -> None:
        """From now on, an eager forward's launches read static, padded copies of its inputs
        (:class:`EagerForwardGraphs`); ``capture_graphs`` (CUDA, at the end of start-up):
        and are replayed from two CUDA graphs captured now. The manager calls it from
        ``mark_init_finished``; without CUDA only the tests do (``capture_graphs=False``)."""
        if self.eager_graphs is not None:
            raise RuntimeError(
                f"kv_canary: single-forward manager {self.index}'s static eager "
                "launches are already enabled"
            )
        if self.phase != SfmPhase.IDLE:
            raise CanaryPhaseError(
                f"kv_canary: static eager launches enabled in phase {self.phase.value}"
            )
        graphs = EagerForwardGraphs(
            plan_input=self.plan_input,
            capacities=self.capacities,
            expected_inputs=self.expected_inputs,
            side_launches=self._eager_side_launches,
            tail_launches=self._tail_launches,
            side_stream=self.side_stream,
            device=self.req_to_token.device,
        )
        if capture_graphs:
            graphs.capture()
        self.eager_graphs = graphs

    # ---- phase bookkeeping ----------------------------------------------------------------

    def _advance(self, op: SfmOp) -> None:
        table = CAPTURE_TRANSITIONS if self._capturing else TRANSITIONS
        if op not in table:
            raise CanaryPhaseError(f"kv_canary: {op.value} must not run during CUDA-graph capture")
        allowed, after = table[op]
        if self.phase not in allowed:
            raise CanaryPhaseError(
                f"kv_canary: {op.value} called in phase {self.phase.value} (single-forward manager "
                f"{self.index}); expected after {', '.join(p.value for p in allowed)}"
            )
        self.phase = after

    @contextlib.contextmanager
    def capturing(self):
        """CUDA-graph capture (and its warm-up forwards): only the inside ops run."""
        if self.phase != SfmPhase.IDLE:
            raise CanaryPhaseError(f"kv_canary: graph capture started in phase {self.phase.value}")
        self._capturing = True
        try:
            yield self
        finally:
            self._capturing = False
            self.phase = SfmPhase.IDLE

    # ---- the four ops --------------------------------------------------------------------

    def pre_ops_outside_graph(
        self, forward_batch: "ForwardBatch", *, replayed: bool = False
    ) -> None:
        """``replayed``: ``forward_batch`` is a replayed draft round's (its CUDA graph holds
        this forward's inside ops, which read no expected inputs: a draft round's tokens are
        proposals)."""
        self._advance(SfmOp.PRE_OUTSIDE_GRAPH)
        self._check_capacities(forward_batch)
        if self.expected_inputs is not None and not (
            replayed and self.token_oracle.writes_proposals(forward_batch)
        ):
            self.token_oracle.fill_expected_inputs(forward_batch, self.expected_inputs)
        if self._is_tree_forward(forward_batch):
            # before the fork (so before the side stream's write) and before a graph replays
            # the write that reads it
            next_token, next_sibling = sglang_seam.verify_tree_lists(forward_batch)
            launch_tree_parents_kernel(
                next_token=next_token, next_sibling=next_sibling, tree=self.tree
            )
        self._batch = forward_batch
        # token checks: the upload waits for the forward's kernels (eager) or the replay
        self._tokens_pending = self.token_history is not None

    def _check_capacities(self, forward_batch: "ForwardBatch") -> None:
        """Raise ``RuntimeError`` naming the flags to raise when the batch's requests or
        tokens exceed the canary's capacities."""
        bs = forward_batch.req_pool_indices.shape[0]
        caps = self.capacities
        if bs > caps.write_req_capacity:
            raise RuntimeError(
                f"kv_canary: a forward of {bs} requests exceeds the canary's request capacity "
                f"{caps.write_req_capacity}; it is sized from --max-running-requests and "
                "--cuda-graph-max-bs: raise --max-running-requests to cover this batch"
            )
        num_tokens = forward_batch.out_cache_loc.shape[0]
        if num_tokens > caps.write_entry_capacity:
            raise RuntimeError(
                f"kv_canary: a forward of {num_tokens} tokens exceeds the canary's token "
                f"capacity {caps.write_entry_capacity}; it is sized from --max-prefill-tokens "
                "and --chunked-prefill-size: raise them to cover this batch"
            )

    def write_outside_forward(self, forward_batch: "ForwardBatch") -> None:
        """Records of KV sglang wrote outside any model forward (DFLASH's draft appends:
        docs/speculative_multilayer_adaptive_dflash_mtp.md, "3.4 Changes to the canary"),
        after that write: plan, HEAD and TAIL chain writes, TAIL fingerprints (per-layer ones
        too), eager, in order, on the current stream. No verify: the next forward that reads
        those slots verifies them. Runs only between forwards (phase IDLE, no capture)."""
        if self.phase != SfmPhase.IDLE or self._capturing:
            raise CanaryPhaseError(
                f"kv_canary: a write outside any forward in phase {self.phase.value} "
                f"(single-forward manager {self.index}); it runs only between forwards"
            )
        self._check_capacities(forward_batch)
        inputs = self._batch_inputs(forward_batch)
        for plans in self.plans.values():
            launch_group_plan(
                plans,
                req_pool_indices=inputs.req_pool_indices,
                prefix_lens=inputs.prefix_lens,
                extend_seq_lens=inputs.extend_seq_lens,
                req_to_token=self.req_to_token,
                expected_tokens=None,
                expected_valid_lens=None,
            )
        for launch in chain_write_launches(
            self.endpoints,
            plans_by_group=self.plans,
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            out_cache_loc=inputs.out_cache_loc,
            expected_inputs=None,
        ):
            launch()
        self._fingerprint_writes(inputs)

    def upload_tokens_before_replay(self) -> None:
        """Before a CUDA graph replays this forward's inside ops (the replay hooks call it, on
        the forward stream): stage the token-history snapshot the graph's captured scatter
        reads (:meth:`TokenHistoryUploader.stage_for_replay`: one copy). A no-op without
        token checks or once done."""
        if self._tokens_pending:
            self._tokens_pending = False
            forward_batch = self._batch
            self.token_history.stage_for_replay(
                batch_state(forward_batch), forward_batch.req_pool_indices, self.expected_valid_lens
            )

    def _upload_tokens(self, forward_batch: "ForwardBatch") -> None:
        """An eager forward's upload: scatter the batch's token-id snapshot into the
        expected-token pool and set the plan's valid lengths (one host->device copy, one
        launch, no host sync), on the current stream."""
        self._tokens_pending = False
        if not self.token_history.upload(
            batch_state(forward_batch), forward_batch.req_pool_indices, self.expected_valid_lens
        ):
            self.expected_valid_lens.zero_()  # no snapshot: no token checks this forward

    def _inside_batch(self, forward_batch: "ForwardBatch") -> "ForwardBatch":
        """The batch the inside ops read (module docstring): the argument while capturing,
        else the outside bracket's batch."""
        if self._capturing:
            return forward_batch
        if self._batch is None:  # the phase table makes this unreachable; keep it loud
            raise CanaryPhaseError(
                "kv_canary: inside ops of an eager forward without the outside bracket's batch"
            )
        return self._batch

    @contextlib.contextmanager
    def _beside_the_forward(self):
        """Run the enclosed launches on the side stream, from the fork point recorded by
        :meth:`pre_ops_maybe_inside_graph` (inside a capture: a parallel graph branch from
        there). The matching join is :meth:`_join`. CPU: runs in place."""
        if self.side_stream is None:
            yield
            return
        self.side_stream.wait_event(self._fork)
        with cuda_streams.on_stream(self.side_stream):
            yield

    def _join(self) -> None:
        if self.side_stream is not None:
            self._joined.record(self.side_stream)
            cuda_streams.current_stream(self._device_index).wait_event(self._joined)

    def pre_ops_maybe_inside_graph(self, forward_batch: "ForwardBatch") -> None:
        """The fork point, before the model forward's kernels (HiCache: after the forward
        stream waits for the first layer's load, which carries the canary rows of loaded
        slots). No launch: the canary's host work waits until the forward is queued."""
        self._advance(SfmOp.PRE_MAYBE_INSIDE_GRAPH)
        if self.kv_pool is not None:  # HiCache: records of loaded slots arrive with layer 0
            sglang_seam.hicache_wait_for_first_layer(self.kv_pool)
        if self._fork is not None:
            self._fork.record(cuda_streams.current_stream(self._device_index))

    def post_ops_maybe_inside_graph(self, forward_batch: "ForwardBatch") -> None:
        """After the model forward's kernels are queued. On the side stream, from the fork
        point (so concurrently with the forward on the GPU; none of it reads what the forward
        writes): plan, HEAD verify + write and the TAIL writes' chain part (no KV bytes), so
        the serial chain of a long prefill costs the forward stream nothing and its host
        launches overlap the forward's GPU time. Then join, TAIL verify (records and real-KV
        fingerprints of the prefix, after the forward; with per-layer fingerprints also this
        forward's window of layers) and the TAIL writes' fingerprints of the new slots (every
        layer's, with per-layer fingerprints)."""
        self._advance(SfmOp.POST_MAYBE_INSIDE_GRAPH)
        forward_batch = self._inside_batch(forward_batch)
        # an eager forward with static launches: staged copies and graph replays (a draft
        # round's lanes and a verify's trees: launched directly, their inputs are no copies)
        graphs = (
            None
            if self._capturing
            or self.plan_input.is_lane_forward(forward_batch)
            or self._is_tree_forward(forward_batch)
            else self.eager_graphs
        )
        with self._beside_the_forward():
            if graphs is not None:
                # eager: the upload was left for now (step 1.); the graph scatters it
                self.upload_tokens_before_replay()
                graphs.stage(forward_batch, num_tokens=forward_batch.out_cache_loc.shape[0])
                graphs.run_side()
            else:
                if self._tokens_pending:  # eager: the upload was left for now (step 1.)
                    self._upload_tokens(forward_batch)
                inputs = self._batch_inputs(forward_batch)
                if self._capturing and self.token_history is not None:
                    # the replay's upload: staged before the replay by the batch's requests
                    # (not a draft round's lanes), scattered in the graph
                    rpi = forward_batch.req_pool_indices
                    self.token_history.launch_replay_scatter(
                        rpi, self.expected_valid_lens[: rpi.shape[0]]
                    )
                self._side_launches(inputs)
        self._join()
        if graphs is not None:
            graphs.run_tail()
        else:
            self._tail_launches(inputs)

    def _batch_inputs(self, forward_batch: "ForwardBatch") -> ForwardLaunchInputs:
        """The launch inputs read straight from the batch (inside sglang's captures, and
        eager forwards before static launches are enabled): the plan input filled (static
        buffers, ``[bs]``; a draft round's lanes: ``[bs * topk]``), the slots made
        contiguous."""
        lanes = None
        if self.plan_input.is_lane_forward(forward_batch):
            rpi, prefix, extend, lanes = self.plan_input.fill_lanes(forward_batch)
        else:
            rpi, prefix, extend = self.plan_input.fill_from_forward_batch(forward_batch)
        slots = self._contiguous_slots(forward_batch.out_cache_loc)
        n = slots.shape[0]
        return ForwardLaunchInputs(
            lanes=lanes,
            tree=self.tree if self._is_tree_forward(forward_batch) else None,
            req_pool_indices=rpi,
            prefix_lens=prefix,
            extend_seq_lens=extend,
            input_ids=forward_batch.input_ids[:n],
            positions=forward_batch.positions[:n],
            out_cache_loc=slots,
            expected_inputs=(
                self.expected_inputs.views(n)
                if self.expected_inputs is not None
                and not self.token_oracle.writes_proposals(forward_batch)
                else None
            ),
        )

    def _eager_side_launches(self, inputs: ForwardLaunchInputs) -> None:
        """The side half of an eager forward's graph (:class:`EagerForwardGraphs`): with token
        checks, first the scatter of the token history staged by
        :meth:`upload_tokens_before_replay` (as in sglang's decode graphs), then
        :meth:`_side_launches`."""
        if self.token_history is not None:
            rpi = inputs.req_pool_indices
            self.token_history.launch_replay_scatter(rpi, self.expected_valid_lens[: rpi.shape[0]])
        self._side_launches(inputs)

    def _side_launches(self, inputs: ForwardLaunchInputs) -> None:
        """The side-stream half of the post-ops (on the current stream): plan every group,
        HEAD verify + write, the TAIL writes' chain part, the status copy."""
        expected = self.token_history.pool if self.token_history is not None else None
        rpi = inputs.req_pool_indices
        valid_lens = self.expected_valid_lens[: rpi.shape[0]]
        if inputs.lanes is not None and expected is not None:  # per request: one per lane
            valid_lens = self.plan_input.lane_valid_lens(self.expected_valid_lens, rpi.shape[0])
        for plans in self.plans.values():
            launch_group_plan(
                plans,
                req_pool_indices=rpi,
                prefix_lens=inputs.prefix_lens,
                extend_seq_lens=inputs.extend_seq_lens,
                req_to_token=self.req_to_token,
                expected_tokens=expected,
                expected_valid_lens=valid_lens,
                lanes=inputs.lanes,
            )
        self._verify(CanaryPhase.HEAD)
        # a runner whose forwards write no records (RankFacts.forwards_write_records) runs none
        launches = (
            chain_write_launches(
                self.endpoints,
                plans_by_group=self.plans,
                input_ids=inputs.input_ids,
                positions=inputs.positions,
                out_cache_loc=inputs.out_cache_loc,
                expected_inputs=inputs.expected_inputs,
                tree=inputs.tree,
            )
            if self.forwards_write
            else []
        )
        self._write_lanes.run(launches)
        for i, group in enumerate(self.groups):
            self.status.plan_enabled[i : i + 1].copy_(self.plans[group].verify_plan.enable)

    def _tail_launches(self, inputs: ForwardLaunchInputs) -> None:
        """The forward-stream half, after the join: TAIL verify, the per-layer checks, the
        TAIL writes' fingerprints of the new slots (every layer's, with per-layer
        fingerprints)."""
        self._verify(CanaryPhase.TAIL)
        launch_deep_verifies(self.endpoints, CanaryPhase.TAIL, plans_by_group=self.plans)
        if self.forwards_write:
            self._fingerprint_writes(inputs)

    def _fingerprint_writes(self, inputs: ForwardLaunchInputs) -> None:
        """The TAIL writes' fingerprints of the new slots ``inputs`` name (every layer's, with
        per-layer fingerprints)."""
        launch_fingerprint_writes(
            self.endpoints,
            plans_by_group=self.plans,
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            out_cache_loc=inputs.out_cache_loc,
        )
        launch_deep_writes(self.plans, inputs.out_cache_loc)

    def mark_replayed_inside_graph(self) -> None:
        if self._tokens_pending:
            raise CanaryPhaseError(
                f"kv_canary: a CUDA graph replayed single-forward manager {self.index}'s inside "
                "ops before the token-history upload (the replay hook must call "
                "upload_tokens_before_replay)"
            )
        self._advance(SfmOp.MARK_REPLAYED_INSIDE_GRAPH)

    def post_ops_outside_graph(self) -> None:
        self._advance(SfmOp.POST_OUTSIDE_GRAPH)
        self._batch = None

    def abort(self) -> None:
        """Back to IDLE after a forward that raised (its canary work is void)."""
        self.phase = SfmPhase.IDLE
        self._batch = None
        self._tokens_pending = False

    def _is_tree_forward(self, forward_batch: "ForwardBatch") -> bool:
        """A target verify of draft trees (trees on, ``TARGET_VERIFY``)."""
        return (
            self.tree is not None
            and forward_batch.forward_mode == sglang_seam.ForwardMode.TARGET_VERIFY
        )

    def _verify(self, phase: CanaryPhase) -> None:
        launch_verifies(
            self.endpoints,
            phase,
            plans_by_group=self.plans,
            check_verify_expected_token=self.config.enable_verify_token_assert,
        )

    def _contiguous_slots(self, out_cache_loc: torch.Tensor) -> torch.Tensor:
        """``out_cache_loc`` as the write launches take it: itself when contiguous, else a
        copy in :attr:`forward_slots` (no allocation; captured like the launches)."""
        if out_cache_loc.is_contiguous():
            return out_cache_loc
        slots = self.forward_slots[: out_cache_loc.shape[0]]
        slots.copy_(out_cache_loc)
        return slots
