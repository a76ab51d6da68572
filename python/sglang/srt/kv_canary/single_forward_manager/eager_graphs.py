"""``EagerForwardGraphs``: an eager forward's canary launches, replayed from two CUDA graphs
captured once per single-forward manager (docs/architecture.md, "One forward").

Eager forwards are the prefills (with or without sglang's piecewise CUDA graphs, whose pieces
hold none of the canary) and the decode batches larger than sglang's decode graphs. Launched
one by one from Python, their canary work is 8-20 Triton launches at about 50-100 µs of host
time each (the H100 profile of ``bench_serving_overhead.py --host-breakdown-cprofile``): up to
1.5 ms per forward, which a short prefill's time to first token pays. A graph replay costs the
host about 10 µs whatever it holds.

What makes one capture fit every batch: the launches read only static buffers.

- The forward's tokens, positions and slots are copied into buffers of the canary's token
  capacity (``write_entry_capacity``), its requests into the plan input's buffers of the
  request capacity (:meth:`PlanInput.fill_padded`), the rows past the batch padded with
  ``req_pool_indices`` 0 (padding rows: no verify entries, no writes).
- Every kernel bounds its work by the plan's device-side counts (verify entries, write
  offsets), so the token entries past the forward's own are never read as the forward's.
  The slots past them that an earlier, larger forward left are reset to 0, sglang's
  padding slot (what a padded decode-graph row writes), so even an inconsistent batch
  cannot write a stale slot's record.
- The grids are sized by the capacities, which is what the launches inside sglang's
  decode graphs do already.

The two graphs are the two halves of the inside post-ops: the side part (plan, HEAD verify
+ write, TAIL chain, status copy), replayed on the side stream from the fork point, and the
tail part (TAIL verify, per-layer checks, TAIL fingerprints), replayed on the forward stream
after the join. :meth:`capture` runs both halves eagerly once on all-padding inputs first
(compiles the kernels for these arguments; writes no record), at the end of start-up.

Without CUDA (``capture_graphs=False``, the CPU tests) the same static inputs are launched
directly: the padded-input path, checked against the batch's own tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional

import torch

from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities
from sglang.srt.kv_canary.expected_inputs import ExpectedInputs
from sglang.srt.kv_canary.plan_input import (
    PlanInput,
    StaticPrefixViews,
    copy_pairs,
    leading,
)
from sglang.srt.kv_canary.single_forward_manager.launches import ForwardLaunchInputs

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ForwardBatch

Launches = Callable[[ForwardLaunchInputs], None]


class EagerForwardGraphs:
    """Static launch inputs of one single-forward manager, and (on CUDA, after
    :meth:`capture`) the two graphs holding ``side_launches`` / ``tail_launches`` on them.
    Allocates its buffers here; :meth:`stage` and the replays allocate nothing and never
    sync the host."""

    def __init__(self, *, plan_input: PlanInput, capacities: CanaryLaunchCapacities,
                 expected_inputs: Optional[ExpectedInputs], side_launches: Launches,
                 tail_launches: Launches, side_stream: Optional["torch.cuda.Stream"], device):
        cap = capacities.write_entry_capacity
        self._plan_input = plan_input
        self._side_launches = side_launches
        self._tail_launches = tail_launches
        self._side_stream = side_stream
        self.input_ids = torch.zeros(cap, dtype=torch.int64, device=device)
        self.positions = torch.zeros(cap, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(cap, dtype=torch.int64, device=device)
        self._zeros = torch.zeros(cap, dtype=torch.int64, device=device)
        self._token_views = StaticPrefixViews(self.input_ids, self.positions, self.out_cache_loc)
        self._tokens_filled = 0  # entries [0, _tokens_filled) hold an earlier forward's slots
        self.inputs = ForwardLaunchInputs(
            req_pool_indices=plan_input.req_pool_indices, prefix_lens=plan_input.prefix_lens,
            extend_seq_lens=plan_input.extend_seq_lens, input_ids=self.input_ids,
            positions=self.positions, out_cache_loc=self.out_cache_loc,
            expected_inputs=expected_inputs.views(cap) if expected_inputs is not None else None)
        self._side_graph: Optional["torch.cuda.CUDAGraph"] = None
        self._tail_graph: Optional["torch.cuda.CUDAGraph"] = None

    @property
    def captured(self) -> bool:
        return self._side_graph is not None

    def capture(self) -> None:
        """Run both halves once on all-padding inputs, then capture them (side half on the
        side stream). At start-up only (it synchronizes the device); CUDA only."""
        if self._side_stream is None:
            raise RuntimeError("kv_canary: eager-forward graphs need CUDA (no side stream)")
        if self.captured:
            raise RuntimeError("kv_canary: eager-forward graphs are already captured")
        if self._tokens_filled or self._plan_input.req_pool_indices.any():
            raise RuntimeError("kv_canary: eager-forward graphs must be captured before the "
                               "first staged forward (on all-padding inputs)")
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):  # warm-up: compile, no record written
            self._side_launches(self.inputs)
            self._tail_launches(self.inputs)
        torch.cuda.synchronize(stream.device)
        side, tail = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call cannot break the capture
        with torch.cuda.graph(side, stream=stream, capture_error_mode="thread_local"):
            self._side_launches(self.inputs)
        with torch.cuda.graph(tail, capture_error_mode="thread_local"):
            self._tail_launches(self.inputs)
        self._side_graph, self._tail_graph = side, tail

    def stage(self, forward_batch: "ForwardBatch", num_tokens: int) -> None:
        """Copy the forward's inputs into the static buffers (on the current stream: the side
        stream, after the fork point): :func:`copy_pairs` of the plan input, the
        tokens, positions and slots, and the reset of the slots an earlier, larger forward
        left. ``num_tokens``: the forward's token count (its ``out_cache_loc`` length)."""
        dst: List[torch.Tensor] = []
        src: List[torch.Tensor] = []
        self._plan_input.padded_copies(forward_batch, dst, src)
        n = num_tokens
        dst += self._token_views(n)
        src += (leading(forward_batch.input_ids, n), leading(forward_batch.positions, n),
                forward_batch.out_cache_loc)
        if self._tokens_filled > n:
            dst.append(self.out_cache_loc[n:self._tokens_filled])
            src.append(self._zeros[:self._tokens_filled - n])
        copy_pairs(dst, src)
        self._tokens_filled = n

    def run_side(self) -> None:
        """The side half on the staged inputs (a replay once captured)."""
        if self._side_graph is not None:
            self._side_graph.replay()
        else:
            self._side_launches(self.inputs)

    def run_tail(self) -> None:
        """The tail half on the staged inputs (a replay once captured)."""
        if self._tail_graph is not None:
            self._tail_graph.replay()
        else:
            self._tail_launches(self.inputs)
