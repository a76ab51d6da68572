"""``PlanInput``: per-forward (prefix, extend) per request, normalised across forward modes.

The buffers are allocated once (``write_req_capacity`` rows) and refilled in place by
:meth:`PlanInput.fill_from_forward_batch`, so the fill is capturable in a CUDA graph: only
device copies between static tensors, no allocation, no host sync.
"""

from __future__ import annotations

from typing import Tuple

import torch

from sglang.srt.kv_canary import sglang_seam
from sglang.srt.kv_canary.sglang_seam import ForwardMode


class PlanInput:
    """Static ``prefix_lens`` / ``extend_seq_lens`` / ``req_pool_indices`` int64
    ``[write_req_capacity]`` buffers (``req_pool_indices``: only for :meth:`fill_padded`).

    Normalisation (docs/architecture.md, "Runtime"): decode / idle → prefix = positions, extend
    = 1; extend / mixed →
    prefix = extend_prefix_lens, extend = extend_seq_lens; target-verify (EAGLE) → prefix =
    seq_lens, extend = draft_token_num; draft-extend → prefix = seq_lens - extend_seq_lens,
    extend = extend_seq_lens. Any other mode raises ``NotImplementedError`` naming it.
    """

    def __init__(self, *, write_req_capacity: int, device):
        self.write_req_capacity = write_req_capacity
        self.prefix_lens = torch.zeros(write_req_capacity, dtype=torch.int64, device=device)
        self.extend_seq_lens = torch.zeros(write_req_capacity, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(write_req_capacity, dtype=torch.int64,
                                            device=device)
        # rows [0, _rows_filled) of req_pool_indices hold a batch's rows; the rest are 0
        self._rows_filled = 0

    def fill_from_forward_batch(self, forward_batch) -> Tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
        """Fill from ``forward_batch``; returns ``(req_pool_indices, prefix_lens[:bs],
        extend_seq_lens[:bs])`` with ``bs = req_pool_indices.shape[0]`` (padded in graphs)."""
        mode = forward_batch.forward_mode
        rpi = forward_batch.req_pool_indices
        bs = rpi.shape[0]  # within capacity: checked outside the graph by the manager
        prefix = self.prefix_lens[:bs]
        extend = self.extend_seq_lens[:bs]
        if mode in (ForwardMode.DECODE, ForwardMode.IDLE):
            prefix.copy_(forward_batch.positions[:bs])
            extend.fill_(1)
        elif mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            prefix.copy_(forward_batch.extend_prefix_lens)
            extend.copy_(forward_batch.extend_seq_lens)
        elif mode == ForwardMode.TARGET_VERIFY:
            prefix.copy_(forward_batch.seq_lens[:bs])
            extend.fill_(sglang_seam.draft_token_num(forward_batch))
        elif mode in (ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2):
            torch.sub(forward_batch.seq_lens[:bs], forward_batch.extend_seq_lens, out=prefix)
            extend.copy_(forward_batch.extend_seq_lens)
        else:
            raise NotImplementedError(
                f"kv_canary does not support forward mode {mode.name}; supported: DECODE, IDLE, "
                "EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_EXTEND_V2"
            )
        return rpi, prefix, extend

    def fill_padded(self, forward_batch) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fill like :meth:`fill_from_forward_batch`, and copy the batch's
        ``req_pool_indices`` into the static buffer; returns the three whole buffers
        (``[write_req_capacity]``): rows past the batch are padding rows
        (``req_pool_indices`` 0: no verify entries, no writes, whatever their prefix and
        extend). What a launch sequence captured once for every batch reads
        (:class:`~sglang.srt.kv_canary.single_forward_manager.eager_graphs.EagerForwardGraphs`).
        Device copies only (a zero fill of the rows a larger earlier batch left); host-known
        sizes, no sync. Not for use inside a capture."""
        rpi, _, _ = self.fill_from_forward_batch(forward_batch)
        bs = rpi.shape[0]
        self.req_pool_indices[:bs].copy_(rpi)
        if self._rows_filled > bs:
            self.req_pool_indices[bs:self._rows_filled].zero_()
        self._rows_filled = bs
        return self.req_pool_indices, self.prefix_lens, self.extend_seq_lens


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
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND,
                ForwardMode.DRAFT_EXTEND_V2):
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
        "DECODE, IDLE, EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_EXTEND_V2")
