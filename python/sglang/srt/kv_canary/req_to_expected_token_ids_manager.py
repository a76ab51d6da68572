"""Token-id verification inputs (SPEC §11): each request's own token history, scattered into
the expected-token pool that the plan gathers from.

``compute_req_all_ids_info`` runs where the batch is built (``ForwardBatch.init_new``, only
when ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1``) and snapshots
``origin_input_ids + output_ids`` of every request on the host. ``populate_req_to_expected_
token_ids`` runs in the forward's outside-graph phase: it copies the snapshot to the device and
scatters it into ``req_to_verify_expected_tokens[req_pool_index, position]``. Positions past a
request's snapshot length (the token being sampled now, an output id not yet known under
overlap scheduling, a recycled row's stale tail) are outside its valid length and unchecked.

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

import itertools
import logging
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.jit_kernel.kv_canary.scatter_req_token_ids import launch_scatter_req_token_ids_kernel

logger = logging.getLogger(__name__)

SNAPSHOT_FLAT_ATTR = "req_all_ids_flat"
SNAPSHOT_LENS_ATTR = "req_all_ids_lens"
SNAPSHOT_STARTS_ATTR = "req_all_ids_starts"
# (ExpectedTokenRows, epoch, seq, reqs) of an incremental snapshot, for the upload-order check
_SNAPSHOT_ORIGIN_ATTR = "_kv_canary_token_snapshot_origin"


def _pinned_if_cuda(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.int64, pin_memory=torch.cuda.is_available())


def _pack(lens: Sequence[int], starts: Sequence[int], pieces, total: int
          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One int64 host buffer ``[lens (bs) | starts (bs) | offsets (bs + 1) | flat (total)]``
    (pinned when CUDA exists); returns its ``(flat, lens, starts)`` views."""
    bs = len(lens)
    packed = _pinned_if_cuda(3 * bs + 1 + total)
    host = packed.numpy()
    host[:bs] = lens
    host[bs:2 * bs] = starts
    host[2 * bs] = 0
    np.cumsum(host[:bs] - host[bs:2 * bs], out=host[2 * bs + 1:3 * bs + 1])
    host[3 * bs + 1:] = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64,
                                    count=total)
    return packed[3 * bs + 1:], packed[:bs], packed[bs:2 * bs]


def _packed_source(flat: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor
                   ) -> Optional[torch.Tensor]:
    """The packed buffer ``flat``/``lens``/``starts`` are views of, or None if they are not
    (tensors attached by other code)."""
    bs = lens.shape[0]
    storage = lens.untyped_storage()
    if (starts.untyped_storage().data_ptr() != storage.data_ptr()
            or flat.untyped_storage().data_ptr() != storage.data_ptr()
            or lens.storage_offset() != 0 or starts.storage_offset() != bs
            or flat.storage_offset() != 3 * bs + 1
            or storage.nbytes() != (3 * bs + 1 + flat.shape[0]) * 8):
        return None
    return torch.empty(0, dtype=torch.int64).set_(storage)


def _snapshot_whole(reqs: Sequence) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lens = [len(r.origin_input_ids) + len(r.output_ids) for r in reqs]
    pieces = [p for r in reqs for p in (r.origin_input_ids, r.output_ids)]
    return _pack(lens, [0] * len(lens), pieces, sum(lens))


