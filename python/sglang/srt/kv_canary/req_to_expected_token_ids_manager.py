"""Token-id verification inputs (SPEC §11): each request's own token history, scattered into
the expected-token pool that the plan gathers from.

``compute_req_all_ids_info`` runs where the batch is built (``ForwardBatch.init_new``, only
when ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1``) and snapshots
``origin_input_ids + output_ids`` of every request on the host. ``populate_req_to_expected_
token_ids`` runs in the forward's outside-graph phase: it copies the snapshot to the device and
scatters it into ``req_to_verify_expected_tokens[req_pool_index, position]``. Positions past a
request's snapshot length (the token being sampled now, an output id not yet known under
overlap scheduling, a recycled row's stale tail) are outside its valid length and unchecked.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.jit_kernel.kv_canary.scatter_req_token_ids import launch_scatter_req_token_ids_kernel

SNAPSHOT_FLAT_ATTR = "req_all_ids_flat"
SNAPSHOT_LENS_ATTR = "req_all_ids_lens"


def compute_req_all_ids_info(reqs: Sequence) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(flat, lens)``: int64 CPU tensors, ``flat`` = the concatenated ``origin_input_ids +
    output_ids`` of ``reqs`` in order, ``lens[i]`` = request i's length. Pinned when CUDA
    exists (so the later device copy is asynchronous)."""
    lens = np.fromiter((len(r.origin_input_ids) + len(r.output_ids) for r in reqs),
                       dtype=np.int64, count=len(reqs))
    total = int(lens.sum())
    flat = np.fromiter(
        itertools.chain.from_iterable(
            itertools.chain(r.origin_input_ids, r.output_ids) for r in reqs),
        dtype=np.int64, count=total)
    flat_t, lens_t = torch.from_numpy(flat), torch.from_numpy(lens)
    if torch.cuda.is_available():
        flat_t, lens_t = flat_t.pin_memory(), lens_t.pin_memory()
    return flat_t, lens_t


def attach_req_all_ids_info(forward_batch, reqs: Optional[Sequence]) -> None:
    """Set ``forward_batch.req_all_ids_flat`` / ``req_all_ids_lens`` from ``reqs`` (no-op when
    the batch carries no requests)."""
    if reqs is None:
        return
    flat, lens = compute_req_all_ids_info(reqs)
    setattr(forward_batch, SNAPSHOT_FLAT_ATTR, flat)
    setattr(forward_batch, SNAPSHOT_LENS_ATTR, lens)


def populate_req_to_expected_token_ids(*, forward_batch,
                                       req_to_verify_expected_tokens: Optional[torch.Tensor]
                                       ) -> Optional[torch.Tensor]:
    """Scatter the batch's snapshot into ``req_to_verify_expected_tokens`` (int32
    ``[rows, max_context_len]``); returns the per-request lengths on its device (int64
    ``[bs]``) for the plan's valid lengths, or None when there is nothing to do (no pool, no
    snapshot, empty batch). Raises ``RuntimeError`` when the snapshot does not match the batch.
    Runs outside CUDA graphs."""
    pool = req_to_verify_expected_tokens
    flat = getattr(forward_batch, SNAPSHOT_FLAT_ATTR, None)
    lens = getattr(forward_batch, SNAPSHOT_LENS_ATTR, None)
    if pool is None or flat is None or lens is None:
        return None
    bs = forward_batch.req_pool_indices.shape[0]
    if bs == 0:
        return None
    if lens.shape[0] != bs:
        raise RuntimeError(
            f"kv_canary: the token-id snapshot covers {lens.shape[0]} requests but the forward "
            f"batch has {bs}: the batch's requests and req_pool_indices disagree")
    total = int(lens.sum())
    if total != flat.shape[0]:
        raise RuntimeError(
            f"kv_canary: the token-id snapshot holds {flat.shape[0]} ids but its lengths sum "
            f"to {total}")
    offsets = torch.zeros(bs + 1, dtype=torch.int64, pin_memory=flat.is_pinned())
    torch.cumsum(lens, 0, out=offsets[1:])
    device = pool.device
    flat_d = flat.to(device, non_blocking=True)
    offsets_d = offsets.to(device, non_blocking=True)
    lens_d = lens.to(device, non_blocking=True)
    launch_scatter_req_token_ids_kernel(
        flat_in=flat_d, offsets=offsets_d,
        req_pool_indices=forward_batch.req_pool_indices.to(torch.int64), pool_out=pool)
    return lens_d
