"""``SingleForwardManager``: the canary work around one model forward (SPEC §10).

Four ops, checked in order:

1. ``pre_ops_outside_graph(forward_batch)`` — host checks (capacities, with the server flag to
   change), the token-id scatter and, with ``SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT=1``,
   the token oracle's expected written tokens / positions; never captured.
2. ``pre_ops_maybe_inside_graph(forward_batch)`` — fill the plan input, plan every group, HEAD
   launches (verify, then write), the chain part of the TAIL writes, and a copy of the plans'
   ``enable`` flags into a static status buffer; on CUDA on a side stream, concurrently with
   the model forward. Captured into decode CUDA graphs (as a parallel branch).
3. ``post_ops_maybe_inside_graph(forward_batch)`` — join the side stream; TAIL verify, then the
   TAIL writes' real-KV fingerprints of the new slots. Captured too.
4. ``post_ops_outside_graph()`` — back to IDLE; the manager then reads results (delayed).

When a CUDA graph replays, 2 and 3 run inside the graph; :meth:`mark_replayed_inside_graph`
records that. While capturing (:meth:`capturing`), only 2 and 3 run, from IDLE. Every
per-forward tensor is allocated in ``__init__``.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Sequence

import torch

from sglang.jit_kernel.kv_canary.verify import CanaryPhase
from sglang.jit_kernel.kv_canary.write import WriteParts
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.endpoint import CanaryEndpoint
from sglang.srt.kv_canary.expected_inputs import ExpectedInputs
from sglang.srt.kv_canary.plan_input import PlanInput
from sglang.srt.kv_canary.req_to_expected_token_ids_manager import (
    populate_req_to_expected_token_ids,
)
from sglang.srt.kv_canary.runner.kernel_launcher import (
    GroupPlans,
    launch_group_plan,
    launch_verifies,
    launch_writes,
)
from sglang.srt.kv_canary.single_forward_manager.phases import (
    CAPTURE_TRANSITIONS,
    TRANSITIONS,
    CanaryPhaseError,
    SfmPhase,
)
from sglang.srt.kv_canary.state import CanaryDeviceState

class SingleForwardManager:
    def __init__(self, *, groups: Sequence[CanaryBufferGroup],
                 endpoints: Sequence[CanaryEndpoint], state: CanaryDeviceState,
                 capacities: CanaryLaunchCapacities, config: CanaryConfig,
                 req_to_token: torch.Tensor, device, index: int = 0,
                 token_oracle=None):
        self.index = index
        self.token_oracle = token_oracle
        self.config = config
        self.capacities = capacities
        self.state = state
        self.endpoints = list(endpoints)
        self.req_to_token = req_to_token
        self.plans: Dict[int, GroupPlans] = {
            id(g): GroupPlans.allocate(g, capacities, device) for g in groups}
        self.plan_input = PlanInput(write_req_capacity=capacities.write_req_capacity,
                                    device=device)
        # per-request valid lengths of the expected-token pool (filled outside the graph)
        self.expected_valid_lens = torch.zeros(capacities.write_req_capacity, dtype=torch.int64,
                                               device=device)
        self.expected_inputs = (ExpectedInputs(write_entry_capacity=capacities.write_entry_capacity,
                                               device=device)
                                if config.enable_write_input_assert else None)
        # static status written inside the graph: each group's plan `enable` flag
        self.status_plan_enabled = torch.zeros(len(self.plans), dtype=torch.int32, device=device)
        # CUDA: the pre-forward work runs on this side stream, beside the model forward
        device = torch.device(device)
        self.side_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.phase = SfmPhase.IDLE
        self._capturing = False

    # ---- phase bookkeeping ----------------------------------------------------------------

    def _advance(self, op: str) -> None:
        table = CAPTURE_TRANSITIONS if self._capturing else TRANSITIONS
        if op not in table:
            raise CanaryPhaseError(f"kv_canary: {op} must not run during CUDA-graph capture")
        allowed, after = table[op]
        if self.phase not in allowed:
            raise CanaryPhaseError(
                f"kv_canary: {op} called in phase {self.phase.value} (single-forward manager "
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

    def pre_ops_outside_graph(self, forward_batch) -> None:
        self._advance("pre_ops_outside_graph")
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
        if self.expected_inputs is not None:
            self.token_oracle.fill_expected_inputs(forward_batch, self.expected_inputs)
        if self.config.enable_verify_token_assert:
            lens = populate_req_to_expected_token_ids(
                forward_batch=forward_batch,
                req_to_verify_expected_tokens=self.state.req_to_verify_expected_tokens)
            if lens is None:  # no snapshot for this batch: no token checks this forward
                self.expected_valid_lens.zero_()
            else:
                self.expected_valid_lens[:bs].copy_(lens, non_blocking=True)

    @contextlib.contextmanager
    def _beside_the_forward(self):
        """Run the enclosed launches on the side stream, after what the forward stream has
        queued so far (a fork; inside a capture it becomes a parallel graph branch). The
        matching join is :meth:`_join`. CPU: runs in place."""
        if self.side_stream is None:
            yield
            return
        self.side_stream.wait_stream(torch.cuda.current_stream(self.side_stream.device))
        with torch.cuda.stream(self.side_stream):
            yield

    def _join(self) -> None:
        if self.side_stream is not None:
            torch.cuda.current_stream(self.side_stream.device).wait_stream(self.side_stream)

    def pre_ops_maybe_inside_graph(self, forward_batch) -> None:
        """Plan, HEAD verify + write, and the TAIL writes' chain part (which needs no KV
        bytes). On CUDA all of it runs on the side stream, concurrently with the model forward
        (none of it feeds the forward; :meth:`post_ops_maybe_inside_graph` joins), so the
        serial chain of a long prefill costs the forward stream nothing."""
        self._advance("pre_ops_maybe_inside_graph")
        with self._beside_the_forward():
            rpi, prefix, extend = self.plan_input.fill_from_forward_batch(forward_batch)
            expected = self.state.req_to_verify_expected_tokens \
                if self.config.enable_verify_token_assert else None
            for plans in self.plans.values():
                launch_group_plan(plans, req_pool_indices=rpi, prefix_lens=prefix,
                                  extend_seq_lens=extend, req_to_token=self.req_to_token,
                                  expected_tokens=expected,
                                  expected_valid_lens=self.expected_valid_lens[: rpi.shape[0]])
            self._verify(CanaryPhase.HEAD)
            self._write(CanaryPhase.HEAD, WriteParts.ALL, forward_batch)
            self._write(CanaryPhase.TAIL, WriteParts.CHAIN, forward_batch)
            for i, plans in enumerate(self.plans.values()):
                self.status_plan_enabled[i:i + 1].copy_(plans.verify_plan.enable)

    def post_ops_maybe_inside_graph(self, forward_batch) -> None:
        """Join the side stream, then TAIL verify (records and real-KV fingerprints of the
        prefix, after the forward) and the TAIL writes' fingerprints of the new slots."""
        self._advance("post_ops_maybe_inside_graph")
        self._join()
        self._verify(CanaryPhase.TAIL)
        self._write(CanaryPhase.TAIL, WriteParts.FINGERPRINT, forward_batch)

    def mark_replayed_inside_graph(self) -> None:
        self._advance("mark_replayed_inside_graph")

    def post_ops_outside_graph(self) -> None:
        self._advance("post_ops_outside_graph")

    def abort(self) -> None:
        """Back to IDLE after a forward that raised (its canary work is void)."""
        self.phase = SfmPhase.IDLE

    def _verify(self, phase: CanaryPhase) -> None:
        launch_verifies(self.endpoints, phase, plans_by_group=self.plans,
                        check_verify_expected_token=self.config.enable_verify_token_assert)

    def _write(self, phase: CanaryPhase, parts: WriteParts, forward_batch) -> None:
        n = forward_batch.out_cache_loc.shape[0]
        launch_writes(
            self.endpoints, phase, parts=parts, plans_by_group=self.plans,
            input_ids=forward_batch.input_ids[:n], positions=forward_batch.positions[:n],
            out_cache_loc=forward_batch.out_cache_loc,
            expected_inputs=(self.expected_inputs.views(n)
                             if self.expected_inputs is not None else None),
        )
