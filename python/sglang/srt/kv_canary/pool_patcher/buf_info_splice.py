"""Splice canary buffers into a pool's buffer-info methods, so PD disaggregation transfers
canary rows together with the KV pages they guard (docs/architecture.md, "Buffer groups and
adapters").

Order: K-head, the K layers, K-tail, the per-layer fingerprint table (with
``--kv-canary-real-data-layers all``), V-head, the V layers, V-tail; a canary entry has
``ptr = buf.data_ptr()``, ``len = buf.nbytes``, ``item_len = row bytes * page_size`` (one item
per KV page: 32 bytes a slot for the records). Methods are wrapped on the pool *instance*,
once: wrapping twice raises.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from sglang.jit_kernel.kv_canary.types import CANARY_SLOT_BYTES
from sglang.srt.kv_canary.sglang_seam import wrap_method_once

BufInfos = Tuple[List[int], List[int], List[int]]


def _entry(buf: torch.Tensor, page_size: int) -> Tuple[int, int, int]:
    row = buf[0].nbytes if buf.dim() > 1 else CANARY_SLOT_BYTES
    return buf.data_ptr(), buf.nbytes, row * page_size


def splice_buf_infos(
    infos: BufInfos,
    *,
    num_k_entries: int,
    page_size: int,
    k_head: torch.Tensor,
    k_tail: torch.Tensor,
    v_head: Optional[torch.Tensor],
    v_tail: Optional[torch.Tensor],
    k_extra: Optional[torch.Tensor] = None,
) -> BufInfos:
    """Return new ``(ptrs, lens, item_lens)`` with the canary entries around the K entries
    (the first ``num_k_entries``) and the V entries (the rest); ``k_extra`` (one row per slot)
    follows the K-tail."""
    ptrs, lens, items = (list(x) for x in infos)
    if not len(ptrs) == len(lens) == len(items):
        raise ValueError(f"buf infos have mismatched lengths {len(ptrs)}/{len(lens)}/{len(items)}")
    if not 0 <= num_k_entries <= len(ptrs):
        raise ValueError(f"num_k_entries={num_k_entries} out of range for {len(ptrs)} entries")

    def section(lo: int, hi: int, head, tail) -> List[Tuple[int, int, int]]:
        body = list(zip(ptrs[lo:hi], lens[lo:hi], items[lo:hi]))
        if head is None:
            return body
        return [_entry(head, page_size)] + body + [_entry(tail, page_size)]

    extra = [_entry(k_extra, page_size)] if k_extra is not None else []
    rows = (
        section(0, num_k_entries, k_head, k_tail)
        + extra
        + section(num_k_entries, len(ptrs), v_head, v_tail)
    )
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def splice_into_method(
    pool,
    method_name: str,
    *,
    num_k_entries: Callable[[BufInfos], int],
    page_size: int,
    k_head,
    k_tail,
    v_head=None,
    v_tail=None,
    k_extra=None,
) -> None:
    """Wrap ``pool.method_name`` (once) so it returns the spliced buf infos."""

    def make(original):
        def wrapper(*args, **kwargs):
            infos = original(*args, **kwargs)
            return splice_buf_infos(
                infos,
                num_k_entries=num_k_entries(infos),
                page_size=page_size,
                k_head=k_head,
                k_tail=k_tail,
                v_head=v_head,
                v_tail=v_tail,
                k_extra=k_extra,
            )

        return wrapper

    wrap_method_once(pool, method_name, make)
