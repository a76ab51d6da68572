"""``EagerForwardGraphs``: an eager forward's canary launches (a prefill, or a decode batch past
sglang's decode graphs) on static, padded inputs, replayed from CUDA graphs captured once per
single-forward manager (docs/architecture.md, "One forward").

Caller: :class:`SingleForwardManager`, after ``enable_static_eager_launches`` (on CUDA at
``mark_init_finished``). :meth:`~EagerForwardGraphs.stage` writes the addresses of the forward's
inputs into a staging table (:class:`StageTable`: pinned host memory the kernel reads in
place); the side half begins with the staging kernel, which copies them into buffers of the
canary's capacities. :meth:`~EagerForwardGraphs.run_side` (side stream, from the fork; one
captured side half per table) and :meth:`~EagerForwardGraphs.run_tail` (forward stream, after
the join) replay the two halves. :meth:`~EagerForwardGraphs.capture` (start-up only; syncs)
runs both once on all-padding inputs (compiles, writes no record), then captures them. Without
CUDA (``capture_graphs=False``: the CPU tests) the halves launch directly on the same static
inputs. Staging and replays neither allocate nor sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch

from sglang.srt.kv_canary import cuda_streams
from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities
from sglang.srt.kv_canary.expected_inputs import ExpectedInputs
from sglang.jit_kernel.kv_canary.consts import (
    STAGE_ENTRY_FIELDS,
    STAGE_HEADER,
    STAGE_MAX_ENTRIES,
    STAGE_NUM_ENTRIES,
    STAGE_OP_FILL,
    STAGE_TABLE_NUMEL,
)
from sglang.jit_kernel.kv_canary.stage_inputs import launch_stage_inputs_kernel
from sglang.srt.kv_canary.plan_input import PlanInput, stage_source
from sglang.srt.kv_canary.single_forward_manager.launches import ForwardLaunchInputs

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ForwardBatch

Launches = Callable[[ForwardLaunchInputs], None]


class StageTable:
    """The staging kernel's two tables of one :class:`EagerForwardGraphs` (layout:
    ``consts.STAGE_*``), each read by the kernel where the host writes it: on CUDA pinned host
    memory, which the device reaches at the same address (no copy: the kernel's loads cross
    the bus when it runs). :meth:`put` adds an entry of the forward being staged, :meth:`send`
    writes them into the next table and makes it :attr:`current`. A table is written again
    two sends later; its reader (the side half that read it) has run by then, after the
    read-back of that forward was consumed, and :meth:`mark_read` records it; should that
    reader still be pending (a forward aborted in between), :meth:`send` waits for it.
    Allocation-free."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        # pinned memory comes from cudaHostAlloc, mapped into the device's address space
        self.tables = tuple(
            torch.zeros(STAGE_TABLE_NUMEL, dtype=torch.int64, pin_memory=cuda) for _ in range(2)
        )
        self._table_words = [t.numpy() for t in self.tables]
        self._read = [torch.cuda.Event() for _ in range(2)] if cuda else None
        # the device whose current stream runs the readers (CUDA only)
        self._device_index = cuda_streams.device_index(device) if cuda else None
        self.current = 1  # the table of the last send (the first send writes table 0)
        self._words: List[int] = []

    def put(self, dst: int, numel: int, kind: int, a: int = 0, b: int = 0) -> None:
        """An entry: ``numel`` int64 elements at address ``dst`` (none: no entry)."""
        if numel > 0:
            self._words += (dst, a, b, numel, kind)

    def send(self) -> int:
        """Write the entries put since the last send into the next table and make it
        :attr:`current` (returned); no sync unless that table's previous reader is still
        pending."""
        words, self._words = self._words, []
        count = len(words) // STAGE_ENTRY_FIELDS
        if count > STAGE_MAX_ENTRIES:  # the callers' entries are fixed: a bug, not an input
            raise RuntimeError(
                f"kv_canary: {count} staging entries for a table of {STAGE_MAX_ENTRIES}"
            )
        flip = self.current ^ 1
        if self._read is not None and not self._read[flip].query():
            self._read[flip].synchronize()
        table = self._table_words[flip]
        table[STAGE_NUM_ENTRIES] = count
        table[STAGE_HEADER : STAGE_HEADER + len(words)] = words
        self.current = flip
        return flip

    def mark_read(self) -> None:
        """The current table's reader is queued on the current stream (CUDA: an event
        there, which :meth:`send` checks before writing that table again)."""
        if self._read is not None:
            self._read[self.current].record(cuda_streams.current_stream(self._device_index))


