"""Fixed capacities of the per-forward canary buffers (allocated once, before graph capture).

The one place that derives them from the server's limits: :class:`CanaryCapacityInputs`
(what the server says) → :meth:`CanaryLaunchCapacities.for_server` (what the canary
allocates). The builder is its only production caller; tests and benchmarks go through the
builder too."""

from __future__ import annotations

import dataclasses
from typing import Optional

# Shared radix prefixes make the sum of the batch's prefix lengths exceed the pool size.
VERIFY_CAPACITY_SLOTS_FACTOR = 3

# verify entries of one radix-sweep chunk (the sweep's own plan)
SWEEP_CHUNK_CAPACITY = 1 << 20

# tokens per request that a replayed forward's token-history upload carries in the static
# buffer its graph reads (a decode step sends 1, a verified speculative step a few); the
# buffer also holds a forward's worth of tokens (the canary's token capacity), what an eager
# forward's graph scatters (a prefill chunk's new tokens). A larger upload goes by its own
# launch before the replay.
REPLAY_TOKENS_PER_REQUEST = 8
# token checks: the host buffers token-id snapshots are packed into, each of the replay
# buffer's size (a forward's snapshot, the next batch's, and those batches sglang still holds)
SNAPSHOT_HOST_BUFFERS = 8


@dataclasses.dataclass(frozen=True)
class CanaryCapacityInputs:
    """The server limits the capacities follow (``ServerArgs`` / the model config):
    ``context_len`` (the model's context length), ``chunked_prefill_size`` (None or <= 0 =
    unchunked), ``max_prefill_tokens`` (0 = unset), ``cuda_graph_max_bs`` (None = no decode
    graphs, or sglang's default) and ``verify_tokens_per_request`` (a speculative verify's
    tokens per request, ``--speculative-num-draft-tokens``; 1 without)."""

    context_len: int
    chunked_prefill_size: Optional[int] = None
    max_prefill_tokens: int = 0
    cuda_graph_max_bs: Optional[int] = None
    verify_tokens_per_request: int = 1

    def __post_init__(self):
        for name in ("context_len", "verify_tokens_per_request"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"CanaryCapacityInputs.{name} must be an int >= 1, got {v!r}")


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
    def from_args(
        cls,
        *,
        num_slots: int,
        max_running_requests: int,
        max_tokens_per_forward: int,
        cuda_graph_max_bs: Optional[int] = None,
        tokens_per_request_in_graph: int = 1,
    ) -> "CanaryLaunchCapacities":
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

    @classmethod
    def for_server(
        cls,
        *,
        num_slots: int,
        req_to_token_rows: int,
        inputs: CanaryCapacityInputs,
        rows_per_request: int = 1,
    ) -> "CanaryLaunchCapacities":
        """The capacities of a server: one request per ``req_to_token`` row (sglang sizes the
        table from ``--max-running-requests``), and one forward carries at most a prefill
        batch (``max(--max-prefill-tokens, --chunked-prefill-size)``) or one unchunked prompt
        (the context length), plus the decodes mixed into it, or a speculative verify of every
        request (``verify_tokens_per_request`` each: NGRAM's trees can hold more tokens than a
        prompt). ``rows_per_request``: plan rows of one request in a forward (a draft round's
        lanes with ``--speculative-eagle-topk`` K: K rows and K tokens per request)."""
        if isinstance(rows_per_request, bool) or not isinstance(rows_per_request, int):
            raise TypeError(f"rows_per_request must be an int, got {rows_per_request!r}")
        if rows_per_request < 1:
            raise ValueError(f"rows_per_request must be >= 1, got {rows_per_request}")
        prefill = max(int(inputs.max_prefill_tokens or 0), int(inputs.chunked_prefill_size or -1))
        rows = rows_per_request * req_to_token_rows
        graph_rows = (
            rows_per_request * inputs.cuda_graph_max_bs if inputs.cuda_graph_max_bs else None
        )
        return cls.from_args(
            num_slots=num_slots,
            max_running_requests=rows,
            max_tokens_per_forward=max(prefill, inputs.context_len) + rows,
            cuda_graph_max_bs=graph_rows,
            tokens_per_request_in_graph=inputs.verify_tokens_per_request,
        )
