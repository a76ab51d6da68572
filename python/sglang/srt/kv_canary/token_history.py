"""Token-id verification inputs (docs/architecture.md, "Token checks"): each request's own
token history, scattered into the expected-token pool that the plan gathers from.

One owner, :class:`TokenHistoryUploader` (built by the canary builder, handed to every
single-forward manager), and one direction: where the batch is built (the
``ForwardBatch.init_new`` hook, only when ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1``)
:meth:`TokenHistoryUploader.defer_snapshot` records the batch's requests in its
:class:`~sglang.srt.kv_canary.batch_state.CanaryBatchState`; :meth:`TokenHistoryUploader.upload`
(right before a CUDA-graph replay, or in an eager forward after the model's kernels are
queued) snapshots ``origin_input_ids + output_ids`` of every request on the host into a
:class:`TokenIdSnapshot` (kept on the batch state, so a batch run again uploads the same one),
copies it to the device and scatters it into ``req_to_verify_expected_tokens[req_pool_index,
position]``. Positions past a request's snapshot length (the token being sampled now, an
output id not yet known under overlap scheduling, a recycled row's stale tail) are outside
its valid length and unchecked.

Incremental snapshots (what the runtime uses). A request's history only grows, and its pool
row keeps what earlier forwards scattered, so re-sending the whole history every step is pure
host work (a decode step at bs 1 with a 1.5k-token history spent most of its canary cost
there). :class:`ExpectedTokenRows` remembers, per pool row, which request's history the row
holds and how many of its tokens; :meth:`ExpectedTokenRows.snapshot` then snapshots only the
tokens a row lacks, with ``req_all_ids_starts`` (int64 ``[bs]``) giving the first position of
each request's segment. ``req_all_ids_lens`` is always the request's whole length (it bounds
the positions the plan checks). Everything lives in one pinned host buffer, so the upload is
one copy.

Uploads must happen in snapshot order for the "row already holds it" claims to be true. A
snapshot that is uploaded out of order (one built but never run, so rows lack what later
snapshots assume) is detected by its sequence number: the record is reset and that batch is
re-snapshotted in full from its requests before the upload, so no check ever reads a
position that was not written.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from typing import List, Optional, Sequence

import numpy as np
import torch

from sglang.jit_kernel.kv_canary.scatter_req_token_ids import launch_scatter_req_token_ids_kernel
from sglang.srt.kv_canary.batch_state import CanaryBatchState

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _pin() -> bool:
    return torch.cuda.is_available()


@dataclasses.dataclass(frozen=True, eq=False)
class TokenIdSnapshot:
    """One batch's token-id snapshot (the opaque handle its ``CanaryBatchState`` carries):
    ``packed`` is a single int64 host buffer ``[lens (bs) | starts (bs) | offsets (bs + 1) |
    flat (total)]`` (pinned when CUDA exists), ``flat`` (the tokens sent), ``lens`` (each
    request's whole history length) and ``starts`` (first position of each request's segment)
    its views. ``rows`` is the record it was taken against and ``epoch`` / ``seq`` / ``reqs``
    let the upload check the order (and re-snapshot when needed)."""

    packed: torch.Tensor
    flat: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor
    rows: Optional["ExpectedTokenRows"] = None
    epoch: int = 0
    seq: int = 0
    reqs: tuple = ()

    @classmethod
    def pack(cls, lens: Sequence[int], starts: Sequence[int], pieces, total: int,
             **origin) -> "TokenIdSnapshot":
        """``pieces``: iterables of token ids whose concatenation holds ``total`` ids."""
        bs = len(lens)
        packed = torch.empty(3 * bs + 1 + total, dtype=torch.int64, pin_memory=_pin())
        host = packed.numpy()
        host[:bs] = lens
        host[bs:2 * bs] = starts
        host[2 * bs] = 0
        np.cumsum(host[:bs] - host[bs:2 * bs], out=host[2 * bs + 1:3 * bs + 1])
        host[3 * bs + 1:] = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64,
                                        count=total)
        return cls(packed=packed, flat=packed[3 * bs + 1:], lens=packed[:bs],
                   starts=packed[bs:2 * bs], **origin)


class ExpectedTokenRows:
    """Host record of the expected-token pool (one per pool; the runtime's ``CanaryManager``
    owns it): for every row, the request whose history it holds and how many tokens of it.
    The request and its ``origin_input_ids`` / ``output_ids`` lists are kept by identity (alive
    until the row is given to another request): sglang only appends to these lists, and where
    it rewrites a history (a retracted ``input_embeds`` request restarting its output, an abort
    shortening the input) it assigns new lists, so the row is sent whole again. A history
    shorter than what the row holds is sent whole as well.

    Used on sglang's scheduler thread only, by :class:`TokenHistoryUploader` (:meth:`snapshot`
    from the ``ForwardBatch.init_new`` hook, :meth:`check_upload` before an upload). Not
    thread-safe (sglang builds and runs forwards on one thread)."""

    def __init__(self, num_rows: int):
        if num_rows < 1:
            raise ValueError(f"ExpectedTokenRows needs num_rows >= 1, got {num_rows}")
        self.num_rows = num_rows
        self._owner: List[Optional[tuple]] = [None] * num_rows
        self._held: List[int] = [0] * num_rows
        self._epoch = 0
        self._next_seq = 0
        self._uploaded_seq = -1
        self.full_resnapshots = 0  # times an out-of-order upload forced a full snapshot

    def snapshot(self, reqs: Sequence) -> TokenIdSnapshot:
        """Snapshot the tokens each request's row lacks: ``flat`` the new tokens, ``lens`` the
        whole lengths, ``starts`` where each segment begins. A request without a row in this
        pool (``req_pool_idx`` None or out of range) is snapshotted whole and not recorded."""
        owner, held, rows = self._owner, self._held, self.num_rows
        lens, starts, pieces = [], [], []
        for req in reqs:
            origin_ids, output_ids = req.origin_input_ids, req.output_ids
            n_in = len(origin_ids)
            n = n_in + len(output_ids)
            start = 0
            row = getattr(req, "req_pool_idx", None)
            if row is not None and 0 <= row < rows:
                o = owner[row]
                if (o is not None and o[0] is req and o[1] is origin_ids and o[2] is output_ids
                        and held[row] <= n):
                    start = held[row]
                owner[row] = (req, origin_ids, output_ids)
                held[row] = n
            lens.append(n)
            starts.append(start)
            if start == 0:
                pieces += (origin_ids, output_ids)
            elif start < n_in:
                pieces += (origin_ids[start:], output_ids)
            else:
                pieces.append(output_ids[start - n_in:])
        snap = TokenIdSnapshot.pack(lens, starts, pieces, sum(lens) - sum(starts), rows=self,
                                    epoch=self._epoch, seq=self._next_seq, reqs=tuple(reqs))
        self._next_seq += 1
        return snap

    def check_upload(self, snap: TokenIdSnapshot) -> bool:
        """Called before a snapshot is uploaded. True when the rows hold what the snapshot
        assumed: it is the next one in order, or one of this epoch already uploaded (a batch
        run again, as split prefill does). False otherwise: the record is reset (a new epoch)
        and the caller must re-snapshot the batch (:meth:`snapshot` now sends it whole)."""
        epoch, seq = snap.epoch, snap.seq
        if snap.rows is not self:
            raise RuntimeError("kv_canary: a token-id snapshot of another expected-token pool "
                               "reached this one")
        if epoch == self._epoch and seq <= self._uploaded_seq + 1:
            self._uploaded_seq = max(self._uploaded_seq, seq)
            return True
        last_uploaded = self._uploaded_seq
        self._owner = [None] * self.num_rows
        self._held = [0] * self.num_rows
        self._epoch += 1
        self._uploaded_seq = self._next_seq - 1  # the full re-snapshot is the next in order
        self.full_resnapshots += 1
        if self.full_resnapshots == 1:
            logger.warning(
                "kv_canary: a token-id snapshot reached the device out of order (snapshot %d, "
                "last uploaded %d): a ForwardBatch was built and not run, or run out of order. "
                "The batch was re-snapshotted in full and the record reset; nothing goes "
                "unchecked, but if this repeats the snapshots are no longer incremental "
                "(count: ExpectedTokenRows.full_resnapshots; warned once)", seq, last_uploaded)
        return False


class TokenHistoryUploader:
    """The one owner of the expected-token pool's contents (built by the canary builder when
    ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1``, handed to every single-forward
    manager). ``pool``: int32 ``[req_to_token rows, max_context_len]`` on the canary's device
    (``CanaryDeviceState.req_to_verify_expected_tokens``)."""

    def __init__(self, pool: torch.Tensor):
        if not isinstance(pool, torch.Tensor) or pool.dtype != torch.int32 or pool.dim() != 2:
            raise TypeError("TokenHistoryUploader needs an int32 [rows, max_context_len] pool")
        self.pool = pool
        self.rows = ExpectedTokenRows(pool.shape[0])

    def defer_snapshot(self, state: CanaryBatchState, reqs: Optional[Sequence]) -> None:
        """The ``ForwardBatch.init_new`` hook: remember the batch's requests; :meth:`upload`
        snapshots them (the forward's queue does not wait for a long prompt's snapshot). The
        histories it then reads are those of the batch's build: sglang appends a forward's
        tokens only after the forward (the upload runs inside it, or right before its graph
        replays). No-op for a batch without requests. Host only."""
        if reqs is not None:
            state.token_reqs = tuple(reqs)

    def snapshot(self, state: CanaryBatchState, reqs: Optional[Sequence]) -> None:
        """Snapshot now the tokens of ``reqs`` that their pool rows lack into ``state`` (no-op
        for a batch without requests). Host only."""
        if reqs is not None:
            state.token_snapshot = self.rows.snapshot(reqs)

    def upload(self, state: Optional[CanaryBatchState], req_pool_indices: torch.Tensor
               ) -> Optional[torch.Tensor]:
        """Scatter the batch's snapshot into the pool; returns the per-request whole lengths
        on the pool's device (int64 ``[bs]``, the plan's valid lengths), or None when there
        is nothing to upload (no snapshot, empty batch). A snapshot that reaches the device
        out of order is replaced (in ``state``) by a whole one first. Raises ``RuntimeError``
        when the snapshot does not match the batch. Outside CUDA graphs; one host→device copy
        and one scatter launch, no host sync."""
        if state is not None and state.token_snapshot is None and state.token_reqs is not None:
            self.snapshot(state, state.token_reqs)  # deferred by the init_new hook
        snap = state.token_snapshot if state is not None else None
        bs = req_pool_indices.shape[0]
        if snap is None or bs == 0:
            return None
        if snap.lens.shape[0] != bs:
            raise RuntimeError(
                f"kv_canary: the token-id snapshot covers {snap.lens.shape[0]} requests but "
                f"the forward batch has {bs}: the batch's requests and req_pool_indices "
                "disagree")
        if not self.rows.check_upload(snap):
            # the record was reset: a new snapshot of the batch's requests sends them whole
            # and is the next in order
            snap = self.rows.snapshot(snap.reqs)
            state.token_snapshot = snap
            self.rows.check_upload(snap)
        on_device = snap.packed.to(self.pool.device, non_blocking=True)
        lens_d, starts_d = on_device[:bs], on_device[bs:2 * bs]
        offsets_d, flat_d = on_device[2 * bs:3 * bs + 1], on_device[3 * bs + 1:]
        launch_scatter_req_token_ids_kernel(
            flat_in=flat_d, offsets=offsets_d, req_pool_indices=req_pool_indices.to(torch.int64),
            pool_out=self.pool, dst_starts=starts_d)
        return lens_d
