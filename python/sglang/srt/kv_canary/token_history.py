"""Token-id verification inputs: each request's own token history, scattered into the
expected-token pool that the plan gathers from (docs/subsystems.md, "Token checks"; the
packed layout: docs/architecture.md, "Token-id scatter").

One owner, :class:`TokenHistoryUploader` (built by the canary builder, handed to every
single-forward manager): :meth:`~TokenHistoryUploader.defer_snapshot` records a batch's
requests where the batch is built; :meth:`~TokenHistoryUploader.upload` (eager forwards) and
:meth:`~TokenHistoryUploader.stage_for_replay` (graph replays: one host copy into the static
:attr:`~TokenHistoryUploader.replay_buffer`, no launch) send a :class:`TokenIdSnapshot` of only
the tokens each pool row lacks (:class:`ExpectedTokenRows`). Positions past a request's
snapshot length are unchecked. Uploads must come in snapshot order; one that does not is
detected by its sequence number and that batch is re-sent whole. Host side plus one copy and
at most one launch per upload; graph-safe where it says so.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import logging
from typing import List, Optional, Sequence

import numpy as np
import torch

from sglang.jit_kernel.kv_canary.scatter_req_token_ids import (
    launch_scatter_packed_token_ids_kernel,
)
from sglang.jit_kernel.kv_canary.consts import (
    PACKED_TOKENS_HEADER,
    PACKED_TOKENS_NUM_REQS,
    PACKED_TOKENS_ROW_FIELDS,
    PACKED_TOKENS_ROW_LEN,
    PACKED_TOKENS_ROW_OFFSET,
    PACKED_TOKENS_ROW_START,
    packed_tokens_numel,
)
from sglang.srt.kv_canary.batch_state import CanaryBatchState
from sglang.srt.kv_canary.capacities import SNAPSHOT_HOST_BUFFERS
from sglang.srt.kv_canary.snapshot_buffers import SnapshotHostBuffers

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _pin() -> bool:
    return torch.cuda.is_available()


@dataclasses.dataclass(frozen=True, eq=False)
class TokenIdSnapshot:
    """One batch's token-id snapshot (the opaque handle its ``CanaryBatchState`` carries):
    ``packed`` is the packed upload, a single int64 host buffer (pinned when CUDA exists; the
    layout of ``consts.PACKED_TOKENS_*``) of ``num_reqs`` requests. Its views :attr:`flat` (the
    tokens sent), :attr:`lens` (each request's whole history length) and :attr:`starts`
    (first position of each request's segment) are made on access (the upload needs none).
    ``rows`` is the record it was taken against and ``epoch`` / ``seq`` / ``reqs`` let the
    upload check the order (and re-snapshot when needed). ``buffer_slot``: the
    :class:`SnapshotHostBuffers` slot ``packed`` lies in (-1: a buffer of its own)."""

    packed: torch.Tensor
    num_reqs: int
    rows: Optional["ExpectedTokenRows"] = None
    epoch: int = 0
    seq: int = 0
    reqs: tuple = ()
    buffer_slot: int = -1

    @classmethod
    def pack(
        cls,
        lens: Sequence[int],
        starts: Sequence[int],
        pieces,
        total: int,
        *,
        buffers: Optional["SnapshotHostBuffers"] = None,
        **origin,
    ) -> "TokenIdSnapshot":
        """``pieces``: sequences of token ids whose concatenation holds ``total`` ids; the
        segments (``lens[i] - starts[i]`` ids each) must add up to ``total`` (``ValueError``
        otherwise). Packed into a buffer of ``buffers`` (None: a new one). Host only. The
        header is built as one list: a decode step's snapshot carries a few ids, so the fixed
        cost per call is what counts."""
        bs = len(lens)
        header = [0] * (PACKED_TOKENS_HEADER + PACKED_TOKENS_ROW_FIELDS * bs)
        header[PACKED_TOKENS_NUM_REQS] = bs
        at, offset = PACKED_TOKENS_HEADER, 0
        for n, start in zip(lens, starts):
            header[at + PACKED_TOKENS_ROW_LEN] = n
            header[at + PACKED_TOKENS_ROW_START] = start
            header[at + PACKED_TOKENS_ROW_OFFSET] = offset
            offset += n - start
            at += PACKED_TOKENS_ROW_FIELDS
        if offset != total:
            raise ValueError(
                f"TokenIdSnapshot.pack: the segments hold {offset} ids, total says {total}"
            )
        held = sum(map(len, pieces))
        if held != total:
            raise ValueError(
                f"TokenIdSnapshot.pack: the pieces hold {held} ids, the segments {total}"
            )
        numel = packed_tokens_numel(bs, total)
        if buffers is not None:
            host, slot = buffers.take(numel)
            packed = torch.from_numpy(host)
        else:
            packed, slot = torch.empty(numel, dtype=torch.int64, pin_memory=_pin()), -1
            host = packed.numpy()
        host[:at] = header
        for piece in pieces:
            n = len(piece)
            if n:  # array.array: the cheapest Python ints -> int64 conversion measured
                host[at : at + n] = np.frombuffer(array.array("q", piece), dtype=np.int64)
                at += n
        snap = cls(packed=packed, num_reqs=bs, buffer_slot=slot, **origin)
        if buffers is not None:
            buffers.bind(snap)
        return snap

    def _row_field(self, field: int) -> torch.Tensor:
        at = PACKED_TOKENS_HEADER
        rows = self.packed[at : at + PACKED_TOKENS_ROW_FIELDS * self.num_reqs]
        return rows.view(self.num_reqs, PACKED_TOKENS_ROW_FIELDS)[:, field]

    @property
    def lens(self) -> torch.Tensor:
        return self._row_field(PACKED_TOKENS_ROW_LEN)

    @property
    def starts(self) -> torch.Tensor:
        return self._row_field(PACKED_TOKENS_ROW_START)

    @property
    def flat(self) -> torch.Tensor:
        return self.packed[PACKED_TOKENS_HEADER + PACKED_TOKENS_ROW_FIELDS * self.num_reqs :]

    def lengths_only(self) -> torch.Tensor:
        """A packed header of the same requests with nothing to scatter (each segment starts
        at the request's length): what a graph's scatter gets when the tokens went ahead by
        their own launch. New host buffer (pinned when CUDA exists)."""
        bs = self.num_reqs
        head = torch.empty(packed_tokens_numel(bs, 0), dtype=torch.int64, pin_memory=_pin())
        head.copy_(self.packed[: head.shape[0]])
        rows = head[PACKED_TOKENS_HEADER:].view(bs, PACKED_TOKENS_ROW_FIELDS)
        rows[:, PACKED_TOKENS_ROW_START] = rows[:, PACKED_TOKENS_ROW_LEN]
        rows[:, PACKED_TOKENS_ROW_OFFSET] = 0
        return head


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

    def __init__(self, num_rows: int, *, buffers: Optional[SnapshotHostBuffers] = None):
        if num_rows < 1:
            raise ValueError(f"ExpectedTokenRows needs num_rows >= 1, got {num_rows}")
        self.num_rows = num_rows
        self.buffers = buffers  # where snapshots are packed (None: a new buffer each)
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
                if (
                    o is not None
                    and o[0] is req
                    and o[1] is origin_ids
                    and o[2] is output_ids
                    and held[row] <= n
                ):
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
                pieces.append(output_ids[start - n_in :])
        snap = TokenIdSnapshot.pack(
            lens,
            starts,
            pieces,
            sum(lens) - sum(starts),
            buffers=self.buffers,
            rows=self,
            epoch=self._epoch,
            seq=self._next_seq,
            reqs=tuple(reqs),
        )
        self._next_seq += 1
        return snap

    def check_upload(self, snap: TokenIdSnapshot) -> bool:
        """Called before a snapshot is uploaded. True when the rows hold what the snapshot
        assumed: it is the next one in order, or one of this epoch already uploaded (a batch
        run again, as split prefill does). False otherwise: the record is reset (a new epoch)
        and the caller must re-snapshot the batch (:meth:`snapshot` now sends it whole)."""
        epoch, seq = snap.epoch, snap.seq
        if snap.rows is not self:
            raise RuntimeError(
                "kv_canary: a token-id snapshot of another expected-token pool reached this one"
            )
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
                "(count: ExpectedTokenRows.full_resnapshots; warned once)",
                seq,
                last_uploaded,
            )
        return False


class TokenHistoryUploader:
    """The one owner of the expected-token pool's contents (built by the canary builder when
    ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1``, handed to every single-forward
    manager). ``pool``: int32 ``[req_to_token rows, max_context_len]`` on the canary's device
    (``CanaryDeviceState.req_to_verify_expected_tokens``). ``replay_rows`` / ``replay_tokens``
    size :attr:`replay_buffer`, the static packed buffer the graph-captured scatters read:
    requests of one forward (the canary's request capacity) and tokens one replayed forward's
    snapshot may carry there (more go by their own launch)."""

    def __init__(self, pool: torch.Tensor, *, replay_rows: int, replay_tokens: int):
        if not isinstance(pool, torch.Tensor) or pool.dtype != torch.int32 or pool.dim() != 2:
            raise TypeError("TokenHistoryUploader needs an int32 [rows, max_context_len] pool")
        if replay_rows < 1 or replay_tokens < 0:
            raise ValueError(
                f"TokenHistoryUploader needs replay_rows >= 1 and replay_tokens "
                f">= 0, got {replay_rows} and {replay_tokens}"
            )
        self.pool = pool
        self.replay_buffer = torch.zeros(
            packed_tokens_numel(replay_rows, replay_tokens), dtype=torch.int64, device=pool.device
        )
        self.rows = ExpectedTokenRows(
            pool.shape[0],
            buffers=SnapshotHostBuffers(
                slots=SNAPSHOT_HOST_BUFFERS, numel=self.replay_buffer.shape[0], device=pool.device
            ),
        )
        self._no_requests = torch.zeros(1, dtype=torch.int64, pin_memory=_pin())
        self._replay_holds: Optional[TokenIdSnapshot] = None  # what replay_buffer holds

    def defer_snapshot(self, state: CanaryBatchState, reqs: Optional[Sequence]) -> None:
        """The ``ForwardBatch.init_new`` hook: remember the batch's requests; the upload
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

    def _ready_snapshot(
        self, state: Optional[CanaryBatchState], bs: int
    ) -> Optional[TokenIdSnapshot]:
        """The batch's snapshot, taken now if deferred, checked against the batch size and
        replaced (in ``state``) by a whole one if it reaches the device out of order; None
        when there is nothing to upload (no snapshot, empty batch)."""
        if state is not None and state.token_snapshot is None and state.token_reqs is not None:
            self.snapshot(state, state.token_reqs)  # deferred by the init_new hook
        snap = state.token_snapshot if state is not None else None
        if snap is None or bs == 0:
            return None
        if snap.num_reqs != bs:
            raise RuntimeError(
                f"kv_canary: the token-id snapshot covers {snap.num_reqs} requests but "
                f"the forward batch has {bs}: the batch's requests and req_pool_indices "
                "disagree"
            )
        if not self.rows.check_upload(snap):
            # the record was reset: a new snapshot of the batch's requests sends them whole
            # and is the next in order
            snap = self.rows.snapshot(snap.reqs)
            state.token_snapshot = snap
            self.rows.check_upload(snap)
        return snap

    def upload(
        self,
        state: Optional[CanaryBatchState],
        req_pool_indices: torch.Tensor,
        valid_lens_out: torch.Tensor,
    ) -> bool:
        """An eager forward's upload: scatter the batch's snapshot into the pool and write the
        plan's valid lengths into ``valid_lens_out[:bs]`` (int64 ``[>= bs]``). False, with
        nothing done, when there is nothing to upload (no snapshot, empty batch). Raises
        ``RuntimeError`` when the snapshot does not match the batch. Outside CUDA graphs, on
        the current stream; one host→device copy and one launch, no host sync."""
        bs = req_pool_indices.shape[0]
        snap = self._ready_snapshot(state, bs)
        if snap is None:
            return False
        self._scatter_now(snap, req_pool_indices, valid_lens_out[:bs])
        return True

    def _scatter_now(
        self, snap: TokenIdSnapshot, req_pool_indices: torch.Tensor, valid_lens_out: torch.Tensor
    ) -> None:
        packed = snap.packed.to(self.pool.device, non_blocking=True)
        self.rows.buffers.sent(snap)
        launch_scatter_packed_token_ids_kernel(
            packed=packed,
            req_pool_indices=req_pool_indices.to(torch.int64),
            pool_out=self.pool,
            valid_lens_out=valid_lens_out,
        )

    def stage_for_replay(
        self,
        state: Optional[CanaryBatchState],
        req_pool_indices: torch.Tensor,
        valid_lens_out: torch.Tensor,
    ) -> None:
        """Before a CUDA graph whose scatter (:meth:`launch_replay_scatter`) was captured
        replays this batch: put its snapshot in :attr:`replay_buffer` (one host→device copy
        on the current stream; none when the buffer already holds it, as for the second
        forward of an EAGLE draft round). Nothing to upload: a request count of 0 (the
        graph's scatter zeroes the valid lengths). A snapshot larger than the buffer is
        scattered now by its own launch (``valid_lens_out`` int64 ``[>= bs]``) and the buffer
        gets its lengths only. No host sync."""
        snap = self._ready_snapshot(state, req_pool_indices.shape[0])
        if snap is None:
            self.replay_buffer[:1].copy_(self._no_requests, non_blocking=True)
            self._replay_holds = None
        elif snap is self._replay_holds:
            return
        elif snap.packed.shape[0] <= self.replay_buffer.shape[0]:
            self.replay_buffer[: snap.packed.shape[0]].copy_(snap.packed, non_blocking=True)
            self.rows.buffers.sent(snap)
            self._replay_holds = snap
        else:
            self._scatter_now(snap, req_pool_indices, valid_lens_out[: req_pool_indices.shape[0]])
            head = snap.lengths_only()
            self.replay_buffer[: head.shape[0]].copy_(head, non_blocking=True)
            self._replay_holds = None

    def launch_replay_scatter(
        self, req_pool_indices: torch.Tensor, valid_lens_out: torch.Tensor
    ) -> None:
        """The scatter a CUDA graph captures (inside ops, during sglang's capture): from
        :attr:`replay_buffer` into the pool, lengths into ``valid_lens_out`` (int64 ``[bs]``,
        0 for the graph's padding rows). ``req_pool_indices``: int64 ``[bs]``, the graph's
        static (padded) rows. Allocation- and sync-free."""
        launch_scatter_packed_token_ids_kernel(
            packed=self.replay_buffer,
            req_pool_indices=req_pool_indices,
            pool_out=self.pool,
            valid_lens_out=valid_lens_out,
        )
