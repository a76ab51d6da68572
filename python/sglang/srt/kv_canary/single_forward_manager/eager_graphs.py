"""``EagerForwardGraphs``: an eager forward's canary launches (a prefill, or a decode batch past
sglang's decode graphs) on static, padded inputs, replayed from two CUDA graphs captured once
per single-forward manager (docs/architecture.md, "One forward").

Caller: :class:`SingleForwardManager`, after ``enable_static_eager_launches`` (on CUDA at
``mark_init_finished``). :meth:`~EagerForwardGraphs.stage` copies the forward's inputs into
buffers of the canary's capacities; :meth:`~EagerForwardGraphs.run_side` (side stream, from the
fork) and :meth:`~EagerForwardGraphs.run_tail` (forward stream, after the join) replay the two
halves. :meth:`~EagerForwardGraphs.capture` (start-up only; syncs) runs both once on
all-padding inputs (compiles, writes no record), then captures them. Without CUDA
(``capture_graphs=False``: the CPU tests) the halves launch directly on the same static inputs.
Staging and replays neither allocate nor sync.
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

    def __init__(
        self,
        *,
        plan_input: PlanInput,
        capacities: CanaryLaunchCapacities,
        expected_inputs: Optional[ExpectedInputs],
        side_launches: Launches,
        tail_launches: Launches,
        side_stream: Optional["torch.cuda.Stream"],
        device,
    ):
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
            req_pool_indices=plan_input.req_pool_indices,
            prefix_lens=plan_input.prefix_lens,
            extend_seq_lens=plan_input.extend_seq_lens,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            expected_inputs=expected_inputs.views(cap) if expected_inputs is not None else None,
        )
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
            raise RuntimeError(
                "kv_canary: eager-forward graphs must be captured before the "
                "first staged forward (on all-padding inputs)"
            )
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
        src += (
            leading(forward_batch.input_ids, n),
            leading(forward_batch.positions, n),
            forward_batch.out_cache_loc,
        )
        if self._tokens_filled > n:
            dst.append(self.out_cache_loc[n : self._tokens_filled])
            src.append(self._zeros[: self._tokens_filled - n])
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
