"""Constants of the KV-canary record format and its hashing (docs/architecture.md, "Record
format"): plain Python (no torch, no Triton), so host code, kernels and tests share one
definition; ``_hash_triton`` and ``_hash_torch`` are checked against :func:`splitmix64` here.

Record (``uint8[32]`` per KV slot, four little-endian int64 fields)::

    field 0 token | field 1 position | field 2 prev_hash | field 3 real_kv_hash

Violation ring row (``int64[11]``; new columns are only appended)::

    kernel_kind | slot_idx | position | stored_token | expected_token | stored_chain_hash |
    expected_aux | fail_reason_bits | read_position | req_to_token_row | kv_layer
"""

from __future__ import annotations

import enum

MASK64 = (1 << 64) - 1

CANARY_CHAIN_ANCHOR = 0xC0FFEE1234567890
SPLITMIX64_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX64_MUL2 = 0x94D049BB133111EB
# The chain step's multiplier (docs/chain_scan_design.md): odd, so a step is a bijection of the
# chain state mod 2**64 and has an inverse; a full-period LCG multiplier (Steele and Vigna, 2021).
CANARY_CHAIN_MUL = 0xD1342543DE82EF95
CANARY_CHAIN_MUL_INV = pow(CANARY_CHAIN_MUL, -1, 1 << 64)

# Record fields (int64 index into a 32-byte row).
CANARY_FIELD_BYTES = 8  # each field is one little-endian int64
CANARY_FIELD_TOKEN = 0
CANARY_FIELD_POSITION = 1
CANARY_FIELD_PREV_HASH = 2
CANARY_FIELD_REAL_KV_HASH = 3
CANARY_NUM_FIELDS = 4

# Violation ring columns.
VIOLATION_FIELD_KERNEL_KIND = 0
VIOLATION_FIELD_SLOT_IDX = 1
VIOLATION_FIELD_POSITION = 2
VIOLATION_FIELD_STORED_TOKEN = 3
VIOLATION_FIELD_EXPECTED_TOKEN = 4
VIOLATION_FIELD_STORED_CHAIN_HASH = 5
VIOLATION_FIELD_EXPECTED_AUX = 6
VIOLATION_FIELD_FAIL_REASON_BITS = 7
# where the slot was read: the position attention read it for (verify) or the forward wrote it
# at (write), and the req_to_token row of the request (NO_REQ_TO_TOKEN_ROW for a sweep entry)
VIOLATION_FIELD_READ_POSITION = 8
VIOLATION_FIELD_REQ_TO_TOKEN_ROW = 9
# the sglang layer id of a per-layer (deep) fingerprint that failed (NO_KV_LAYER otherwise:
# every check of the record itself, layer 0's fingerprint in field 3 included)
VIOLATION_FIELD_KV_LAYER = 10
VIOLATION_NUM_FIELDS = 11

# Real-KV fingerprint limits (docs/architecture.md, "Record format").
REAL_KV_MAX_SOURCES = 4
REAL_KV_PARTIAL_BYTES = 16
REAL_KV_WORD_BYTES = 8

# One real-KV source descriptor (int64 words): the address of the source's ``words_view``, its
# row stride in words, page size, words per token, and the words a fingerprint folds (by the
# hash mode). ``VerifyOrWriteContext.source_descriptors`` holds REAL_KV_MAX_SOURCES of them
# (rows past the context's sources are never read); a per-layer column descriptor
# (DEEP_DESC_*) begins with one.
REAL_KV_DESC_PTR = 0
REAL_KV_DESC_ROW_STRIDE = 1
REAL_KV_DESC_PAGE_SIZE = 2
REAL_KV_DESC_WORDS_PER_TOKEN = 3
REAL_KV_DESC_NUM_WORDS = 4
REAL_KV_DESC_WORDS = 5

# Sentinels used in plans.
NO_PREV_SLOT = -1  # predecessor of position 0 (chain head)
NO_EXPECTED_TOKEN = -1  # expected token unknown: token check skipped
NO_SEED_SLOT = -1  # write seed of a chain head / padding row
NO_REQ_TO_TOKEN_ROW = -1  # plan entry not read through a request's req_to_token row (sweep)
HOST_TIER_ROW = -2  # a HiCache host-tier sweep entry: its slot is a host-pool index
NO_KV_LAYER = -1  # a ring row that is not a per-layer fingerprint check
# a draft tree's write (types.WriteTree.parent): an entry's parent is its request's seed, or it
# has none among the written entries (sglang dropped it from the tree: nothing reads it)
TREE_PARENT_SEED = -1
TREE_PARENT_ORPHAN = -2


class FailReason(enum.IntFlag):
    """Bits of the ``fail_reason_bits`` violation column (values fixed by the record format)."""

    VERIFY_CHAIN_HASH_MISMATCH = 1
    VERIFY_POSITION_MISMATCH = 2
    VERIFY_REAL_KV_HASH_MISMATCH = 4
    WRITE_TOKEN_MISMATCH = 8
    WRITE_POSITION_MISMATCH = 16
    VERIFY_TOKEN_MISMATCH = 32

    @staticmethod
    def describe(bits: int) -> str:
        """Reasons joined with ``+``, lower-case, without ``_mismatch``.

        ``FailReason.describe(5) == "verify_chain_hash+verify_real_kv_hash"``; unknown bits are
        rendered as ``unknown_0x..`` so a corrupted ring row is still printable.
        """
        bits = int(bits)
        names = []
        for reason in FailReason:
            if bits & reason.value:
                names.append(reason.name.lower().removesuffix("_mismatch"))
        unknown = bits & ~sum(r.value for r in FailReason)
        if unknown:
            names.append(f"unknown_0x{unknown & MASK64:x}")
        return "+".join(names) if names else "none"


