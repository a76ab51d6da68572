"""``tl.constexpr`` twins of ``consts`` for use inside ``@triton.jit`` functions.

Triton kernels may only read module globals that are ``tl.constexpr`` instances, so the kernels
import these instead of the plain ints of :mod:`~sglang.jit_kernel.kv_canary.consts`; every value
is built from ``consts`` (docs/architecture.md, "Record format"), never restated. Import the
names directly (``from ..._kernel_consts import FIELD_TOKEN``): a global name, not a module
attribute, is what Triton tracks in its kernel cache key.
"""

from __future__ import annotations

import triton.language as tl

from sglang.jit_kernel.kv_canary import consts as _consts
from sglang.jit_kernel.kv_canary.consts import (
    CANARY_CHAIN_ANCHOR,
    CANARY_CHAIN_MUL,
    CANARY_CHAIN_MUL_INV,
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    CANARY_NUM_FIELDS,
    NO_EXPECTED_TOKEN as _NO_EXPECTED_TOKEN,
    NO_KV_LAYER as _NO_KV_LAYER,
    NO_PREV_SLOT as _NO_PREV_SLOT,
    NO_REQ_TO_TOKEN_ROW as _NO_REQ_TO_TOKEN_ROW,
    NO_SEED_SLOT as _NO_SEED_SLOT,
    TREE_PARENT_ORPHAN as _TREE_PARENT_ORPHAN,
    TREE_PARENT_SEED as _TREE_PARENT_SEED,
    SPLITMIX64_MUL1,
    SPLITMIX64_MUL2,
    VIOLATION_FIELD_EXPECTED_AUX,
    VIOLATION_FIELD_EXPECTED_TOKEN,
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_KERNEL_KIND,
    VIOLATION_FIELD_KV_LAYER,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_READ_POSITION,
    VIOLATION_FIELD_REQ_TO_TOKEN_ROW,
    VIOLATION_FIELD_SLOT_IDX,
    VIOLATION_FIELD_STORED_CHAIN_HASH,
    VIOLATION_FIELD_STORED_TOKEN,
    VIOLATION_NUM_FIELDS,
    FailReason,
)

# Fail-reason bits (the ``fail_reason_bits`` ring column).
FAIL_VERIFY_CHAIN = tl.constexpr(int(FailReason.VERIFY_CHAIN_HASH_MISMATCH))
FAIL_VERIFY_POSITION = tl.constexpr(int(FailReason.VERIFY_POSITION_MISMATCH))
FAIL_VERIFY_REAL_KV = tl.constexpr(int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH))
FAIL_WRITE_TOKEN = tl.constexpr(int(FailReason.WRITE_TOKEN_MISMATCH))
FAIL_WRITE_POSITION = tl.constexpr(int(FailReason.WRITE_POSITION_MISMATCH))
FAIL_VERIFY_TOKEN = tl.constexpr(int(FailReason.VERIFY_TOKEN_MISMATCH))

# Record fields: int64 word index inside a record, and words per record.
FIELD_TOKEN = tl.constexpr(CANARY_FIELD_TOKEN)
FIELD_POSITION = tl.constexpr(CANARY_FIELD_POSITION)
FIELD_PREV_HASH = tl.constexpr(CANARY_FIELD_PREV_HASH)
FIELD_REAL_KV_HASH = tl.constexpr(CANARY_FIELD_REAL_KV_HASH)
RECORD_WORDS = tl.constexpr(CANARY_NUM_FIELDS)

# Violation ring: int64 column index inside a row, and words per row.
VIOL_KERNEL_KIND = tl.constexpr(VIOLATION_FIELD_KERNEL_KIND)
VIOL_SLOT_IDX = tl.constexpr(VIOLATION_FIELD_SLOT_IDX)
VIOL_POSITION = tl.constexpr(VIOLATION_FIELD_POSITION)
VIOL_STORED_TOKEN = tl.constexpr(VIOLATION_FIELD_STORED_TOKEN)
VIOL_EXPECTED_TOKEN = tl.constexpr(VIOLATION_FIELD_EXPECTED_TOKEN)
VIOL_STORED_CHAIN_HASH = tl.constexpr(VIOLATION_FIELD_STORED_CHAIN_HASH)
VIOL_EXPECTED_AUX = tl.constexpr(VIOLATION_FIELD_EXPECTED_AUX)
VIOL_FAIL_REASON_BITS = tl.constexpr(VIOLATION_FIELD_FAIL_REASON_BITS)
VIOL_READ_POSITION = tl.constexpr(VIOLATION_FIELD_READ_POSITION)
VIOL_REQ_TO_TOKEN_ROW = tl.constexpr(VIOLATION_FIELD_REQ_TO_TOKEN_ROW)
VIOL_KV_LAYER = tl.constexpr(VIOLATION_FIELD_KV_LAYER)
VIOLATION_WORDS = tl.constexpr(VIOLATION_NUM_FIELDS)

# Plan sentinels.
NO_PREV_SLOT = tl.constexpr(_NO_PREV_SLOT)
NO_EXPECTED_TOKEN = tl.constexpr(_NO_EXPECTED_TOKEN)
NO_SEED_SLOT = tl.constexpr(_NO_SEED_SLOT)
NO_REQ_TO_TOKEN_ROW = tl.constexpr(_NO_REQ_TO_TOKEN_ROW)
NO_KV_LAYER = tl.constexpr(_NO_KV_LAYER)
TREE_PARENT_SEED = tl.constexpr(_TREE_PARENT_SEED)
TREE_PARENT_ORPHAN = tl.constexpr(_TREE_PARENT_ORPHAN)

# Hash constants (u64 values >= 2**63: Triton types them uint64, as it does the same literals).
CHAIN_ANCHOR = tl.constexpr(CANARY_CHAIN_ANCHOR)
CHAIN_MUL = tl.constexpr(CANARY_CHAIN_MUL)
CHAIN_MUL_INV = tl.constexpr(CANARY_CHAIN_MUL_INV)
SPLITMIX_MUL1 = tl.constexpr(SPLITMIX64_MUL1)
SPLITMIX_MUL2 = tl.constexpr(SPLITMIX64_MUL2)

# Real-KV source descriptors (``types.VerifyOrWriteContext.source_descriptors``; a per-layer
# column descriptor begins with one).
SRC_DESC_PTR = tl.constexpr(_consts.REAL_KV_DESC_PTR)
SRC_DESC_ROW_STRIDE = tl.constexpr(_consts.REAL_KV_DESC_ROW_STRIDE)
SRC_DESC_PAGE_SIZE = tl.constexpr(_consts.REAL_KV_DESC_PAGE_SIZE)
SRC_DESC_WORDS_PER_TOKEN = tl.constexpr(_consts.REAL_KV_DESC_WORDS_PER_TOKEN)
SRC_DESC_NUM_WORDS = tl.constexpr(_consts.REAL_KV_DESC_NUM_WORDS)
SRC_DESC_WORDS = tl.constexpr(_consts.REAL_KV_DESC_WORDS)

# Per-layer fingerprint column descriptors (``types.DeepFingerprintTable.descriptors``).
DESC_LAYER = tl.constexpr(_consts.DEEP_DESC_LAYER)
DESC_HALF = tl.constexpr(_consts.DEEP_DESC_HALF)
DESC_WORDS = tl.constexpr(_consts.DEEP_DESC_WORDS)
HALF_V = tl.constexpr(_consts.DEEP_HALF_V)
