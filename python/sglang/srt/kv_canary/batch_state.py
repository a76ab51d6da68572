"""``CanaryBatchState``: the canary's host-side data for one ``ForwardBatch``, and the plain
data types it carries.

One object per batch, attached through the sglang seam (the batch's only canary attribute),
created by the ``ForwardBatch.init_new`` hook and read by the single-forward manager that
runs the batch. Each field has one owner, which fills it: the batch's requests with their
``req_to_token`` rows (:class:`ForwardRequests`, the runner's: it names them in violation
reports), the token oracle's rows (:class:`OracleRows`, the token oracle manager's) and the
token-history snapshot (an opaque handle of
:class:`~sglang.srt.kv_canary.token_history.TokenHistoryUploader`, which alone reads it).
Host only; this leaf imports nothing of the layers above it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np

from sglang.srt.kv_canary import sglang_seam


@dataclasses.dataclass(frozen=True, eq=False)
class ForwardRequests:
    """The requests of one forward batch and their ``req_to_token`` rows, as the
    ``ForwardBatch.init_new`` hook saw them (``rows[i]`` is ``reqs[i]``'s row then)."""

    reqs: Tuple[object, ...]
    rows: Tuple[Optional[int], ...]

    @classmethod
    def of(cls, reqs: Optional[Sequence]) -> "ForwardRequests":
        reqs = tuple(reqs or ())
        return cls(reqs, tuple(sglang_seam.req_pool_row(r) for r in reqs))


NO_FORWARD_REQUESTS = ForwardRequests((), ())


@dataclasses.dataclass(frozen=True, eq=False)
class OracleRows:
    """Host view of a batch for the token oracle: ``keys`` int64 ``[bs]`` and each request's
    prompt (``origin_input_ids``), row-aligned with the batch."""

    keys: np.ndarray
    prompts: Tuple[Sequence[int], ...]


class CanaryBatchState:
    """``token_reqs``: the requests whose histories the token check uploads (token checks on;
    the snapshot is taken at upload time), ``token_snapshot``: that snapshot, ``oracle_rows``:
    the oracle's keys and prompts (token oracle on); None when that feature is off.
    ``requests``: the batch's requests and rows (always, with the canary on)."""

    __slots__ = ("token_reqs", "token_snapshot", "oracle_rows", "requests")

    def __init__(self):
        # token checks: the requests the upload snapshots, then the snapshot it took
        self.token_reqs: Optional[tuple] = None
        # the token-history uploader's own snapshot type, opaque here
        self.token_snapshot: Optional[object] = None
        self.oracle_rows: Optional[OracleRows] = None
        self.requests: Optional[ForwardRequests] = None


def batch_state(forward_batch) -> Optional[CanaryBatchState]:
    """The batch's state, or None when no canary hook has attached one."""
    state = sglang_seam.batch_state(forward_batch)
    if state is not None and not isinstance(state, CanaryBatchState):
        raise RuntimeError(
            f"kv_canary: the batch's canary state is a {type(state).__name__}, "
            "not a CanaryBatchState"
        )
    return state


def batch_state_for(forward_batch) -> CanaryBatchState:
    """The batch's state, created (and attached) on first use."""
    state = batch_state(forward_batch)
    if state is None:
        state = CanaryBatchState()
        sglang_seam.set_batch_state(forward_batch, state)
    return state
