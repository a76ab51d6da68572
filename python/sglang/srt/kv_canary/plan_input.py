"""``PlanInput``: per-forward (prefix, extend) per request, normalised across forward modes.

The buffers are allocated once (``write_req_capacity`` rows) and refilled in place by
:meth:`PlanInput.fill_from_forward_batch`, so the fill is capturable in a CUDA graph: only
device copies between static tensors, no allocation, no host sync.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch

from sglang.jit_kernel.kv_canary.types import PlanLanes

from sglang.jit_kernel.kv_canary.consts import (
    STAGE_A_INT32,
    STAGE_B_INT32,
    STAGE_OP_COPY,
    STAGE_OP_FILL,
    STAGE_OP_STRIDE,
    STAGE_OP_SUB,
)
from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.sglang_seam import ForwardMode

# a staging table's entry: (destination address, element count, kind, source A, source B or
# the fill value): consts.STAGE_*
StagePut = Callable[[int, int, int, int, int], None]


class StaticPrefixViews:
    """``buf[:n]`` of each of some static buffers, cached by ``n`` (at most ``max_entries``
    lengths, the oldest dropped first): a slice costs the host about 2 µs, and a forward's
    launches slice the same buffers to the same few lengths (decode batch sizes, prefill
    chunks) again and again. Views of buffers that are never resized stay valid."""

    def __init__(self, *buffers: torch.Tensor, max_entries: int = 256):
        if max_entries < 1:
            raise ValueError(f"StaticPrefixViews needs max_entries >= 1, got {max_entries}")
        self._buffers = buffers
        self._max_entries = max_entries
        self._views: Dict[int, Tuple[torch.Tensor, ...]] = {}

    def __call__(self, n: int) -> Tuple[torch.Tensor, ...]:
        views = self._views.get(n)
        if views is None:
            if len(self._views) >= self._max_entries:
                del self._views[next(iter(self._views))]
            views = self._views[n] = tuple(b[:n] for b in self._buffers)
        return views


@dataclasses.dataclass(frozen=True)
class LaneLayout:
    """Where a draft round's lanes sit in ``req_to_token`` (sglang 0.5.12's
    ``EAGLEWorker._draft_preprocess_decode``, docs/speculative_trees.md, "1.1 Draft round
    (draft pool, `DECODE` forwards)"): ``topk`` lanes (>= 2) of ``steps`` slots (>= 1,
    ``--speculative-num-steps``) per request, at ``--page-size`` ``page_size`` (>= 1). Page
    size 1: lane k's step j at column ``L + k * steps + j``; page size > 1: each lane takes
    ``npp = ceil((L % page_size + steps) / page_size)`` whole pages from the prefix's last page
    boundary ``L - L % page_size``, lane k's step j at column ``L + k * npp * page_size + j``
    and, for k >= 1, a copy of the prefix's last partial page at the head of its first page.
    Plain ints, validated here."""

    topk: int
    steps: int
    page_size: int = 1

    def __post_init__(self):
        for name, low in (("topk", 2), ("steps", 1), ("page_size", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"LaneLayout.{name} must be an int >= {low}, got {v!r}")


def leading(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t[:n]``, without a new view when ``t`` has exactly ``n`` rows."""
    return t if t.shape[0] == n else t[:n]


