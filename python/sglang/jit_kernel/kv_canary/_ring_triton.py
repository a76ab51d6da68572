"""Violation-ring append for the Triton kernels (the device twin of ``_ring_torch``).

Ring rows are int64 ``[VIOLATION_NUM_FIELDS]`` (docs/architecture.md, "Record format").
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary._kernel_consts import (
    VIOL_EXPECTED_AUX,
    VIOL_EXPECTED_TOKEN,
    VIOL_FAIL_REASON_BITS,
    VIOL_KERNEL_KIND,
    VIOL_KV_LAYER,
    VIOL_POSITION,
    VIOL_READ_POSITION,
    VIOL_REQ_TO_TOKEN_ROW,
    VIOL_SLOT_IDX,
    VIOL_STORED_CHAIN_HASH,
    VIOL_STORED_TOKEN,
    VIOLATION_WORDS,
)


@triton.jit
def append_violations(
    ring_ptr,
    ring_index_ptr,
    ring_capacity,
    viol,
    kernel_kind,
    slot,
    position,
    stored_token,
    expected_token,
    chain_hash,
    aux,
    bits,
    read_position,
    req_to_token_row,
    kv_layer,
):
    """Append one ring row per lane where ``viol``; rows past the capacity are counted, not kept.
    ``read_position`` / ``req_to_token_row``: where the slot was read (int64 lanes);
    ``kv_layer``: the failed per-layer fingerprint's layer (``NO_KV_LAYER`` for other checks;
    a scalar or int64 lanes)."""
    zero = tl.zeros(viol.shape, dtype=tl.int32)
    idx = tl.atomic_add(ring_index_ptr + zero, 1, mask=viol).to(tl.int64)
    keep = viol & (idx < ring_capacity)
    row = ring_ptr + idx * VIOLATION_WORDS
    tl.store(row + VIOL_KERNEL_KIND, zero.to(tl.int64) + kernel_kind, mask=keep)
    tl.store(row + VIOL_SLOT_IDX, slot, mask=keep)
    tl.store(row + VIOL_POSITION, position, mask=keep)
    tl.store(row + VIOL_STORED_TOKEN, stored_token, mask=keep)
    tl.store(row + VIOL_EXPECTED_TOKEN, expected_token, mask=keep)
    tl.store(row + VIOL_STORED_CHAIN_HASH, chain_hash, mask=keep)
    tl.store(row + VIOL_EXPECTED_AUX, aux, mask=keep)
    tl.store(row + VIOL_FAIL_REASON_BITS, bits, mask=keep)
    tl.store(row + VIOL_READ_POSITION, read_position, mask=keep)
    tl.store(row + VIOL_REQ_TO_TOKEN_ROW, req_to_token_row, mask=keep)
    tl.store(row + VIOL_KV_LAYER, zero.to(tl.int64) + kv_layer, mask=keep)
