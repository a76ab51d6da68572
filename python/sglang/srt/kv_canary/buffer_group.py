"""``CanaryBufferGroup``: the canary buffers guarding one slot address space
(docs/architecture.md, "Buffer groups and adapters")."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from sglang.jit_kernel.kv_canary.types import (
    CANARY_SLOT_BYTES,
    DeepColumn,
    DeepFingerprintTable,
    PoolKind,
    RealKvSource,
)

__all__ = ["CanaryBufferGroup", "PoolKind"]


@dataclasses.dataclass(frozen=True, eq=False)
class CanaryBufferGroup:
    """Canary buffers of one pool (FULL) or of one SWA sub-pool (SWA).

    HEAD buffers are written/verified before the model forward (no real-KV fingerprint: the
    new KV is not written yet); TAIL buffers after it (with the fingerprint); SWEEP launches
    verify the TAIL buffers. Each buffer is uint8 ``[num_slots, 32]``; V buffers are ``None``
    when V-half launches are off. ``swa_index_lut`` maps FULL slots to this group's slots (SWA
    groups only; 0 = evicted) and ``swa_window_size`` is the sliding window (0 for FULL).
    ``kv_token_id_vs_position_offset`` is 1 for EAGLE draft pools, else 0.
    ``layer_columns``: every layer's K (and V) rows of this group's pool, layer-major (what the
    per-layer fingerprints and the perturbation's layer targets address); ``deep``: the
    per-layer fingerprint table over them (``--kv-canary-real-data-layers all``), else None.
    """

    kind: PoolKind
    k_head: torch.Tensor
    k_tail: torch.Tensor
    v_head: Optional[torch.Tensor]
    v_tail: Optional[torch.Tensor]
    real_kv_sources_k: Tuple[RealKvSource, ...]
    real_kv_sources_v: Tuple[RealKvSource, ...]
    swa_index_lut: Optional[torch.Tensor]
    kv_token_id_vs_position_offset: int
    swa_window_size: int = 0
    layer_columns: Tuple[DeepColumn, ...] = ()
    deep: Optional[DeepFingerprintTable] = None

    def __post_init__(self):
        if not isinstance(self.kind, PoolKind):
            raise TypeError(f"kind must be a PoolKind, got {self.kind!r}")
        bufs = {"k_head": self.k_head, "k_tail": self.k_tail}
        if (self.v_head is None) != (self.v_tail is None):
            raise ValueError("v_head and v_tail must both be given or both be None")
        if self.v_head is not None:
            bufs.update(v_head=self.v_head, v_tail=self.v_tail)
        rows = self.k_head.shape[0]
        for name, buf in bufs.items():
            if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape != (rows, CANARY_SLOT_BYTES):
                raise ValueError(
                    f"{name} must be uint8 [{rows}, {CANARY_SLOT_BYTES}], got "
                    f"{buf.dtype} {tuple(buf.shape)}"
                )
        if self.kind == PoolKind.SWA:
            if self.swa_index_lut is None or self.swa_window_size <= 0:
                raise ValueError("a SWA group needs swa_index_lut and swa_window_size > 0")
        elif self.swa_index_lut is not None or self.swa_window_size:
            raise ValueError("a FULL group has no swa_index_lut and no window")
        object.__setattr__(self, "layer_columns", tuple(self.layer_columns))
        if self.deep is not None and self.deep.num_slots != rows:
            raise ValueError(f"deep table has {self.deep.num_slots} rows, the group {rows}")

    @property
    def num_slots(self) -> int:
        return self.k_head.shape[0]

    def mirror_kv_move(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Do to this group's records (HEAD and TAIL, K and V) and per-layer fingerprints what
        sglang's ``move_kv_cache(tgt_loc, src_loc)`` does to the KV: row ``tgt_loc[i]``
        becomes row ``src_loc[i]`` as it was before the call. Every source row is read before
        any is written (the two may overlap: a compaction's targets include accepted nodes'
        slots). ``tgt_loc`` / ``src_loc``: integer ``[n]`` slots of this group's slot space,
        on its device. Eager only (allocates the gathered rows), on the current stream:
        docs/speculative_standalone_ngram.md, "2.6 Page size > 1"."""
        if tgt_loc.shape != src_loc.shape:
            raise ValueError(
                f"kv_canary: move_kv_cache with {tuple(tgt_loc.shape)} target slots and "
                f"{tuple(src_loc.shape)} source slots"
            )
        if tgt_loc.numel() == 0:
            return
        tgt = tgt_loc.reshape(-1).to(device=self.k_head.device, dtype=torch.int64)
        src = src_loc.reshape(-1).to(device=self.k_head.device, dtype=torch.int64)
        buffers = [self.k_head, self.k_tail]
        if self.has_v:
            buffers += [self.v_head, self.v_tail]
        if self.deep is not None:
            buffers.append(self.deep.table)
        rows = [buf.index_select(0, src) for buf in buffers]
        for buf, moved in zip(buffers, rows):
            buf.index_copy_(0, tgt, moved)

    def fingerprinted_tensors(self) -> Tuple[torch.Tensor, ...]:
        """The KV tensors this group fingerprints (its real-KV sources and per-layer columns):
        what ties it to the pool whose ``move_kv_cache`` it mirrors."""
        sources = (*self.real_kv_sources_k, *self.real_kv_sources_v)
        return tuple(src.tensor for src in sources) + tuple(
            col.source.tensor for col in self.layer_columns
        )

    @property
    def has_v(self) -> bool:
        return self.v_head is not None
