"""HiCache: the canary rows follow their KV pages to host memory and back (docs/architecture.md,
"HiCache").

With ``--enable-hierarchical-cache`` sglang backs KV pages up from the device pool to a
host-memory pool and loads them back, on a prefix hit, into (usually different) device slots.
A record is slot-independent (token, position, the predecessor's chain hash, the fingerprint
of the KV bytes), so a record copied along with its page verifies in its new slot exactly as
it did in the old one. :class:`HostTierMirror` keeps one host row per host-pool slot for each
canary buffer of each group (K/V head and tail records, the per-layer fingerprint table) and
copies them with sglang's own copies: after each device -> host backup and before the first
layer of each host -> device load, with the same host and device indices, on the same stream
(:func:`~sglang.jit_kernel.kv_canary.rows.launch_copy_rows`). The forward's canary work waits
for the first loaded layer (``hicache_wait_for_first_layer``) and the sweep for every queued
load (``hicache_wait_for_loads``) before reading records.

Not graph code: the copies run on HiCache's write / load streams, outside CUDA graphs.
"""

from __future__ import annotations

import logging
from typing import List, Sequence, Tuple

import torch

from sglang.jit_kernel.kv_canary.rows import launch_copy_rows
from sglang.jit_kernel.kv_canary.types import PoolKind
from sglang.srt.kv_canary import sglang_seam as seam
from sglang.srt.kv_canary.buffer_group import CanaryBufferGroup

logger = logging.getLogger(__name__)


class HostTierMirror:
    """Host rows of every canary buffer of ``groups`` for a HiCache host pool (FULL groups:
    sglang's HiCache builds its host pool for MHA and MLA pools). Host rows are pinned on
    CUDA (the copy kernel reaches them through unified addressing) and plain on the CPU.
    Wraps the host pool's copy methods on construction."""

    def __init__(self, *, groups: Sequence[CanaryBufferGroup], host_pool):
        kind = seam.host_pool_kind(host_pool)  # raises for a host pool it cannot mirror
        odd = [g.kind.name for g in groups if g.kind != PoolKind.FULL]
        if odd:
            raise NotImplementedError(
                f"kv_canary mirrors HiCache host rows of FULL groups only, got {odd}: run "
                "without --enable-hierarchical-cache or without --kv-canary")
        self.host_pool = host_pool
        self.kind = kind
        self.host_slots = seam.host_pool_size(host_pool)
        self.pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (device rows, host rows)
        for group in groups:
            bufs = [b.view(torch.int64) for b in (group.k_head, group.k_tail, group.v_head,
                                                   group.v_tail) if b is not None]
            if group.deep is not None:
                bufs.append(group.deep.table)
            for rows in bufs:
                pin = rows.device.type == "cuda"
                host = torch.zeros((self.host_slots, rows.shape[1]), dtype=torch.int64,
                                   pin_memory=pin)
                self.pairs.append((rows, host))
        self.bytes_per_host_slot = sum(h.shape[1] * 8 for _, h in self.pairs)
        self.backed_up_slots = 0  # host slots written by backups so far
        self.loaded_slots = 0  # device slots filled by loads so far
        seam.wrap_host_pool_copies(host_pool, after_backup=self.backup, before_load=self.load)
        logger.info("kv_canary: HiCache host tier mirrored (%s host pool, %d host slots, %d "
                    "canary bytes per slot: %.1f MB of host memory)", kind, self.host_slots,
                    self.bytes_per_host_slot, self.host_slots * self.bytes_per_host_slot / 1e6)

    def backup(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """After sglang copied the KV of ``device_indices`` to ``host_indices``: the rows."""
        for rows, host in self.pairs:
            launch_copy_rows(src=rows, dst=host, src_indices=device_indices,
                             dst_indices=host_indices)
        self.backed_up_slots += int(host_indices.shape[0])

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Before sglang loads the KV of ``host_indices`` into ``device_indices``: the rows."""
        for rows, host in self.pairs:
            launch_copy_rows(src=host, dst=rows, src_indices=host_indices,
                             dst_indices=device_indices)
        self.loaded_slots += int(device_indices.shape[0])

    def host_rows(self, index: int) -> torch.Tensor:
        """The host copy of canary buffer ``index`` (in the order above; tests, self-tests)."""
        return self.pairs[index][1]
