"""Adapter for ``SWAKVPool``, hybrid sliding-window models (docs/architecture.md, "The adapters
and what they cover").

:func:`attach_swa` returns ``[FULL, SWA]`` (a sub-pool without layers gets none), each an MHA
group (layer 0's K rows, and V rows with the V half): FULL on ``full_kv_pool`` (the whole
prefix, by ``req_to_token`` slots), SWA on ``swa_kv_pool`` over the window, through
``full_to_swa_index_mapping`` (full slot → SWA slot, 0 = evicted). Reads those three,
``layers_mapping`` and ``page_size``; the window is the caller's
(``ModelRunner.sliding_window_size``). The table is the allocator's, held by reference: attach
after ``SWATokenToKVPoolAllocator`` exists. Splices FULL into
``get_contiguous_buf_infos`` and SWA into ``get_state_buf_infos``.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch

from sglang.jit_kernel.kv_canary.types import PoolKind
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.pool_patcher.adapters.mha import build_mha_group, splice_mha_group
from sglang.srt.kv_canary.pool_patcher.types import AttachRequest
from sglang.srt.kv_canary.sglang_seam import import_sglang_class

logger = logging.getLogger(__name__)


def require_sub_pool(pool, name: str):
    """``pool.<name>``, or a ``ValueError`` naming the pool class and the missing sub-pool."""
    sub = getattr(pool, name, None)
    if sub is None:
        raise ValueError(
            f"kv_canary: {type(pool).__name__} has no {name!r} sub-pool; the "
            "canary's SWA adapters need it (is this sglang build supported?)"
        )
    return sub


def require_swa_table(pool) -> torch.Tensor:
    """The pool's full → SWA slot table, checked: a 1-D int32/int64 tensor registered by the
    SWA allocator."""
    lut = getattr(pool, "full_to_swa_index_mapping", None)
    if lut is None:
        raise RuntimeError(
            f"kv_canary: {type(pool).__name__}.full_to_swa_index_mapping is not set; the "
            "SWATokenToKVPoolAllocator registers it, so the canary must be attached after "
            "the allocator is built (sglang does both in ModelRunner.init_memory_pool)"
        )
    if (
        not isinstance(lut, torch.Tensor)
        or lut.dim() != 1
        or lut.dtype not in (torch.int32, torch.int64)
    ):
        raise TypeError(
            f"kv_canary: full_to_swa_index_mapping must be a 1-D int32/int64 "
            f"tensor, got {getattr(lut, 'dtype', type(lut))} "
            f"{tuple(getattr(lut, 'shape', ()))}"
        )
    return lut


def require_window(swa_window_size: Optional[int], pool) -> int:
    if (
        isinstance(swa_window_size, bool)
        or not isinstance(swa_window_size, int)
        or swa_window_size <= 0
    ):
        raise ValueError(
            f"kv_canary: {type(pool).__name__} needs the model's sliding window size (an int "
            f">= 1, ModelRunner.sliding_window_size), got {swa_window_size!r}"
        )
    return swa_window_size


def _global_layer_ids(pool, *, swa: bool):
    """The model's layer ids of the full (or SWA) sub-pool's layers, in sub-pool order (from
    ``SWAKVPool.layers_mapping``: global id -> (sub-pool index, is SWA))."""
    mapping = getattr(pool, "layers_mapping", None)
    if not isinstance(mapping, dict):
        raise ValueError(
            f"kv_canary: {type(pool).__name__} has no layers_mapping; this sglang's "
            "SWA pool is not the one the canary was written for"
        )
    ids = sorted((idx, gid) for gid, (idx, is_swa) in mapping.items() if bool(is_swa) == swa)
    return [gid for _, gid in ids]


_ARTICLE = {PoolKind.FULL: "a", PoolKind.SWA: "an"}  # the start-up line's "a FULL", "an SWA"


def attach_swa(request: AttachRequest) -> List[CanaryBufferGroup]:
    """``[FULL group, SWA group]`` for an ``SWAKVPool``; splices both (see module doc). A
    sub-pool without layers gets no group: an MTP draft model's one-layer pool (sglang's
    ``MiMoV2MTP`` / ``Step3p5MTP``: one sliding-window layer, no full one) gets the SWA group
    alone, which covers every read of its only layer. ``ValueError`` when neither sub-pool has
    a layer. ``request.layer_ids`` is ignored (the pool has its own layer map)."""
    pool, config, device = request.pool, request.config, request.device
    kv_token_id_vs_position_offset = request.kv_token_id_vs_position_offset
    full_pool = require_sub_pool(pool, "full_kv_pool")
    swa_pool = require_sub_pool(pool, "swa_kv_pool")
    lut = require_swa_table(pool)
    window = require_window(request.swa_window_size, pool)
    if not full_pool.k_buffer and not swa_pool.k_buffer:
        raise ValueError(
            f"kv_canary: this {type(pool).__name__} has no layer in either sub-pool "
            "(full_kv_pool, swa_kv_pool): nothing to guard"
        )
    # per sub-pool: the group's kind, the buf-info method it is spliced into, its SWA extras
    parts = (
        (full_pool, PoolKind.FULL, "get_contiguous_buf_infos", {}),
        (
            swa_pool,
            PoolKind.SWA,
            "get_state_buf_infos",
            dict(swa_index_lut=lut, swa_window_size=window),
        ),
    )
    groups = []
    for sub_pool, kind, method, swa_extras in parts:
        if not sub_pool.k_buffer:
            continue
        group = build_mha_group(
            sub_pool,
            kind=kind,
            config=config,
            device=device,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
            layer_ids=_global_layer_ids(pool, swa=kind == PoolKind.SWA),
            **swa_extras,
        )
        splice_mha_group(pool, method, group, pool.page_size)
        groups.append(group)
    logger.info(
        "kv_canary: SWAKVPool covered by %s, window %d",
        " and ".join(
            f"{_ARTICLE[g.kind]} {g.kind.name} group ({g.num_slots} slots)" for g in groups
        ),
        window,
    )
    return groups


def register() -> None:
    from sglang.srt.kv_canary.pool_patcher.registry import register_pool_attacher

    try:
        swa_kv_pool = import_sglang_class("sglang.srt.mem_cache.swa_memory_pool", "SWAKVPool")
    except ImportError:
        logger.warning("kv_canary: SWAKVPool not found in this sglang; SWA adapter off")
        return
    register_pool_attacher(swa_kv_pool, attach_swa)
