"""Violation-ring append for the torch references (host-synchronous; not graph code)."""

from __future__ import annotations

import torch


def append_violation_rows(violation_ring: torch.Tensor, violation_write_index: torch.Tensor,
                          rows: torch.Tensor) -> None:
    """Append int64 ``[n, VIOLATION_NUM_FIELDS]`` rows in order; rows past capacity are dropped, all are counted."""
    n = rows.shape[0]
    if n == 0:
        return
    start = int(violation_write_index[0].item())
    keep = max(0, min(n, violation_ring.shape[0] - max(start, 0)))
    if keep:
        violation_ring[start:start + keep] = rows[:keep].to(violation_ring.device)
    violation_write_index.add_(n)


def violation_rows(kernel_kind: int, slot, position, stored_token, expected_token, chain_hash,
                   aux, bits, read_position, req_to_token_row) -> torch.Tensor:
    """Stack the ring columns (int64 ``[n]`` tensors each) into ``[n, VIOLATION_NUM_FIELDS]``,
    in the column order of ``consts``."""
    cols = [slot, position, stored_token, expected_token, chain_hash, aux, bits, read_position,
            req_to_token_row]
    n = slot.shape[0]
    kind = torch.full((n,), int(kernel_kind), dtype=torch.int64, device=slot.device)
    return torch.stack([kind] + [c.to(torch.int64) for c in cols], dim=1)
