"""``CanaryBatchState``: the canary's host-side data for one ``ForwardBatch``.

One object per batch, attached through the sglang seam (the batch's only canary attribute),
created by the ``ForwardBatch.init_new`` hook and read by the single-forward manager that
runs the batch. Its fields are handles the canary's owners hand themselves: the token-history
snapshot (owned by :class:`~sglang.srt.kv_canary.token_history.TokenHistoryUploader`) and the
token oracle's rows (owned by
:class:`~sglang.srt.kv_canary.token_oracle.manager.TokenOracleManager`) and the batch's
requests with their ``req_to_token`` rows (owned by the runner, which names them in
violation reports). Host only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from sglang.srt.kv_canary import sglang_seam

if TYPE_CHECKING:
    from sglang.srt.kv_canary.sglang_seam import ForwardBatch  # noqa: F401
    from sglang.srt.kv_canary.token_history import TokenIdSnapshot
    from sglang.srt.kv_canary.runner.requests import ForwardRequests
    from sglang.srt.kv_canary.token_oracle.manager import OracleRows


class CanaryBatchState:
    """``token_reqs``: the requests whose histories the token check uploads (token checks on;
    the snapshot is taken at upload time), ``token_snapshot``: that snapshot, ``oracle_rows``:
    the oracle's keys and prompts (token oracle on); None when that feature is off.
    ``requests``: the batch's requests and rows (always, with the canary on)."""

    __slots__ = ("token_reqs", "token_snapshot", "oracle_rows", "requests")

    def __init__(self):
        # token checks: the requests the upload snapshots, then the snapshot it took
        self.token_reqs: Optional[tuple] = None
        self.token_snapshot: Optional["TokenIdSnapshot"] = None
        self.oracle_rows: Optional["OracleRows"] = None
        self.requests: Optional["ForwardRequests"] = None


def batch_state(forward_batch) -> Optional[CanaryBatchState]:
    """The batch's state, or None when no canary hook has attached one."""
    state = sglang_seam.batch_state(forward_batch)
    if state is not None and not isinstance(state, CanaryBatchState):
        raise RuntimeError(f"kv_canary: the batch's canary state is a {type(state).__name__}, "
                           "not a CanaryBatchState")
    return state


def batch_state_for(forward_batch) -> CanaryBatchState:
    """The batch's state, created (and attached) on first use."""
    state = batch_state(forward_batch)
    if state is None:
        state = CanaryBatchState()
        sglang_seam.set_batch_state(forward_batch, state)
    return state
