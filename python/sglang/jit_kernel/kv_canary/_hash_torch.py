"""Vectorised torch versions of the canary hashes, on int64 tensors holding u64 bit patterns.

torch has no full uint64 arithmetic, so values are kept as int64 bit patterns: multiplication
and XOR wrap identically, and the logical right shift is an arithmetic shift plus a mask.
Used by the torch references (the oracle and the CPU serving path); not graph-capture code.
"""

from __future__ import annotations

import torch

from sglang.jit_kernel.kv_canary.consts import (
    CANARY_CHAIN_ANCHOR,
    CANARY_CHAIN_MUL,
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_TOKEN,
    SPLITMIX64_MUL1,
    SPLITMIX64_MUL2,
    canary_chain_head_hash,
    to_int64,
)

_MUL1 = to_int64(SPLITMIX64_MUL1)
_MUL2 = to_int64(SPLITMIX64_MUL2)
_CHAIN_MUL = to_int64(CANARY_CHAIN_MUL)
CHAIN_HEAD_HASH_I64 = to_int64(canary_chain_head_hash())
CHAIN_ANCHOR_I64 = to_int64(CANARY_CHAIN_ANCHOR)


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    """Element-wise splitmix64 on an int64 tensor (u64 bit patterns)."""
    x = x ^ _lsr(x, 30)
    x = x * _MUL1
    x = x ^ _lsr(x, 27)
    x = x * _MUL2
    return x ^ _lsr(x, 31)


def chain_key_t(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Element-wise ``e(token, position)``; arguments broadcast, all int64."""
    return splitmix64_t(splitmix64_t(tok) ^ pos)


def chain_step_t(prev: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Element-wise ``H = prev * CANARY_CHAIN_MUL + e(tok, pos)`` (wrapping int64 arithmetic
    is arithmetic mod 2**64); arguments broadcast, all int64."""
    return prev * _CHAIN_MUL + chain_key_t(tok, pos)


def record_hash_t(records: torch.Tensor) -> torch.Tensor:
    """``H(record)`` for an int64 ``[n, 4]`` block of records → int64 ``[n]``."""
    return chain_step_t(
        records[:, CANARY_FIELD_PREV_HASH],
        records[:, CANARY_FIELD_TOKEN],
        records[:, CANARY_FIELD_POSITION],
    )


def real_kv_fingerprint_t(sources, num_words, slots: torch.Tensor) -> torch.Tensor:
    """Fingerprint of the real KV bytes of ``slots`` (int64 ``[n]``, all in range).

    ``sources`` is a sequence of :class:`~sglang.jit_kernel.kv_canary.types.RealKvSource`,
    ``num_words`` the number of 8-byte words to fold from each (per hash mode). The fold is
    serial over words and vectorised over slots.
    """
    acc = torch.zeros(slots.shape, dtype=torch.int64, device=slots.device)
    for source, nwords in zip(sources, num_words):
        words = source.words_view
        page = torch.div(slots, source.page_size, rounding_mode="floor")
        col0 = (slots - page * source.page_size) * source.num_words_per_token
        src_acc = torch.zeros_like(acc)
        for w in range(nwords):
            src_acc = splitmix64_t(src_acc ^ words[page, col0 + w])
        acc = splitmix64_t(acc ^ src_acc)
    return acc