class EagerForwardGraphs:
    """Static launch inputs of one single-forward manager, and (on CUDA, after
    :meth:`capture`) the graphs holding ``side_launches`` (one per staging table: the staging
    kernel reads its table's address) / ``tail_launches`` on them.
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
        self._addresses = (
            self.input_ids.data_ptr(),
            self.positions.data_ptr(),
            self.out_cache_loc.data_ptr(),
        )
        self._device_index = self.input_ids.get_device()
        self._device = self.input_ids.device
        self._tokens_filled = 0  # entries [0, _tokens_filled) hold an earlier forward's slots
        self._table = StageTable(torch.device(device))
        self.inputs = ForwardLaunchInputs(
            req_pool_indices=plan_input.req_pool_indices,
            prefix_lens=plan_input.prefix_lens,
            extend_seq_lens=plan_input.extend_seq_lens,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            expected_inputs=expected_inputs.views(cap) if expected_inputs is not None else None,
        )
        self._side_graphs: Optional[Tuple["torch.cuda.CUDAGraph", ...]] = None
        self._tail_graph: Optional["torch.cuda.CUDAGraph"] = None

    @property
    def captured(self) -> bool:
        return self._side_graphs is not None

    def capture(self) -> None:
        """Run both halves once on all-padding inputs, then capture them (the side half on
        the side stream, once per staging table). At start-up only (it synchronizes the
        device); CUDA only."""
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
            self._side_half(0)
            self._tail_launches(self.inputs)
        torch.cuda.synchronize(stream.device)
        sides = tuple(torch.cuda.CUDAGraph() for _ in self._table.tables)
        tail = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call cannot break the capture
        for table, side in enumerate(sides):
            with torch.cuda.graph(side, stream=stream, capture_error_mode="thread_local"):
                self._side_half(table)
        with torch.cuda.graph(tail, capture_error_mode="thread_local"):
            self._tail_launches(self.inputs)
        self._side_graphs, self._tail_graph = sides, tail

    def stage(self, forward_batch: "ForwardBatch", num_tokens: int) -> None:
        """Stage the forward's inputs (on the current stream: the side stream, after the fork
        point): the staging table's entries of the plan input
        (:meth:`PlanInput.stage_entries`), the tokens, positions and slots, and the reset of
        the slots an earlier, larger forward left, written into the next staging table.
        ``num_tokens``: the forward's token count (its ``out_cache_loc`` length). Raises
        ``ValueError`` naming a batch field the kernel cannot read (not contiguous int32 /
        int64 on the canary's device)."""
        table = self._table
        put = table.put
        self._plan_input.stage_entries(forward_batch, put)
        n = num_tokens
        ids, positions, slots = self._addresses
        index = self._device_index
        put(ids, n, *stage_source(forward_batch.input_ids, n, "input_ids", index))
        put(positions, n, *stage_source(forward_batch.positions, n, "positions", index))
        put(slots, n, *stage_source(forward_batch.out_cache_loc, n, "out_cache_loc", index))
        if self._tokens_filled > n:
            put(slots + 8 * n, self._tokens_filled - n, STAGE_OP_FILL, 0, 0)
        table.send()
        self._tokens_filled = n

    def _side_half(self, table: int) -> None:
        """The side half's launches: the staging kernel reading staging table ``table``, then
        ``side_launches``."""
        launch_stage_inputs_kernel(table=self._table.tables[table], device=self._device)
        self._side_launches(self.inputs)

    def run_side(self) -> None:
        """The side half on the staged inputs (a replay once captured), reading the table the
        last :meth:`stage` wrote."""
        table = self._table.current
        if self._side_graphs is not None:
            self._side_graphs[table].replay()
        else:
            self._side_half(table)
        self._table.mark_read()

    def run_tail(self) -> None:
        """The tail half on the staged inputs (a replay once captured)."""
        if self._tail_graph is not None:
            self._tail_graph.replay()
        else:
            self._tail_launches(self.inputs)
