"""Every layer's KV rows of a pool as :class:`DeepColumn` s, and the per-layer fingerprint
table over them (``--kv-canary-real-data-layers all``; docs/subsystems.md, "Per-layer
fingerprints"). Used by the adapters when they build a group."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from sglang.jit_kernel.kv_canary.consts import RealKvHashMode
from sglang.jit_kernel.kv_canary.types import (
    DeepColumn,
    DeepFingerprintTable,
    KvHalf,
    RealKvSource,
)
from sglang.srt.kv_canary.config import RealDataLayers


def row_source(buf, what: str) -> RealKvSource:
    """One slot per row of ``buf`` (``[rows, ...]``), the whole row fingerprinted in ALL mode."""
    row_bytes = buf[0].nbytes
    try:
        return RealKvSource(
            tensor=buf, page_size=1, num_bytes_per_token=row_bytes, read_bytes=row_bytes
        )
    except ValueError as e:
        raise ValueError(f"kv_canary cannot fingerprint {what}: {e}") from e


def layer_columns(
    layer_ids: Sequence[int],
    k_buffers: Sequence,
    v_buffers: Optional[Sequence] = None,
    *,
    what: str,
) -> Tuple[DeepColumn, ...]:
    """Layer-major columns over per-layer buffers (buffer i holds sglang layer
    ``layer_ids[i]``): K, then V when ``v_buffers`` is given."""
    if len(layer_ids) != len(k_buffers):
        raise ValueError(
            f"kv_canary: {what} pool has {len(k_buffers)} layer buffers but "
            f"{len(layer_ids)} layer ids"
        )
    cols = []
    for i, k in enumerate(k_buffers):
        layer = int(layer_ids[i])
        cols.append(DeepColumn(layer, KvHalf.K, row_source(k, f"{what} layer {layer} K rows")))
        if v_buffers is not None:
            cols.append(
                DeepColumn(
                    layer, KvHalf.V, row_source(v_buffers[i], f"{what} layer {layer} V rows")
                )
            )
    return tuple(cols)


def pool_layer_ids(kv_pool, num_buffers: int) -> Tuple[int, ...]:
    """sglang layer ids of a pool's per-layer buffers: ``start_layer`` on (pipeline stages
    hold a slice of the layers)."""
    start = int(getattr(kv_pool, "start_layer", 0) or 0)
    return tuple(range(start, start + num_buffers))


def deep_table_for(
    columns: Sequence[DeepColumn], *, num_slots: int, config, device
) -> Optional[DeepFingerprintTable]:
    """The group's per-layer table with ``--kv-canary-real-data-layers all`` (None otherwise,
    or for a group without per-layer rows)."""
    if config.real_data_layers != RealDataLayers.ALL or not columns:
        return None
    if config.real_kv_hash_mode == RealKvHashMode.NONE:
        raise ValueError(
            "--kv-canary-real-data-layers=all needs --kv-canary-real-data partial or all"
        )
    return DeepFingerprintTable.allocate(
        num_slots=num_slots,
        columns=columns,
        mode=config.real_kv_hash_mode,
        layers_per_forward=config.real_data_layers_per_forward,
        device=device,
    )
