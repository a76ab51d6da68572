"""Triton device functions for the canary hashes (u64 arithmetic, logical shifts).

All values are ``tl.uint64``; callers bitcast int64 loads with ``.to(tl.uint64, bitcast=True)``
and store back with ``.to(tl.int64, bitcast=True)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.jit_kernel.kv_canary._kernel_consts import (
    CHAIN_ANCHOR,
    CHAIN_MUL,
    FIELD_POSITION,
    FIELD_PREV_HASH,
    FIELD_TOKEN,
    RECORD_WORDS,
    SPLITMIX_MUL1,
    SPLITMIX_MUL2,
    SRC_DESC_NUM_WORDS,
    SRC_DESC_PAGE_SIZE,
    SRC_DESC_PTR,
    SRC_DESC_ROW_STRIDE,
    SRC_DESC_WORDS,
    SRC_DESC_WORDS_PER_TOKEN,
)


@triton.jit
def splitmix64(x):
    x = x ^ (x >> 30)
    x = x * SPLITMIX_MUL1
    x = x ^ (x >> 27)
    x = x * SPLITMIX_MUL2
    return x ^ (x >> 31)


@triton.jit
def chain_key(tok, pos):
    """``e(token, position)`` of u64 token and position values."""
    return splitmix64(splitmix64(tok) ^ pos)


@triton.jit
def chain_step(prev, tok, pos):
    """``H(record) = prev * CHAIN_MUL + e(tok, pos)`` (u64; docs/chain_scan_design.md)."""
    return prev * CHAIN_MUL + chain_key(tok, pos)


@triton.jit
def as_u64(x):
    return x.to(tl.int64).to(tl.uint64, bitcast=True)


@triton.jit
def as_i64(x):
    return x.to(tl.int64, bitcast=True)


@triton.jit
def chain_head_hash():
    """``H(none) = splitmix64(CANARY_CHAIN_ANCHOR)`` as a u64 scalar."""
    return splitmix64(tl.full([], CHAIN_ANCHOR, tl.uint64))


@triton.jit
def record_hash(canary_ptr, slot, mask):
    """``H(record[slot])`` for a block of slots (int64 canary words, ``RECORD_WORDS`` per row)."""
    base = canary_ptr + slot * RECORD_WORDS
    tok = tl.load(base + FIELD_TOKEN, mask=mask, other=0)
    pos = tl.load(base + FIELD_POSITION, mask=mask, other=0)
    prev = tl.load(base + FIELD_PREV_HASH, mask=mask, other=0)
    return chain_step(as_u64(prev), as_u64(tok), as_u64(pos))


@triton.jit
def source_hash(desc, slot, mask):
    """Hash of one real-KV source for a block of slots (u64, before the fold's final mix).
    ``desc`` points at the source's descriptor (``SRC_DESC_*`` int64 words: the address of its
    int64 words, row stride, page size, words per token, words to fold)."""
    src = tl.load(desc + SRC_DESC_PTR).to(tl.pointer_type(tl.int64))
    row_stride_words = tl.load(desc + SRC_DESC_ROW_STRIDE)
    page_size = tl.load(desc + SRC_DESC_PAGE_SIZE)
    words_per_token = tl.load(desc + SRC_DESC_WORDS_PER_TOKEN)
    num_words = tl.load(desc + SRC_DESC_NUM_WORDS)
    page = slot // page_size
    base = page * row_stride_words + (slot - page * page_size) * words_per_token
    acc = tl.zeros(slot.shape, dtype=tl.uint64)
    # Software-pipelined by one word: the next load is issued before the current word is
    # folded, so its latency overlaps the (serial) hash.
    word = tl.load(src + base, mask=mask & (num_words > 0), other=0)
    for w in range(0, num_words):
        nxt = tl.load(src + base + w + 1, mask=mask & (w + 1 < num_words), other=0)
        acc = splitmix64(acc ^ as_u64(word))
        word = nxt
    return acc


@triton.jit
def real_kv_fingerprint(slot, mask, desc_ptr, NUM_SOURCES: tl.constexpr):
    """Fingerprint of the first ``NUM_SOURCES`` real-KV sources described at ``desc_ptr``
    (``SRC_DESC_WORDS`` int64 words each) for a block of slots (u64)."""
    acc = tl.zeros(slot.shape, dtype=tl.uint64)
    for i in tl.static_range(NUM_SOURCES):
        acc = splitmix64(acc ^ source_hash(desc_ptr + i * SRC_DESC_WORDS, slot, mask))
    return acc


@triton.jit
def single_source_fingerprint(desc, slot, mask):
    """The record format's fingerprint over the one source described at ``desc``
    (``splitmix64(0 ^ source hash)``), for a block of slots: a per-layer (deep) fingerprint
    column."""
    return splitmix64(source_hash(desc, slot, mask))
