"""Adapter for ``MHATokenToKVPool`` and ``MHATokenToKVPoolFP4``: one FULL group.

Real-KV sources: layer 0's K rows (and V rows for the V half), one token per row
(``[size + page_size, head_num, head_dim]``), fingerprinted whole in ALL mode. Per-layer
columns: every layer's K and V rows; with ``--kv-canary-real-data-layers all`` their table is
spliced after the K-tail (PD transfers carry it).

:func:`build_mha_group` is shared with the SWA adapter, whose two sub-pools are MHA pools.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import torch

from sglang.jit_kernel.kv_canary.types import PoolKind
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.pool_patcher.buf_info_splice import splice_into_method
from sglang.srt.kv_canary.pool_patcher.buffer_alloc import allocate_canary_buffer
from sglang.srt.kv_canary.pool_patcher.layer_columns import (
    deep_table_for,
    layer_columns,
    pool_layer_ids,
    row_source,
)
from sglang.srt.kv_canary.pool_patcher.types import AttachRequest
from sglang.srt.kv_canary.sglang_seam import import_sglang_class

logger = logging.getLogger(__name__)


def build_mha_group(
    kv_pool,
    *,
    kind: PoolKind,
    config,
    device,
    kv_token_id_vs_position_offset: int,
    swa_index_lut: Optional[torch.Tensor] = None,
    swa_window_size: int = 0,
    layer_ids: Optional[Sequence[int]] = None,
) -> CanaryBufferGroup:
    """Allocate K (and, with ``config.enable_mha_v``, V) head/tail buffers of
    ``kv_pool.size + kv_pool.page_size`` rows (one per row of ``kv_pool.k_buffer[0]``) and
    return the group; nothing is spliced here. ``layer_ids``: the sglang layer id of each of
    the pool's layers (default: from its ``start_layer``)."""
    num_slots = kv_pool.k_buffer[0].shape[0]
    k_head = allocate_canary_buffer(num_slots, device)
    k_tail = allocate_canary_buffer(num_slots, device)
    v_head = v_tail = None
    if config.enable_mha_v:
        v_head = allocate_canary_buffer(num_slots, device)
        v_tail = allocate_canary_buffer(num_slots, device)
    if layer_ids is None:
        layer_ids = pool_layer_ids(kv_pool, len(kv_pool.k_buffer))
    columns = layer_columns(
        layer_ids, kv_pool.k_buffer, kv_pool.v_buffer, what=f"this {type(kv_pool).__name__}'s"
    )
    return CanaryBufferGroup(
        kind=kind,
        k_head=k_head,
        k_tail=k_tail,
        v_head=v_head,
        v_tail=v_tail,
        real_kv_sources_k=(row_source(kv_pool.k_buffer[0], "this MHA pool's layer-0 K rows"),),
        real_kv_sources_v=(row_source(kv_pool.v_buffer[0], "this MHA pool's layer-0 V rows"),),
        swa_index_lut=swa_index_lut,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
        swa_window_size=swa_window_size,
        layer_columns=columns,
        deep=deep_table_for(columns, num_slots=num_slots, config=config, device=device),
    )


def splice_mha_group(pool, method_name: str, group: CanaryBufferGroup, page_size: int) -> None:
    """Splice ``group``'s buffers into ``pool.method_name``, whose infos list the K layers
    then the V layers of an MHA pool (so the first half are K entries)."""
    splice_into_method(
        pool,
        method_name,
        num_k_entries=lambda infos: len(infos[0]) // 2,
        page_size=page_size,
        k_head=group.k_head,
        k_tail=group.k_tail,
        v_head=group.v_head,
        v_tail=group.v_tail,
        k_extra=group.deep.table if group.deep is not None else None,
    )


def attach_mha(request: AttachRequest) -> List[CanaryBufferGroup]:
    """One FULL group over the whole pool, spliced into ``get_contiguous_buf_infos``.
    ``request.swa_window_size`` is ignored: MHA pools have no sliding window."""
    pool = request.pool
    group = build_mha_group(
        pool,
        kind=PoolKind.FULL,
        config=request.config,
        device=request.device,
        kv_token_id_vs_position_offset=request.kv_token_id_vs_position_offset,
        layer_ids=request.layer_ids,
    )
    splice_mha_group(pool, "get_contiguous_buf_infos", group, pool.page_size)
    return [group]


def register() -> None:
    from sglang.srt.kv_canary.pool_patcher.registry import register_pool_attacher

    for name in ("MHATokenToKVPool", "MHATokenToKVPoolFP4"):
        try:
            cls = import_sglang_class("sglang.srt.mem_cache.memory_pool", name)
        except ImportError:
            logger.warning("kv_canary: %s not found in this sglang; not covered", name)
            continue
        register_pool_attacher(cls, attach_mha)
