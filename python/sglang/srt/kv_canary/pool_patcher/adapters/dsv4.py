"""Adapter for ``DeepSeekV4TokenToKVPool`` (docs/architecture.md, "The adapters and what they
cover"; docs/user_guide.md, "Sliding-window models (SWA) and DeepSeek-V4").

:func:`attach_dsv4` returns ``[FULL, SWA]``, K halves only: FULL on the logical full slots (no
real-KV bytes; it guards the ``req_to_token`` addressing every DSV4 read goes through), SWA on
``swa_kv_pool`` over the window, through ``full_to_swa_index_mapping``, fingerprinting layer 0's
584 bytes per token as two :class:`RealKvSource` (data, scales). Reads the pool's
``swa_kv_pool``, ``full_to_swa_index_mapping``, ``swa_window_size`` (when the caller gives no
window) and ``page_size``; the sub-pool's ``kv_buffer[0]``, ``page_size``, ``qk_nope_head_dim``,
``qk_rope_head_dim`` and ``get_bytes_per_token()``. Splices FULL into
``get_contiguous_buf_infos`` and SWA around the SWA layers of ``get_state_buf_infos``.
"""

from __future__ import annotations

import logging
from typing import List, Tuple

import torch

from sglang.jit_kernel.kv_canary.types import PoolKind, RealKvSource
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.pool_patcher.adapters.swa import (
    require_sub_pool,
    require_swa_table,
    require_window,
)
from sglang.srt.kv_canary.pool_patcher.buf_info_splice import splice_into_method
from sglang.srt.kv_canary.pool_patcher.buffer_alloc import allocate_canary_buffer
from sglang.srt.kv_canary.pool_patcher.types import AttachRequest
from sglang.srt.kv_canary.sglang_seam import import_sglang_class

logger = logging.getLogger(__name__)


def dsv4_token_layout(kv_pool) -> Tuple[int, int]:
    """``(data_bytes, scale_bytes)`` per token of a ``DeepSeekV4SingleKVPool`` page: nope fp8
    + rope bf16 bytes, then (after all ``page_size`` tokens' data) the padded scale bytes."""
    data = int(kv_pool.qk_nope_head_dim) + int(kv_pool.qk_rope_head_dim) * 2
    scale = int(kv_pool.get_bytes_per_token()) - data
    if data <= 0 or scale <= 0 or data % 8 or scale % 8:
        raise ValueError(
            f"kv_canary: unexpected DeepSeek-V4 token layout ({data} data + "
            f"{scale} scale bytes); the fingerprint needs multiples of 8"
        )
    return data, scale


def dsv4_layer_sources(kv_pool, layer: int = 0) -> Tuple[RealKvSource, RealKvSource]:
    """The two real-KV sources covering the 584 bytes of every token of ``layer``."""
    buf = kv_pool.kv_buffer[layer]
    page = int(kv_pool.page_size)
    data, scale = dsv4_token_layout(kv_pool)
    if buf.dim() != 2 or buf[0].nbytes < page * (data + scale):
        raise ValueError(
            f"kv_canary: DeepSeek-V4 layer buffer {tuple(buf.shape)} is too small "
            f"for {page} tokens of {data + scale} bytes"
        )
    u8 = buf if buf.dtype == torch.uint8 else buf.view(torch.uint8)  # rows are pages
    try:
        return (
            RealKvSource(tensor=u8, page_size=page, num_bytes_per_token=data, read_bytes=data),
            RealKvSource(
                tensor=u8[:, page * data : page * (data + scale)],
                page_size=page,
                num_bytes_per_token=scale,
                read_bytes=scale,
            ),
        )
    except ValueError as e:
        raise ValueError(f"kv_canary cannot fingerprint the DeepSeek-V4 SWA pool: {e}") from e


def attach_dsv4(request: AttachRequest) -> List[CanaryBufferGroup]:
    """``[FULL group, SWA group]`` for a ``DeepSeekV4TokenToKVPool`` (see module doc).
    ``request.swa_window_size`` defaults to the pool's own ``swa_window_size``;
    ``request.layer_ids`` is ignored."""
    pool, config, device = request.pool, request.config, request.device
    kv_token_id_vs_position_offset = request.kv_token_id_vs_position_offset
    swa_pool = require_sub_pool(pool, "swa_kv_pool")
    lut = require_swa_table(pool)
    swa_window_size = request.swa_window_size
    if swa_window_size is None:
        swa_window_size = getattr(pool, "swa_window_size", None)
    window = require_window(swa_window_size, pool)
    if config.enable_mha_v:
        logger.info("kv_canary: DeepSeek-V4 stores no V; SGLANG_KV_CANARY_ENABLE_MHA_V ignored")

    full_rows = lut.shape[0] - 1  # the table's last entry is the -1 sentinel
    full = CanaryBufferGroup(
        kind=PoolKind.FULL,
        k_head=allocate_canary_buffer(full_rows, device),
        k_tail=allocate_canary_buffer(full_rows, device),
        v_head=None,
        v_tail=None,
        real_kv_sources_k=(),
        real_kv_sources_v=(),
        swa_index_lut=None,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
    )
    swa_rows = swa_pool.kv_buffer[0].shape[0] * int(swa_pool.page_size)
    swa = CanaryBufferGroup(
        kind=PoolKind.SWA,
        k_head=allocate_canary_buffer(swa_rows, device),
        k_tail=allocate_canary_buffer(swa_rows, device),
        v_head=None,
        v_tail=None,
        real_kv_sources_k=dsv4_layer_sources(swa_pool, 0),
        real_kv_sources_v=(),
        swa_index_lut=lut,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
        swa_window_size=window,
    )
    splice_into_method(
        pool,
        "get_contiguous_buf_infos",
        num_k_entries=lambda infos: len(infos[0]),
        page_size=int(pool.page_size),
        k_head=full.k_head,
        k_tail=full.k_tail,
    )
    num_swa_layers = len(swa_pool.kv_buffer)
    splice_into_method(
        pool,
        "get_state_buf_infos",
        num_k_entries=lambda infos: num_swa_layers,
        page_size=int(swa_pool.page_size),
        k_head=swa.k_head,
        k_tail=swa.k_tail,
    )
    logger.info(
        "kv_canary: DeepSeekV4TokenToKVPool covered by a FULL group (%d logical "
        "slots, no real-KV bytes) and an SWA group (%d slots, window %d, layer-0 "
        "584-byte fingerprint); compressed c4/c128/indexer pools not fingerprinted",
        full_rows,
        swa_rows,
        window,
    )
    return [full, swa]


def register() -> None:
    from sglang.srt.kv_canary.pool_patcher.registry import register_pool_attacher

    try:
        pool_cls = import_sglang_class(
            "sglang.srt.mem_cache.deepseek_v4_memory_pool", "DeepSeekV4TokenToKVPool"
        )
    except ImportError as e:  # a build without DeepSeek-V4 support
        logger.info("kv_canary: DeepSeekV4TokenToKVPool unavailable (%s); DSV4 adapter off", e)
        return
    register_pool_attacher(pool_cls, attach_dsv4)