def compute_req_all_ids_info(reqs: Sequence) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(flat, lens)``: int64 CPU tensors, ``flat`` = the concatenated ``origin_input_ids +
    output_ids`` of ``reqs`` in order, ``lens[i]`` = request i's length. Pinned when CUDA
    exists (so the later device copy is asynchronous)."""
    flat, lens, _ = _snapshot_whole(reqs)
    return flat, lens


class ExpectedTokenRows:
    """Host record of the expected-token pool (one per pool; the runtime's ``CanaryManager``
    owns it): for every row, the request whose history it holds (by identity, held alive
    until the row is given to another request) and how many tokens of it.

    Used on sglang's scheduler thread only: :meth:`snapshot` from the ``ForwardBatch.init_new``
    hook, :meth:`check_upload` from :func:`populate_req_to_expected_token_ids`. Not
    thread-safe (sglang builds and runs forwards on one thread)."""

    def __init__(self, num_rows: int):
        if num_rows < 1:
            raise ValueError(f"ExpectedTokenRows needs num_rows >= 1, got {num_rows}")
        self.num_rows = num_rows
        self._owner: List[object] = [None] * num_rows
        self._held: List[int] = [0] * num_rows
        self._epoch = 0
        self._next_seq = 0
        self._uploaded_seq = -1
        self.full_resnapshots = 0  # times an out-of-order upload forced a full snapshot

    def snapshot(self, reqs: Sequence) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        """Snapshot the tokens each request's row lacks; returns ``(flat, lens, starts,
        origin)``: ``flat`` the new tokens, ``lens`` the whole lengths, ``starts`` where each
        segment begins, ``origin`` what :meth:`check_upload` needs. A request without a row in
        this pool (``req_pool_idx`` None or out of range) is snapshotted whole and not
        recorded."""
        owner, held, rows = self._owner, self._held, self.num_rows
        lens, starts, pieces = [], [], []
        for req in reqs:
            origin_ids, output_ids = req.origin_input_ids, req.output_ids
            n_in = len(origin_ids)
            n = n_in + len(output_ids)
            start = 0
            row = getattr(req, "req_pool_idx", None)
            if row is not None and 0 <= row < rows:
                if owner[row] is req and held[row] <= n:
                    start = held[row]
                owner[row] = req
                held[row] = n
            lens.append(n)
            starts.append(start)
            if start == 0:
                pieces += (origin_ids, output_ids)
            elif start < n_in:
                pieces += (origin_ids[start:], output_ids)
            else:
                pieces.append(output_ids[start - n_in:])
        flat, lens_t, starts_t = _pack(lens, starts, pieces, sum(lens) - sum(starts))
        origin = (self, self._epoch, self._next_seq, tuple(reqs))
        self._next_seq += 1
        return flat, lens_t, starts_t, origin

    def check_upload(self, origin: tuple) -> bool:
        """Called before a snapshot is uploaded. True when the rows hold what the snapshot
        assumed: it is the next one in order, or one of this epoch already uploaded (a batch
        run again, as split prefill does). False otherwise: the record is reset (a new epoch)
        and the caller must re-snapshot the batch (:meth:`snapshot` now sends it whole)."""
        tracker, epoch, seq, _ = origin
        if tracker is not self:
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
                "The batch was "
                "re-snapshotted in full and the record reset; nothing goes unchecked, but "
                "if this repeats the snapshots are no longer incremental (count: "
                "ExpectedTokenRows.full_resnapshots; warned once)", seq, last_uploaded)
        return False


def _set_snapshot(forward_batch, flat, lens, starts, origin) -> None:
    setattr(forward_batch, SNAPSHOT_FLAT_ATTR, flat)
    setattr(forward_batch, SNAPSHOT_LENS_ATTR, lens)
    setattr(forward_batch, SNAPSHOT_STARTS_ATTR, starts)
    setattr(forward_batch, _SNAPSHOT_ORIGIN_ATTR, origin)


def attach_req_all_ids_info(forward_batch, reqs: Optional[Sequence],
                            rows: Optional[ExpectedTokenRows] = None) -> None:
    """Set ``forward_batch.req_all_ids_flat`` / ``req_all_ids_lens`` (and
    ``req_all_ids_starts``) from ``reqs``: whole histories without ``rows``, the missing
    tokens only with it (the ``ForwardBatch.init_new`` hook passes the runtime's record).
    No-op when the batch carries no requests."""
    if reqs is None:
        return
    if rows is None:
        _set_snapshot(forward_batch, *_snapshot_whole(reqs), None)
    else:
        _set_snapshot(forward_batch, *rows.snapshot(reqs))


def populate_req_to_expected_token_ids(*, forward_batch,
                                       req_to_verify_expected_tokens: Optional[torch.Tensor]
                                       ) -> Optional[torch.Tensor]:
    """Scatter the batch's snapshot into ``req_to_verify_expected_tokens`` (int32
    ``[rows, max_context_len]``); returns the per-request lengths on its device (int64
    ``[bs]``) for the plan's valid lengths, or None when there is nothing to do (no pool, no
    snapshot, empty batch). Raises ``RuntimeError`` when the snapshot does not match the batch.
    Runs outside CUDA graphs; one host→device copy and one scatter launch, no host sync."""
    pool = req_to_verify_expected_tokens
    flat = getattr(forward_batch, SNAPSHOT_FLAT_ATTR, None)
    lens = getattr(forward_batch, SNAPSHOT_LENS_ATTR, None)
    if pool is None or flat is None or lens is None:
        return None
    bs = forward_batch.req_pool_indices.shape[0]
    if bs == 0:
        return None
    origin = getattr(forward_batch, _SNAPSHOT_ORIGIN_ATTR, None)
    if origin is not None and not origin[0].check_upload(origin):
        # rows lack what this snapshot assumed: the record was reset, so a new snapshot of
        # the batch's requests (origin[3]) sends them whole, and is the next in order
        rows = origin[0]
        _set_snapshot(forward_batch, *rows.snapshot(origin[3]))
        rows.check_upload(getattr(forward_batch, _SNAPSHOT_ORIGIN_ATTR))
        flat = getattr(forward_batch, SNAPSHOT_FLAT_ATTR)
        lens = getattr(forward_batch, SNAPSHOT_LENS_ATTR)
    starts = getattr(forward_batch, SNAPSHOT_STARTS_ATTR, None)
    if starts is None:
        starts = torch.zeros_like(lens)
    if lens.shape[0] != bs or starts.shape[0] != bs:
        raise RuntimeError(
            f"kv_canary: the token-id snapshot covers {lens.shape[0]} requests but the forward "
            f"batch has {bs}: the batch's requests and req_pool_indices disagree")
    total = int((lens - starts).sum())
    if total != flat.shape[0]:
        raise RuntimeError(
            f"kv_canary: the token-id snapshot holds {flat.shape[0]} ids but its lengths sum "
            f"to {total}")
    packed = _packed_source(flat, lens, starts)
    if packed is None:  # attached by other code as separate tensors: pack them once
        flat, lens, starts = _pack(lens.tolist(), starts.tolist(), (flat.tolist(),), total)
        packed = _packed_source(flat, lens, starts)
    on_device = packed.to(pool.device, non_blocking=True)
    lens_d, starts_d = on_device[:bs], on_device[bs:2 * bs]
    offsets_d, flat_d = on_device[2 * bs:3 * bs + 1], on_device[3 * bs + 1:]
    launch_scatter_req_token_ids_kernel(
        flat_in=flat_d, offsets=offsets_d,
        req_pool_indices=forward_batch.req_pool_indices.to(torch.int64), pool_out=pool,
        dst_starts=starts_d)
    return lens_d
