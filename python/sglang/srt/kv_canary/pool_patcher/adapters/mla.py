"""Adapter for the MLA pools ``MLATokenToKVPool``, ``MLATokenToKVPoolFP4`` and
``NSATokenToKVPool`` (docs/architecture.md, "The adapters and what they cover";
docs/user_guide.md, "Supported pools").

:func:`attach_mla` returns one FULL group, K only (attention reads V from the latent row), one
record row per latent row. Reads ``kv_buffer`` (per layer ``[size + page_size, 1,
kv_cache_dim]``; FP4: packed uint8, its ``kv_scale_buffer`` not fingerprinted) and
``page_size``; NSA also ``index_k_with_scale_buffer[0]`` and ``index_head_dim`` (layer 0's
indexer keys, a second real-KV source; not the per-page scales). Splices the K-head before and
the K-tail (and the per-layer table) after the latent layers of ``get_contiguous_buf_infos``.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

from sglang.jit_kernel.kv_canary.types import PoolKind, RealKvSource
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup
from sglang.srt.kv_canary.pool_patcher.buf_info_splice import splice_into_method
from sglang.srt.kv_canary.pool_patcher.buffer_alloc import allocate_canary_buffer
from sglang.srt.kv_canary.pool_patcher.layer_columns import (
    deep_table_for,
    layer_columns,
    pool_layer_ids,
)
from sglang.srt.kv_canary.pool_patcher.types import AttachRequest
from sglang.srt.kv_canary.sglang_seam import import_sglang_class

logger = logging.getLogger(__name__)

MLA_POOL_CLASSES = ("MLATokenToKVPool", "MLATokenToKVPoolFP4", "NSATokenToKVPool")


def _source(what: str, **kwargs) -> RealKvSource:
    try:
        return RealKvSource(**kwargs)
    except ValueError as e:
        raise ValueError(f"kv_canary cannot fingerprint this MLA pool's {what}: {e}") from e


def mla_latent_source(kv_pool) -> RealKvSource:
    """Layer 0's latent rows, one slot per row."""
    buf = kv_pool.kv_buffer[0]
    row_bytes = buf[0].nbytes
    return _source(
        "layer-0 latent rows",
        tensor=buf,
        page_size=1,
        num_bytes_per_token=row_bytes,
        read_bytes=row_bytes,
    )


def nsa_index_key_source(kv_pool) -> RealKvSource:
    """Layer 0's indexer keys: row ``p`` of ``index_k_with_scale_buffer[0]`` is page ``p``,
    whose first ``page_size * index_head_dim`` bytes are its slots' fp8 keys in slot order."""
    buf = kv_pool.index_k_with_scale_buffer[0]
    key_bytes = int(kv_pool.index_head_dim) * buf.element_size()
    return _source(
        "layer-0 indexer keys",
        tensor=buf,
        page_size=int(kv_pool.page_size),
        num_bytes_per_token=key_bytes,
        read_bytes=key_bytes,
    )


def mla_sources(kv_pool) -> Tuple[RealKvSource, ...]:
    sources = [mla_latent_source(kv_pool)]
    if getattr(kv_pool, "index_k_with_scale_buffer", None) is not None:
        sources.append(nsa_index_key_source(kv_pool))
    return tuple(sources)


def build_mla_group(
    kv_pool,
    *,
    config,
    device,
    kv_token_id_vs_position_offset: int,
    layer_ids: Optional[Sequence[int]] = None,
) -> CanaryBufferGroup:
    """K head / tail buffers of ``size + page_size`` rows (one per latent row); no V half.
    Per-layer columns: every layer's latent rows (K only)."""
    num_slots = kv_pool.kv_buffer[0].shape[0]
    if layer_ids is None:
        layer_ids = pool_layer_ids(kv_pool, len(kv_pool.kv_buffer))
    columns = layer_columns(
        layer_ids, kv_pool.kv_buffer, what=f"this {type(kv_pool).__name__}'s latent"
    )
    return CanaryBufferGroup(
        kind=PoolKind.FULL,
        k_head=allocate_canary_buffer(num_slots, device),
        k_tail=allocate_canary_buffer(num_slots, device),
        v_head=None,
        v_tail=None,
        real_kv_sources_k=mla_sources(kv_pool),
        real_kv_sources_v=(),
        swa_index_lut=None,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
        layer_columns=columns,
        deep=deep_table_for(columns, num_slots=num_slots, config=config, device=device),
    )


def attach_mla(request: AttachRequest) -> List[CanaryBufferGroup]:
    """One FULL group over the latent rows, spliced into ``get_contiguous_buf_infos`` (every
    entry is a K entry). ``config.enable_mha_v`` is ignored: MLA has no V rows of its own.
    ``request.swa_window_size`` is ignored."""
    pool = request.pool
    if request.config.enable_mha_v:
        logger.info(
            "kv_canary: %s has no V rows (V is part of the latent row); "
            "SGLANG_KV_CANARY_ENABLE_MHA_V does not apply",
            type(pool).__name__,
        )
    group = build_mla_group(
        pool,
        config=request.config,
        device=request.device,
        layer_ids=request.layer_ids,
        kv_token_id_vs_position_offset=request.kv_token_id_vs_position_offset,
    )
    splice_into_method(
        pool,
        "get_contiguous_buf_infos",
        num_k_entries=lambda infos: len(infos[0]),
        page_size=pool.page_size,
        k_head=group.k_head,
        k_tail=group.k_tail,
        k_extra=group.deep.table if group.deep is not None else None,
    )
    return [group]


def register() -> None:
    from sglang.srt.kv_canary.pool_patcher.registry import register_pool_attacher

    for name in MLA_POOL_CLASSES:
        try:
            cls = import_sglang_class("sglang.srt.mem_cache.memory_pool", name)
        except ImportError:
            logger.warning("kv_canary: %s not found in this sglang; not covered", name)
            continue
        register_pool_attacher(cls, attach_mla)
