"""Static buffers holding what each written token / position is expected to be.

Filled outside the CUDA graph (by the token oracle, docs/subsystems.md, "Self-tests") before
each forward; read by
the write kernel when ``SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT=1``. Allocated once.
"""

from __future__ import annotations

from typing import Tuple

import torch


class ExpectedInputs:
    """int64 ``[write_entry_capacity]`` expected tokens and positions."""

    def __init__(self, *, write_entry_capacity: int, device):
        self.tokens = torch.zeros(write_entry_capacity, dtype=torch.int64, device=device)
        self.positions = torch.zeros(write_entry_capacity, dtype=torch.int64, device=device)

    def views(self, num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[:num_tokens], self.positions[:num_tokens]

    def set(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy this forward's expectations in (outside the graph). Entries past them are
        zeroed: a decode CUDA graph padded to a larger batch writes its padding rows with token
        0 at position 0 (the plugin zeroes those static inputs before each replay when the
        write-input check is on), so they must expect exactly that."""
        n = tokens.shape[0]
        if positions.shape[0] != n or n > self.tokens.shape[0]:
            raise ValueError(
                f"expected inputs of {n} tokens / {positions.shape[0]} positions do "
                f"not fit the capacity {self.tokens.shape[0]}"
            )
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.tokens[n:].zero_()
        self.positions[n:].zero_()
