"""Fixed capacities of the per-forward canary buffers (allocated once, before graph capture)."""

from __future__ import annotations

import dataclasses
from typing import Optional

# Shared radix prefixes make the sum of the batch's prefix lengths exceed the pool size.
VERIFY_CAPACITY_SLOTS_FACTOR = 3


@dataclasses.dataclass(frozen=True)
class CanaryLaunchCapacities:
    """``verify_capacity``: verify entries of one forward per group; ``write_req_capacity``:
    requests of one forward incl. CUDA-graph padding; ``write_entry_capacity``: tokens of one
    forward."""

    verify_capacity: int
    write_req_capacity: int
    write_entry_capacity: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"CanaryLaunchCapacities.{f.name} must be an int >= 1, got {v!r}")

    @classmethod
    def from_args(cls, *, num_slots: int, max_running_requests: int,
                  max_tokens_per_forward: int, cuda_graph_max_bs: Optional[int] = None,
                  tokens_per_request_in_graph: int = 1) -> "CanaryLaunchCapacities":
        """Derive capacities from the pool size and the scheduler's limits.

        ``num_slots``: KV pool rows (incl. padding slot); ``max_running_requests``: scheduler
        limit (``--max-running-requests``); ``max_tokens_per_forward``: most tokens one forward
        may carry (``--max-prefill-tokens`` / ``--chunked-prefill-size`` plus decodes);
        ``cuda_graph_max_bs`` and ``tokens_per_request_in_graph`` (draft tokens for EAGLE).
        """
        reqs = max(max_running_requests, cuda_graph_max_bs or 0, 1)
        entries = max(max_tokens_per_forward, reqs * tokens_per_request_in_graph, 1)
        return cls(
            verify_capacity=VERIFY_CAPACITY_SLOTS_FACTOR * max(num_slots, 1),
            write_req_capacity=reqs,
            write_entry_capacity=entries,
        )