class PlanInput:
    """Static ``prefix_lens`` / ``extend_seq_lens`` / ``req_pool_indices`` int64
    ``[write_req_capacity]`` buffers (``req_pool_indices``: only for :meth:`stage_entries`).

    Normalisation (docs/architecture.md, "Runtime"): decode / idle → prefix = positions, extend
    = 1; extend / mixed →
    prefix = extend_prefix_lens, extend = extend_seq_lens; target-verify (EAGLE) → prefix =
    seq_lens, extend = draft_token_num (``block_prefix_from_positions``: prefix =
    ``positions[row * draft_token_num]``); draft-extend → prefix = seq_lens - extend_seq_lens,
    extend = extend_seq_lens. Any other mode raises ``NotImplementedError`` naming it.
    """

    def __init__(
        self,
        *,
        write_req_capacity: int,
        device,
        lanes: Optional[LaneLayout] = None,
        block_prefix_from_positions: bool = False,
    ):
        """``lanes``: the lane layout of a draft runner with ``--speculative-eagle-topk`` > 1:
        its decode forwards (the draft round's) are planned one row per lane (:meth:`fill_lanes`).
        ``block_prefix_from_positions``: DFLASH's draft runner, whose ``TARGET_VERIFY`` blocks
        carry the draft's own resident length as ``seq_lens`` (with
        ``--speculative-draft-window-size``, the compact window ``W'``) and the absolute
        positions ``L .. L + B - 1`` per row: the prefix is each row's first position, ``L``,
        read through the target's ``req_to_token`` (docs/speculative_multilayer_adaptive_dflash_mtp.md,
        "3.4 Changes to the canary")."""
        self.write_req_capacity = write_req_capacity
        self.block_prefix_from_positions = bool(block_prefix_from_positions)
        self.prefix_lens = torch.zeros(write_req_capacity, dtype=torch.int64, device=device)
        self.extend_seq_lens = torch.zeros(write_req_capacity, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(write_req_capacity, dtype=torch.int64, device=device)
        # the source of decode's extend of 1 (fill_from_forward_batch's copies)
        self._ones = torch.ones(write_req_capacity, dtype=torch.int64, device=device)
        self._views = StaticPrefixViews(
            self.prefix_lens, self.extend_seq_lens, self.req_pool_indices, self._ones
        )
        # rows [0, _rows_filled) of req_pool_indices hold a batch's rows; the rest are 0
        self._rows_filled = 0
        # the staging table's destinations
        self._addresses = (
            self.prefix_lens.data_ptr(),
            self.extend_seq_lens.data_ptr(),
            self.req_pool_indices.data_ptr(),
        )
        self._device_index = self.prefix_lens.get_device()
        self.lanes: Optional[PlanLanes] = None
        self.lane_layout = lanes
        if lanes is not None:
            if not isinstance(lanes, LaneLayout):
                raise TypeError(f"PlanInput lanes must be a LaneLayout, got {lanes!r}")
            topk, steps = lanes.topk, lanes.steps
            self._topk = topk
            row = torch.arange(write_req_capacity, dtype=torch.int64, device=device)
            # static per row: its request (row // topk), whether it is a lane k >= 1, its shift
            self._lane_request = row // topk
            self._later_lane = (row % topk > 0).to(torch.int64)
            # the batch's committed lengths as int64: sglang's graph runners hold seq_lens as
            # int32 (their static buffers), an eager batch as int64; index_select needs one dtype
            self._committed = torch.zeros(write_req_capacity, dtype=torch.int64, device=device)
            self.lane_rows = torch.zeros(write_req_capacity, dtype=torch.int64, device=device)
            self._lane_valid_lens = torch.zeros(
                write_req_capacity, dtype=torch.int64, device=device
            )
            # page size 1: the shift is static (k * steps); larger pages: k * page_size per
            # row, times the request's pages per lane (filled per forward, fill_lanes)
            self._lane_page_stride = (row % topk) * lanes.page_size if lanes.page_size > 1 else None
            self.lanes = PlanLanes(
                verify_from=torch.zeros(write_req_capacity, dtype=torch.int64, device=device),
                branch_split=torch.zeros(write_req_capacity, dtype=torch.int64, device=device),
                branch_shift=(
                    (row % topk) * steps
                    if lanes.page_size == 1
                    else torch.zeros(write_req_capacity, dtype=torch.int64, device=device)
                ),
            )
            self._lane_views: Dict[int, PlanLanes] = {}

    def _plan_copies(
        self, forward_batch, bs: int, dst: List[torch.Tensor], src: List[torch.Tensor]
    ) -> None:
        """Append the (destination, source) copies that fill ``prefix_lens[:bs]`` /
        ``extend_seq_lens[:bs]`` for ``forward_batch``'s mode; the modes whose values are no
        tensor's copy (target-verify's extend, draft-extend's prefix) are filled here."""
        mode = forward_batch.forward_mode
        prefix, extend, _, ones = self._views(bs)
        if mode in (ForwardMode.DECODE, ForwardMode.IDLE):
            dst += (prefix, extend)
            src += (leading(forward_batch.positions, bs), ones)
        elif mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            dst += (prefix, extend)
            src += (forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens)
        elif mode == ForwardMode.TARGET_VERIFY:
            n = sglang_seam.draft_token_num(forward_batch)
            dst.append(prefix)
            if self.block_prefix_from_positions:  # each row's first position
                src.append(forward_batch.positions[: bs * n : n])
            else:
                src.append(leading(forward_batch.seq_lens, bs))
            extend.fill_(n)
        elif mode in (ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2):
            torch.sub(
                leading(forward_batch.seq_lens, bs), forward_batch.extend_seq_lens, out=prefix
            )
            dst.append(extend)
            src.append(forward_batch.extend_seq_lens)
        else:
            raise NotImplementedError(
                f"kv_canary does not support forward mode {mode.name}; supported: DECODE, IDLE, "
                "EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_EXTEND_V2"
            )

    def is_lane_forward(self, forward_batch) -> bool:
        """A draft round's forward planned by lanes (``lanes`` given, a decode forward)."""
        return self.lanes is not None and forward_batch.forward_mode in (
            ForwardMode.DECODE,
            ForwardMode.IDLE,
        )

    def fill_lanes(
        self, forward_batch
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, PlanLanes]:
        """A draft round's forward of ``bs`` requests and ``topk`` lanes each (its tokens,
        positions and slots ``[bs * topk]``, row ``b * topk + k``): fill ``bs * topk`` rows
        and return them as ``(req_pool_indices, prefix_lens, extend_seq_lens, lanes)``, all
        int64 ``[bs * topk]`` views of static buffers: request b's ``req_to_token`` row,
        prefix = the lane's position (``forward_batch.positions``), extend 1, and the lane's
        columns (docs/speculative_trees.md, "4.2 Plan"), with L = ``seq_lens[b]`` (int32 in
        sglang's graph runners, int64 in an eager batch):

        - page size 1: ``branch_split`` = L, ``branch_shift`` = ``k * steps`` (static),
          ``verify_from`` = L for k >= 1, 0 for k = 0 (the shared prefix verified once, by
          lane 0);
        - page size P > 1: ``branch_split`` = ``L - L % P``, ``branch_shift`` = ``k * npp * P``
          with ``npp = (L % P + steps + P - 1) // P``, ``verify_from`` = ``L - L % P`` for k
          >= 1, 0 for k = 0: lane k >= 1 also verifies its copy of the prefix's last partial
          page (its first ``L % P`` columns), which sglang's ``move_kv_cache`` on the draft
          pool filled and the plugin's hook gave the prefix's records.

        Graph-safe (captured in ``EAGLEDraftCudaGraphRunner``): index and arithmetic ops into
        static buffers (``out=`` / in place), no allocation, no host sync."""
        bs = forward_batch.req_pool_indices.shape[0]
        rows = bs * self._topk
        request = self._lane_request[:rows]
        prefix, extend, _, ones = self._views(rows)
        lane_rows = self.lane_rows[:rows]
        torch.index_select(forward_batch.req_pool_indices, 0, request, out=lane_rows)
        prefix.copy_(leading(forward_batch.positions, rows))
        extend.copy_(ones)
        split = self.lanes.branch_split[:rows]
        verify_from = self.lanes.verify_from[:rows]
        committed = self._committed[:bs]
        committed.copy_(leading(forward_batch.seq_lens, bs))
        torch.index_select(committed, 0, request, out=split)
        if self._lane_page_stride is not None:
            page, steps = self.lane_layout.page_size, self.lane_layout.steps
            shift = self.lanes.branch_shift[:rows]
            # verify_from holds L % P for now: the partial page's length
            torch.remainder(split, page, out=verify_from)
            split.sub_(verify_from)  # the prefix's last page boundary L - L % P
            # pages per lane, npp = (L % P + steps + P - 1) // P, then k * npp * P
            torch.add(verify_from, steps + page - 1, out=shift)
            shift.div_(page, rounding_mode="floor")
            shift.mul_(self._lane_page_stride[:rows])
        torch.mul(split, self._later_lane[:rows], out=verify_from)
        return lane_rows, prefix, extend, self._lane_view(rows)

    def lane_valid_lens(self, per_request: torch.Tensor, rows: int) -> torch.Tensor:
        """The expected-token pool's valid lengths of a lane forward's ``rows`` rows: each
        lane its request's (``per_request[row // topk]``), in a static buffer."""
        out = self._lane_valid_lens[:rows]
        torch.index_select(per_request, 0, self._lane_request[:rows], out=out)
        return out

    def _lane_view(self, rows: int) -> PlanLanes:
        view = self._lane_views.get(rows)
        if view is None:
            lanes = self.lanes
            view = self._lane_views[rows] = PlanLanes(
                verify_from=lanes.verify_from[:rows],
                branch_split=lanes.branch_split[:rows],
                branch_shift=lanes.branch_shift[:rows],
            )
        return view

    def fill_from_forward_batch(
        self, forward_batch
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fill from ``forward_batch``; returns ``(req_pool_indices, prefix_lens[:bs],
        extend_seq_lens[:bs])`` with ``bs = req_pool_indices.shape[0]`` (padded in graphs)."""
        rpi = forward_batch.req_pool_indices
        bs = rpi.shape[0]  # within capacity: checked outside the graph by the manager
        dst: List[torch.Tensor] = []
        src: List[torch.Tensor] = []
        self._plan_copies(forward_batch, bs, dst, src)
        for d, s_ in zip(dst, src):
            d.copy_(s_)
        prefix, extend, _, _ = self._views(bs)
        return rpi, prefix, extend

    def stage_entries(self, forward_batch, put: "StagePut") -> None:
        """The staging table's entries (``put(dst_address, numel, kind, a, b)``: see
        ``consts.STAGE_*``) that fill the three buffers as :meth:`fill_from_forward_batch`
        would, with the batch's ``req_pool_indices`` in the static buffer and the rows past
        the batch reset to 0 (padding rows: no verify entries, no writes, whatever their
        prefix and extend). What a launch sequence captured once for every batch reads
        (:class:`~sglang.srt.kv_canary.single_forward_manager.eager_graphs.EagerForwardGraphs`).
        Host only: addresses, no launch."""
        mode = forward_batch.forward_mode
        rpi = forward_batch.req_pool_indices
        bs = rpi.shape[0]
        prefix, extend, rows = self._addresses
        source = self._source
        if mode in (ForwardMode.DECODE, ForwardMode.IDLE):
            put(prefix, bs, *source(forward_batch.positions, bs, "positions"))
            put(extend, bs, STAGE_OP_FILL, 0, 1)
        elif mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            put(prefix, bs, *source(forward_batch.extend_prefix_lens, bs, "extend_prefix_lens"))
            put(extend, bs, *source(forward_batch.extend_seq_lens, bs, "extend_seq_lens"))
        elif mode == ForwardMode.TARGET_VERIFY:
            n = sglang_seam.draft_token_num(forward_batch)
            if self.block_prefix_from_positions:  # each row's first position
                kind, pos = source(forward_batch.positions, bs * n, "positions")
                put(prefix, bs, kind | STAGE_OP_STRIDE, pos, n)
            else:
                put(prefix, bs, *source(forward_batch.seq_lens, bs, "seq_lens"))
            put(extend, bs, STAGE_OP_FILL, 0, n)
        elif mode in (ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2):
            kind_a, seq = source(forward_batch.seq_lens, bs, "seq_lens")
            kind_b, ext = source(forward_batch.extend_seq_lens, bs, "extend_seq_lens")
            int32_b = STAGE_B_INT32 if kind_b & STAGE_A_INT32 else 0
            put(prefix, bs, STAGE_OP_SUB | (kind_a & STAGE_A_INT32) | int32_b, seq, ext)
            put(extend, bs, kind_b, ext)
        else:
            raise NotImplementedError(
                f"kv_canary does not support forward mode {mode.name}; supported: DECODE, IDLE, "
                "EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_EXTEND_V2"
            )
        put(rows, bs, *source(rpi, bs, "req_pool_indices"))
        if self._rows_filled > bs:
            put(rows + 8 * bs, self._rows_filled - bs, STAGE_OP_FILL, 0, 0)
        self._rows_filled = bs

    def _source(self, t: torch.Tensor, n: int, name: str) -> Tuple[int, int]:
        """``(kind, address)`` of a copy from the first ``n`` elements of sglang's ``t``;
        raises ``ValueError`` naming the field unless they are int32 / int64, contiguous and
        on the canary's device (the staging kernel reads them through their address)."""
        return stage_source(t, n, name, self._device_index)


def stage_source(t: torch.Tensor, n: int, name: str, device_index: int) -> Tuple[int, int]:
    """``(kind, address)`` of a staging copy from the first ``n`` elements of ``t`` (a
    ``ForwardBatch`` field named ``name``): ``STAGE_OP_COPY``, with ``STAGE_A_INT32`` for an
    int32 source. Raises ``ValueError`` naming the field unless ``t`` is a 1-D int32 / int64
    tensor of at least ``n`` contiguous elements on device ``device_index`` (-1: the CPU)."""
    dtype = t.dtype
    if (
        (dtype is not torch.int64 and dtype is not torch.int32)
        or t.dim() != 1
        or t.shape[0] < n
        or (n > 1 and t.stride(0) != 1)
        or t.get_device() != device_index
    ):
        raise ValueError(
            f"kv_canary: ForwardBatch.{name} must be a contiguous 1-D int32 or int64 tensor of "
            f"at least {n} elements on the canary's device (index {device_index}, -1: CPU); got "
            f"{dtype}, shape {tuple(t.shape)}, stride {tuple(t.stride())}, device {t.device}"
        )
    return (STAGE_A_INT32 if dtype is torch.int32 else STAGE_OP_COPY), t.data_ptr()


def host_prefix_extend(forward_batch) -> Tuple[list, list, list]:
    """Host copy of the batch's ``(req_pool_indices, prefix_lens, extend_seq_lens)`` as lists,
    normalised like :meth:`PlanInput.fill_from_forward_batch` (an EAGLE draft round's decode
    forwards: the committed prefix, ``seq_lens - 1``, without the round's earlier draft
    tokens). Prefers the batch's ``*_cpu`` fields; falls back to reading the device tensors (a
    host sync). For host-side consumers only (the token oracle, fault injection), never on the
    CUDA-graph path."""
    mode = forward_batch.forward_mode
    rows = forward_batch.req_pool_indices.tolist()
    seq = forward_batch.seq_lens_cpu
    seq = seq.tolist() if seq is not None else forward_batch.seq_lens.tolist()
    seq = [int(s) for s in seq[: len(rows)]]
    if mode in (ForwardMode.DECODE, ForwardMode.IDLE):
        return rows, [s - 1 for s in seq], [1] * len(rows)
    if mode == ForwardMode.TARGET_VERIFY:
        n = sglang_seam.draft_token_num(forward_batch)
        return rows, seq, [n] * len(rows)
    if mode in (
        ForwardMode.EXTEND,
        ForwardMode.MIXED,
        ForwardMode.DRAFT_EXTEND,
        ForwardMode.DRAFT_EXTEND_V2,
    ):
        extend = forward_batch.extend_seq_lens_cpu
        if extend is None:
            extend = forward_batch.extend_seq_lens.tolist()
        extend = [int(x) for x in extend[: len(rows)]]
        if mode in (ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2):
            return rows, [s - e for s, e in zip(seq, extend)], extend
        prefix = forward_batch.extend_prefix_lens_cpu
        if prefix is None:
            prefix = forward_batch.extend_prefix_lens.tolist()
        return rows, [int(x) for x in prefix[: len(rows)]], extend
    raise NotImplementedError(
        f"kv_canary host-side batch view does not support forward mode {mode.name}; supported: "
        "DECODE, IDLE, EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_EXTEND_V2"
    )