class RealKvHashMode(enum.IntEnum):
    """How much of each real-KV source a TAIL/SWEEP launch fingerprints."""

    NONE = 0  # real_kv_hash stays 0
    PARTIAL = 1  # the first min(16, read_bytes) bytes of each source
    ALL = 2  # all read_bytes of each source


def splitmix64(x: int) -> int:
    """splitmix64 finaliser on a python int, mod 2**64 (the host-side oracle)."""
    x &= MASK64
    x ^= x >> 30
    x = (x * SPLITMIX64_MUL1) & MASK64
    x ^= x >> 27
    x = (x * SPLITMIX64_MUL2) & MASK64
    x ^= x >> 31
    return x


def canary_chain_key(token: int, position: int) -> int:
    """``e(token, position) = splitmix64(splitmix64(token) ^ position)`` mod 2**64: for a fixed
    position a bijection of the token, for a fixed token one of the position."""
    return splitmix64(splitmix64(token) ^ (position & MASK64))


def canary_chain_step(prev_hash: int, token: int, position: int) -> int:
    """``H(record) = prev_hash * CANARY_CHAIN_MUL + e(token, position)`` mod 2**64: the state
    after a record (an affine map of the state before it, so a parallel scan computes a chain:
    docs/chain_scan_design.md)."""
    return ((prev_hash & MASK64) * CANARY_CHAIN_MUL + canary_chain_key(token, position)) & MASK64


def canary_chain_head_hash() -> int:
    """``H(none)``: the prev_hash a position-0 record must carry."""
    return splitmix64(CANARY_CHAIN_ANCHOR)


def to_int64(x: int) -> int:
    """Reinterpret an unsigned 64-bit value as the int64 bit pattern stored in tensors."""
    x &= MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


def to_uint64(x: int) -> int:
    """Reinterpret an int64 bit pattern as its unsigned 64-bit value."""
    return int(x) & MASK64


# ---------------------------------------------------------------------------------------------
# Packed token-id uploads
# ---------------------------------------------------------------------------------------------

# A packed token-id upload (docs/architecture.md, "Token-id scatter"): one int64 buffer
# ``[PACKED_TOKENS_HEADER + PACKED_TOKENS_ROW_FIELDS * n + total]``. Word PACKED_TOKENS_NUM_REQS
# holds n; then one row of PACKED_TOKENS_ROW_FIELDS words per request: its whole history length
# (the plan's valid length), the first position sent and the offset of its segment in the
# flat part; then the flat part (the tokens sent, request after request).
PACKED_TOKENS_NUM_REQS = 0
PACKED_TOKENS_HEADER = 1
PACKED_TOKENS_ROW_LEN = 0
PACKED_TOKENS_ROW_START = 1
PACKED_TOKENS_ROW_OFFSET = 2
PACKED_TOKENS_ROW_FIELDS = 3


def packed_tokens_numel(num_reqs: int, num_tokens: int) -> int:
    """Words of a packed token-id upload of ``num_reqs`` requests and ``num_tokens`` tokens."""
    return PACKED_TOKENS_HEADER + PACKED_TOKENS_ROW_FIELDS * num_reqs + num_tokens


# ---------------------------------------------------------------------------------------------
# Staged launch inputs
# ---------------------------------------------------------------------------------------------

# The table an eager forward's staging kernel reads (docs/performance.md, "The forward path"): one
# int64 buffer ``[STAGE_TABLE_NUMEL]``. Word STAGE_NUM_ENTRIES holds the entry count e (at most
# STAGE_MAX_ENTRIES); then e entries of STAGE_ENTRY_FIELDS words: the destination's address
# (int64 elements), source A's address, source B's address or the fill value, the element count
# and the kind: the operation (kind & STAGE_OP_MASK: copy A, fill with B, A - B, every B-th
# element of A) and whether A / B hold int32 elements (STAGE_A_INT32 / STAGE_B_INT32; int64
# otherwise).
STAGE_NUM_ENTRIES = 0
STAGE_HEADER = 1
STAGE_DST = 0
STAGE_A = 1
STAGE_B = 2
STAGE_NUMEL = 3
STAGE_KIND = 4
STAGE_ENTRY_FIELDS = 5
STAGE_MAX_ENTRIES = 12
STAGE_TABLE_NUMEL = STAGE_HEADER + STAGE_MAX_ENTRIES * STAGE_ENTRY_FIELDS
STAGE_OP_COPY = 0
STAGE_OP_FILL = 1
STAGE_OP_SUB = 2
STAGE_OP_STRIDE = 3  # dst[i] = A[i * B], B the stride (an element count >= 1)
STAGE_OP_MASK = 3
STAGE_A_INT32 = 4
STAGE_B_INT32 = 8


# ---------------------------------------------------------------------------------------------
# Per-layer (deep) fingerprints
# ---------------------------------------------------------------------------------------------

# One column descriptor in ``DeepFingerprintTable.descriptors`` (int64 words): the column
# source's real-KV source descriptor (REAL_KV_DESC_*, in the table's mode), then the column's
# sglang layer id and its half (DEEP_HALF_K / DEEP_HALF_V).
DEEP_DESC_LAYER = REAL_KV_DESC_WORDS
DEEP_DESC_HALF = REAL_KV_DESC_WORDS + 1
DEEP_DESC_WORDS = REAL_KV_DESC_WORDS + 2
DEEP_HALF_K = 0
DEEP_HALF_V = 1
