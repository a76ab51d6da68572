"""Violation-ring append for the torch references (host-synchronous; not graph code)."""

from __future__ import annotations

import torch

from sglang.jit_kernel.kv_canary.consts import NO_KV_LAYER


def append_violation_rows(
    violation_ring: torch.Tensor, violation_write_index: torch.Tensor, rows: torch.Tensor
) -> None:
    """Append int64 ``[n, VIOLATION_NUM_FIELDS]`` rows in order; rows past capacity are dropped, all are counted."""
    n = rows.shape[0]
    if n == 0:
        return
    start = int(violation_write_index[0].item())
    keep = max(0, min(n, violation_ring.shape[0] - max(start, 0)))
    if keep:
        violation_ring[start : start + keep] = rows[:keep].to(violation_ring.device)
    violation_write_index.add_(n)


def violation_rows(
    kernel_kind,
    slot,
    position,
    stored_token,
    expected_token,
    chain_hash,
    aux,
    bits,
    read_position,
    req_to_token_row,
    kv_layer=None,
) -> torch.Tensor:
    """Stack the ring columns (int64 ``[n]`` tensors each) into ``[n, VIOLATION_NUM_FIELDS]``,
    in the column order of ``consts``. ``kernel_kind``: an int, or int64 ``[n]`` per row;
    ``kv_layer``: int64 ``[n]`` (None: ``NO_KV_LAYER`` on every row)."""
    if kv_layer is None:
        kv_layer = torch.full_like(slot, NO_KV_LAYER, dtype=torch.int64)
    cols = [
        slot,
        position,
        stored_token,
        expected_token,
        chain_hash,
        aux,
        bits,
        read_position,
        req_to_token_row,
        kv_layer,
    ]
    n = slot.shape[0]
    if isinstance(kernel_kind, torch.Tensor):
        kind = kernel_kind.to(torch.int64)
    else:
        kind = torch.full((n,), int(kernel_kind), dtype=torch.int64, device=slot.device)
    return torch.stack([kind] + [c.to(torch.int64) for c in cols], dim=1)
