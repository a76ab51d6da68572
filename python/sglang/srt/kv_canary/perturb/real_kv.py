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


def flip_first_byte(
    source: RealKvSource, slot: int, *, mask: int = 0x01, byte: int = 0
) -> ByteFlip:
    """XOR ``mask`` into byte ``byte`` (0-7) of ``slot``'s bytes in ``source`` (in place,
    through the source's int64 alias). The default flips bit 0 (a bf16/fp16 mantissa bit: the
    value changes, never to inf/NaN); ``byte=1, mask=0x40`` the first element's top exponent
    bit. Host-synchronising; self-tests only."""
    if not 0 < mask < 256:
        raise ValueError(f"mask must be in [1, 255], got {mask}")
    if not 0 <= byte < 8:
        raise ValueError(f"byte must be in [0, 7], got {byte}")
    page, in_page = divmod(int(slot), source.page_size)
    if not 0 <= page < source.words_view.shape[0]:
        raise IndexError(
            f"slot {slot} is outside the real-KV source ({source.words_view.shape[0]}"
            f" pages of {source.page_size})"
        )
    col = in_page * source.num_words_per_token
    word = source.words_view[page, col : col + 1].view(torch.uint8)  # 8 bytes, little-endian
    old = int(word[byte])
    word[byte] = old ^ mask
    return ByteFlip(row=page, byte=col * 8 + byte, old=old, new=old ^ mask)
