"""Flipping one bit of a slot's real KV bytes (the real-KV fault classes of
docs/subsystems.md, "Self-tests")."""

from __future__ import annotations

import dataclasses

import torch

from sglang.jit_kernel.kv_canary.types import RealKvSource


@dataclasses.dataclass(frozen=True)
class ByteFlip:
    """Where a flip landed: source row (page) ``row``, byte offset ``byte`` in that row, and
    the byte's value before / after."""

    row: int
    byte: int
    old: int
    new: int


def flip_first_byte(source: RealKvSource, slot: int, *, mask: int = 0x01) -> ByteFlip:
    """XOR ``mask`` into the first byte of ``slot``'s bytes in ``source`` (in place, through
    the source's int64 alias). The default flips bit 0 (a bf16/fp16 mantissa bit: the value
    changes, never to inf/NaN). Host-synchronising; self-tests only."""
    if not 0 < mask < 256:
        raise ValueError(f"mask must be in [1, 255], got {mask}")
    page, in_page = divmod(int(slot), source.page_size)
    if not 0 <= page < source.words_view.shape[0]:
        raise IndexError(
            f"slot {slot} is outside the real-KV source ({source.words_view.shape[0]}"
            f" pages of {source.page_size})"
        )
    col = in_page * source.num_words_per_token
    word = source.words_view[page, col : col + 1].view(torch.uint8)  # 8 bytes, little-endian
    old = int(word[0])
    word[0] = old ^ mask
    return ByteFlip(row=page, byte=col * 8, old=old, new=old ^ mask)
